"""A two-host Ray cluster on one machine: two network namespaces joined by a veth pair.

    sudo python scripts/netns_cluster.py        # builds it, prints how to use it, waits

"head" (198.51.100.1) runs the Ray head (and the trainer); "node" (198.51.100.2)
runs a Ray worker node whose CPUs carry the custom resource ``prep``, so a fleet
started with ``--resources '{"prep": 1}'`` lands there and every batch crosses
the veth. Both namespaces get a default route over the veth, so Ray and dpex
pick the veth addresses. Everything (processes, namespaces) is removed on exit,
also when the caller fails. Needs root and ``ip`` (iproute2).
"""

from __future__ import annotations

import contextlib
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
    node_ns: str
    head_veth: str
    address: str
    env: dict
    procs: list[subprocess.Popen] = field(default_factory=list)

    def cmd(self, ns: str, *args: str) -> list[str]:
        return ["ip", "netns", "exec", ns, *args]

    def rx_bytes(self) -> int:
        """Bytes the head's end of the veth has received so far."""
        out = subprocess.run(self.cmd(self.head_ns, "cat",
                                      f"/sys/class/net/{self.head_veth}/statistics/rx_bytes"),
                             check=True, capture_output=True, text=True).stdout
        return int(out)

    def set_link(self, up: bool) -> None:
        """Cut (or restore) the link between the two hosts."""
        _ip("netns", "exec", self.head_ns, "ip", "link", "set", self.head_veth,
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
    """Build the namespaces, start the Ray head and worker node; tear all down after."""
    tag = f"{os.getpid() % 100000}"
    head_ns, node_ns = f"dpxh{tag}", f"dpxn{tag}"
    head_veth, node_veth = f"dpxh{tag}v", f"dpxn{tag}v"
    temp = tempfile.mkdtemp(prefix="dpexnetns")
    port = 6379
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16),
               DPEX_ADVERTISE_ADDRESS=HEAD_IP,
               PYTHONPATH=os.pathsep.join(p for p in (root, env.get("PYTHONPATH")) if p))
    cluster = Cluster(head_ns, node_ns, head_veth, f"{HEAD_IP}:{port}", env)
    try:
        for ns in (head_ns, node_ns):
            _ip("netns", "add", ns)
        _ip("link", "add", head_veth, "type", "veth", "peer", "name", node_veth)
        for ns, veth, ip in ((head_ns, head_veth, HEAD_IP), (node_ns, node_veth, NODE_IP)):
            _ip("link", "set", veth, "netns", ns)
            for args in (("addr", "add", f"{ip}/24", "dev", veth), ("link", "set", veth, "up"),
                         ("link", "set", "lo", "up"), ("route", "add", "default", "dev", veth)):
                _ip("netns", "exec", ns, "ip", *args)
        common = ["--block", "--disable-usage-stats"]
        head = subprocess.Popen(
            cluster.cmd(head_ns, os.path.join(BIN, "ray"), "start", "--head",
                        f"--node-ip-address={HEAD_IP}", f"--port={port}", "--num-cpus=0",
                        "--include-dashboard=false", f"--temp-dir={temp}/head", *common),
            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        cluster.procs.append(head)
        _wait_port(head_ns, HEAD_IP, port, head, 60)
        node = subprocess.Popen(
            cluster.cmd(node_ns, os.path.join(BIN, "ray"), "start",
                        f"--address={cluster.address}", f"--node-ip-address={NODE_IP}",
                        f"--num-cpus={node_cpus}", f'--resources={{"prep": {node_cpus}}}',
                        *common),
            env=env, start_new_session=True, stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL)
        cluster.procs.append(node)
        _ray_nodes_alive(cluster, head_ns, 2, 90)
        yield cluster
    finally:
        for proc in reversed(cluster.procs):
            with contextlib.suppress(ProcessLookupError):
                os.killpg(proc.pid, signal.SIGTERM)
        deadline = time.monotonic() + 3  # a Ray node drains up to 30 s on SIGTERM: no
        for proc in cluster.procs:
            try:
                proc.wait(max(0.0, deadline - time.monotonic()))
            except subprocess.TimeoutExpired:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(5)
        for ns in (head_ns, node_ns):  # also removes the veth pair
            subprocess.run(["ip", "netns", "del", ns], capture_output=True)
        shutil.rmtree(temp, ignore_errors=True)


def main() -> None:
    reason = available()
    if reason:
        sys.exit(f"netns_cluster: {reason}")
    with two_hosts() as c:
        print(f"Ray head {c.address} in namespace {c.head_ns}; worker node {NODE_IP} in "
              f"{c.node_ns} with resource 'prep'.\nIn another shell (same RAY_AUTH_TOKEN):\n"
              f"  export RAY_AUTH_MODE=token RAY_AUTH_TOKEN={c.env['RAY_AUTH_TOKEN']} "
              f"DPEX_ADVERTISE_ADDRESS={HEAD_IP}\n"
              f"  ip netns exec {c.head_ns} dpex fleet start --name prep --workers 2 "
              f"--resources '{{\"prep\": 1}}' --address {c.address}\n"
              "Ctrl-C stops the cluster and removes the namespaces.", flush=True)
        with contextlib.suppress(KeyboardInterrupt):
            signal.pause()


if __name__ == "__main__":
    main()
