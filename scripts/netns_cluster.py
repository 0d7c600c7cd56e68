"""A Ray cluster of several hosts on one machine: network namespaces on a bridge.

    sudo python scripts/netns_cluster.py        # builds it, prints how to use it, waits
    sudo python scripts/netns_cluster.py --nodes 3

"head" (198.51.100.1, on a bridge in its namespace) runs the Ray head (and the
trainer); each "node" i (198.51.100.2, .3, ...) runs a Ray worker node in its own
namespace, joined to the bridge by a veth pair. A node's CPUs carry the custom
resource ``prep``, so a fleet started with ``--resources '{"prep": 1}'`` lands
there and every batch crosses a veth; node i also holds one unit of ``hosts<k>``
for each k > i, so asking for ``hosts<k>`` places a worker on one of the first k
nodes (scripts/bench_hosts.py). Every namespace has a default route over its
link, so Ray and dpex pick those addresses. Everything (processes, namespaces,
links) is removed on exit, also when the caller fails. Needs root and ``ip``
(iproute2).

``other_subnet()`` builds namespaces without Ray: a head on 198.51.100.1/25 and
hosts on the other /25 (198.51.100.130, ...), outside the subnet of the head's
address, as a node an autoscaler adds in another zone (tests/test_accept_netns.py).
"""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator
from dataclasses import dataclass, field

HEAD_IP, NODE_IP = "198.51.100.1", "198.51.100.2"  # a documentation range (RFC 5737)


def node_ip(i: int) -> str:
    """The address of worker node ``i`` (0: ``NODE_IP``)."""
    return f"198.51.100.{2 + i}"
BIN = os.path.dirname(sys.executable)


def available() -> str | None:
    """``None`` when namespaces can be built here, else the reason they cannot."""
    if os.geteuid() != 0:
        return "network namespaces need root"
    if shutil.which("ip") is None:
        return "`ip` (iproute2) is not installed"
    return None


def _ip(*args: str) -> None:
    subprocess.run(["ip", *args], check=True, capture_output=True, text=True)


@dataclass
class Cluster:
    head_ns: str
    node_nss: list[str]  # one namespace per worker node
    head_veths: list[str]  # each node's link, the head's end (a bridge port)
    address: str
    env: dict
    procs: list[subprocess.Popen] = field(default_factory=list)

    @property
    def node_ns(self) -> str:
        return self.node_nss[0]

    @property
    def head_veth(self) -> str:
        """The head's end of the first node's link (cut it to cut that node off)."""
        return self.head_veths[0]

    def cmd(self, ns: str, *args: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *args]

    def rx_bytes(self) -> int:
        """Bytes the head has received from all nodes so far."""
        paths = [f"/sys/class/net/{v}/statistics/rx_bytes" for v in self.head_veths]
        out = subprocess.run(self.cmd(self.head_ns, "cat", *paths),
                             check=True, capture_output=True, text=True).stdout
        return sum(int(line) for line in out.split())

    def set_link(self, up: bool) -> None:
        """Cut (or restore) the links between the head and every node."""
        for veth in self.head_veths:
            _ip("netns", "exec", self.head_ns, "ip", "link", "set", veth,
                "up" if up else "down")


def _wait_port(ns: str, ip: str, port: int, proc: subprocess.Popen, limit: float) -> None:
    deadline = time.monotonic() + limit
    probe = f"import socket; socket.create_connection(('{ip}', {port}), 0.5).close()"
    while subprocess.run(["ip", "netns", "exec", ns, sys.executable, "-c", probe],
                         capture_output=True).returncode != 0:
        if proc.poll() is not None or time.monotonic() > deadline:
            raise RuntimeError(f"Ray did not come up on {ip}:{port} in namespace {ns}")
        time.sleep(0.3)


def _ray_nodes_alive(cluster: Cluster, ns: str, want: int, limit: float) -> None:
    code = (f"import ray; ray.init(address='{cluster.address}', logging_level='ERROR'); "
            "print(sum(n['Alive'] for n in ray.nodes()))")
    deadline = time.monotonic() + limit
    while True:
        out = subprocess.run(cluster.cmd(ns, sys.executable, "-c", code), env=cluster.env,
                             capture_output=True, text=True, timeout=60)
        if out.stdout.strip().isdigit() and int(out.stdout.strip()) >= want:
            return
        if time.monotonic() > deadline:
            raise RuntimeError(f"the Ray worker node did not join: {out.stderr[-2000:]}")
        time.sleep(1)


@contextlib.contextmanager
def two_hosts(node_cpus: int = 2) -> Iterator[Cluster]:
    """A head and one worker node (see :func:`hosts`)."""
    with hosts(1, node_cpus) as cluster:
        yield cluster


@contextlib.contextmanager
def _network(tag: str, head_cidrs: list[str],
             node_cidrs: list[str]) -> Iterator[tuple[str, list[str], list[str]]]:
    """A head namespace with a bridge holding ``head_cidrs`` and one namespace per
    ``node_cidrs`` entry joined to it by a veth pair (default routes over the links);
    yields (head namespace, node namespaces, the head's ends of the links). All is
    removed on exit."""
    head_ns, bridge = f"dpxh{tag}", f"dpxb{tag}"
    count = len(node_cidrs)
    node_nss = [f"dpxn{tag}" if i == 0 else f"dpxn{tag}-{i}" for i in range(count)]
    head_veths = [f"dpxh{tag}v" if i == 0 else f"dpxh{tag}v{i}" for i in range(count)]
    node_veths = [f"dpxn{tag}v" if i == 0 else f"dpxn{tag}v{i}" for i in range(count)]
    made: list[str] = []
    try:
        _ip("netns", "add", head_ns)
        made.append(head_ns)
        in_head = ("netns", "exec", head_ns, "ip")
        _ip(*in_head, "link", "add", bridge, "type", "bridge")
        for cidr in head_cidrs:
            _ip(*in_head, "addr", "add", cidr, "dev", bridge)
        for args in (("link", "set", bridge, "up"), ("link", "set", "lo", "up"),
                     ("route", "add", "default", "dev", bridge)):
            _ip(*in_head, *args)
        for ns, head_veth, node_veth, cidr in zip(node_nss, head_veths, node_veths,
                                                  node_cidrs, strict=True):
            _ip("netns", "add", ns)
            made.append(ns)
            _ip("link", "add", head_veth, "type", "veth", "peer", "name", node_veth)
            _ip("link", "set", head_veth, "netns", head_ns)
            _ip(*in_head, "link", "set", head_veth, "master", bridge)
            _ip(*in_head, "link", "set", head_veth, "up")
            _ip("link", "set", node_veth, "netns", ns)
            for args in (("addr", "add", cidr, "dev", node_veth),
                         ("link", "set", node_veth, "up"), ("link", "set", "lo", "up"),
                         ("route", "add", "default", "dev", node_veth)):
                _ip("netns", "exec", ns, "ip", *args)
        yield head_ns, node_nss, head_veths
    finally:
        for ns in made:  # also removes the bridge and the veth pairs
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)


# The other half of the /24: hosts on a subnet the head has no address of its own in
# (as a node an autoscaler adds in another zone).
OTHER_SUBNET_GATEWAY = "198.51.100.129"


def other_subnet_ip(i: int) -> str:
    """The address of host ``i`` of :func:`other_subnet` (198.51.100.130, ...)."""
    return f"198.51.100.{130 + i}"


@dataclass
class Hosts:
    """Namespaces without Ray (:func:`other_subnet`)."""

    head_ns: str
    node_nss: list[str]
    node_ips: list[str]

    def cmd(self, ns: str, *args: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *args]


@contextlib.contextmanager
def other_subnet(nodes: int = 1) -> Iterator[Hosts]:
    """A head on 198.51.100.1/25 and ``nodes`` hosts on the other /25 (198.51.100.130,
    ... ; the head routes there through 198.51.100.129 on the same bridge): hosts
    outside the subnet of the head's address. No Ray: the caller runs what it needs
    with ``cmd``."""
    if not 1 <= nodes <= 9:
        raise ValueError(f"nodes={nodes}: 1 to 9 hosts")
    tag = f"{os.getpid() % 100000}s"
    ips = [other_subnet_ip(i) for i in range(nodes)]
    with _network(tag, [f"{HEAD_IP}/25", f"{OTHER_SUBNET_GATEWAY}/25"],
                  [f"{ip}/25" for ip in ips]) as (head_ns, node_nss, _):
        yield Hosts(head_ns, node_nss, ips)


@contextlib.contextmanager
def hosts(nodes: int = 1, node_cpus: int = 2) -> Iterator[Cluster]:
    """Build the namespaces and links, start the Ray head and ``nodes`` worker nodes;
    tear all down after."""
    if not 1 <= nodes <= 9:
        raise ValueError(f"nodes={nodes}: 1 to 9 worker nodes")
    tag = f"{os.getpid() % 100000}"
    temp = tempfile.mkdtemp(prefix="dpexnetns")
    port = 6379
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16),
               DPEX_ADVERTISE_ADDRESS=HEAD_IP,
               PYTHONPATH=os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p))
    network = _network(tag, [f"{HEAD_IP}/24"], [f"{node_ip(i)}/24" for i in range(nodes)])
    with network as (head_ns, node_nss, head_veths):
        cluster = Cluster(head_ns, node_nss, head_veths, f"{HEAD_IP}:{port}", env)
        try:
            _start_ray(cluster, temp, port, node_cpus)
            yield cluster
        finally:
            _stop(cluster.procs)
            shutil.rmtree(temp, ignore_errors=True)


def _start_ray(cluster: Cluster, temp: str, port: int, node_cpus: int) -> None:
    """The Ray head in the head namespace, then one worker node per node namespace."""
    common = ["--block", "--disable-usage-stats"]
    head = subprocess.Popen(
        cluster.cmd(cluster.head_ns, os.path.join(BIN, "ray"), "start", "--head",
                    f"--node-ip-address={HEAD_IP}", f"--port={port}", "--num-cpus=0",
                    "--include-dashboard=false", f"--temp-dir={temp}/head", *common),
        env=cluster.env, start_new_session=True, stdout=subprocess.DEVNULL,
        stderr=subprocess.DEVNULL)
    cluster.procs.append(head)
    _wait_port(cluster.head_ns, HEAD_IP, port, head, 60)
    nodes = len(cluster.node_nss)
    for i, ns in enumerate(cluster.node_nss):
        resources = {"prep": node_cpus, **{f"hosts{k}": 1 for k in range(i + 1, nodes + 1)}}
        node = subprocess.Popen(
            cluster.cmd(ns, os.path.join(BIN, "ray"), "start",
                        f"--address={cluster.address}", f"--node-ip-address={node_ip(i)}",
                        f"--num-cpus={node_cpus}",
                        f"--resources={json.dumps(resources)}", *common),
            env=cluster.env, start_new_session=True, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        cluster.procs.append(node)
        # One at a time: nodes of one machine share Ray's session directory, and
        # two that start together can collide there (one never joins).
        _ray_nodes_alive(cluster, cluster.head_ns, 2 + i, 90)


def _stop(procs: list[subprocess.Popen]) -> None:
    for proc in reversed(procs):
        with contextlib.suppress(ProcessLookupError):
            os.killpg(proc.pid, signal.SIGTERM)
    deadline = time.monotonic() + 3  # a Ray node drains up to 30 s on SIGTERM: no
    for proc in procs:
        try:
            proc.wait(max(0.0, deadline - time.monotonic()))
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait(5)


def main() -> None:
    import argparse

    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--nodes", type=int, default=1, help="worker nodes (1-9)")
    args = p.parse_args()
    reason = available()
    if reason:
        sys.exit(f"netns_cluster: {reason}")
    with hosts(args.nodes) as c:
        nodes = ", ".join(f"{node_ip(i)} ({ns})" for i, ns in enumerate(c.node_nss))
        print(f"Ray head {c.address} in namespace {c.head_ns}; worker nodes {nodes} with "
              f"resource 'prep'.\nIn another shell (same RAY_AUTH_TOKEN):\n"
              f"  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN={c.env['RAY_AUTH_TOKEN']} "
              f"DPEX_ADVERTISE_ADDRESS={HEAD_IP}\n"
              f"  ip netns exec {c.head_ns} dpex fleet start --name prep --workers 2 "
              f"--resources '{{\"prep\": 1}}' --address {c.address}\n"
              "Ctrl-C stops the cluster and removes the namespaces.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    main()
