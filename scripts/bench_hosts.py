"""Benchmark: one trainer fed by workers on 1, 2 and 3 other hosts, against the rank's ingest ceiling.

Builds a Ray cluster of network namespaces on a bridge (scripts/netns_cluster.py:
the head runs the trainer, each worker node is another "host", every batch crosses
a veth) and, for each number of hosts and each security mode (authenticated:
frames in clear; encrypted: CURVE), runs in the head's namespace:

- ``dpex``: a DpexDataLoader whose ``--workers-per-host`` workers per host (placed
  with the custom resource ``hosts<k>``) send ready-made batches (``batch_size=None``,
  one preallocated tensor: no dataset cost, so the socket path alone is timed); the
  first epoch warms up, the second is timed;
- ``raw``: the rank's ingest ceiling, raw ZeroMQ PUSH sockets in the same hosts'
  namespaces (as many senders as workers) pushing the same bytes to one PULL socket
  in the head's, NULL or CURVE as the mode, no protocol and no credits.

Reported per scenario: batches/s, GB/s, the trainer process's CPU per batch, and
dpex / raw. Everything runs on this machine's cores, so the hosts' senders compete
with the trainer for them: the ceiling is this machine's, stated as such.

    sudo python scripts/bench_hosts.py                 # 1, 2, 3 hosts; both modes
    sudo python scripts/bench_hosts.py --quick         # a smoke run

Writes a markdown table to stdout, and JSON and a PNG plot to --out (default docs/bench/).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import tempfile
import time
from typing import Any

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
sys.path.insert(0, HERE)
import bench  # noqa: E402  (the raw reference's sockets, the outputs)

SHAPES = {  # the batches of scripts/bench.py's scenarios: (shape, dtype name, batches timed)
    "large": ((64, 3, 224, 224), "uint8", 200),
    "medium": ((32, 3, 64, 64), "float32", 600),
    "small": ((256, 64), "float32", 2000),
}
MODES = ("authenticated", "encrypted")


class Premade:
    """A map-style dataset of ``n`` identical ready-made batches (``batch_size=None``)."""

    def __init__(self, shape: tuple, dtype: str, n: int) -> None:
        self.shape, self.dtype, self.n, self._batch = shape, dtype, n, None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> Any:
        import torch

        if self._batch is None:
            self._batch = torch.full(self.shape, 7, dtype=getattr(torch, self.dtype))
        return self._batch


def _frames(scenario: str) -> list[bytes]:
    import torch

    from dpex._codec import encode_batch

    shape, dtype, _ = SHAPES[scenario]
    parts = encode_batch(torch.full(shape, 7, dtype=getattr(torch, dtype)))
    return [bytes(memoryview(p).cast("B")) for p in parts]


def trainer(args: Any) -> None:
    """In the head's namespace: the dpex loader over ``args.hosts`` hosts, every scenario."""
    import ray

    from dpex import DpexDataLoader

    ray.init(address=args.address, logging_level="ERROR")
    per_worker = 1.0 / args.workers_per_host  # each host holds one unit of hosts<k>
    out = {}
    for scenario in args.scenarios:
        shape, dtype, batches = SHAPES[scenario]
        batches = max(20, batches // (10 if args.quick else 1))
        loader = DpexDataLoader(
            Premade(shape, dtype, batches), batch_size=None,
            num_workers=args.hosts * args.workers_per_host, persistent_workers=True,
            encryption=args.mode == "encrypted", distribute_mode=True,
            ray_remote_args={"resources": {f"hosts{args.hosts}": per_worker}})
        with loader:
            for _ in loader:  # warm-up epoch: the workers' start, pages, connections
                pass
            nbytes, n = 0, 0
            cpu0, t0 = time.process_time(), time.perf_counter()
            for batch in loader:
                nbytes += batch.numel() * batch.element_size()
                n += 1
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
            stats = loader.stats()
        ips = sorted({w["node_ip"] for w in stats["workers"].values()})
        out[scenario] = {"batches_per_s": n / elapsed, "gb_per_s": nbytes / elapsed / 1e9,
                         "cpu_us_per_batch": cpu / n * 1e6, "security": stats["security"],
                         "hosts": ips, "transports": sorted(
                             {w["transport"] for w in stats["workers"].values()})}
    ray.shutdown()
    print(json.dumps(out))


def raw_sender(args: Any) -> None:
    """In a node's namespace: push the scenario's frames ``args.count`` times."""
    import zmq

    frames = _frames(args.scenario)
    ctx = zmq.Context()
    sock = bench.raw_push(ctx, 2, args.server_key.encode() or None)
    sock.connect(args.address)
    sock.send(b"hello")  # connected; now wait until every sender is
    deadline = time.monotonic() + 120
    while not os.path.exists(args.go_file):
        if time.monotonic() > deadline:
            raise TimeoutError("the receiver never said go")
        time.sleep(0.001)
    for _ in range(args.count):
        sock.send_multipart(frames, copy=False)
    sock.close()
    ctx.term()


def raw_receiver(args: Any) -> None:
    """In the head's namespace: one PULL socket, senders in the first ``args.hosts``
    nodes' namespaces; every scenario."""
    import netns_cluster
    import zmq

    out = {}
    for scenario in args.scenarios:
        _, _, batches = SHAPES[scenario]
        batches = max(20, batches // (10 if args.quick else 1))
        senders = args.hosts * args.workers_per_host
        warm = 2 * senders
        per_sender = -(-(batches + warm) // senders)
        nbytes = sum(len(f) for f in _frames(scenario)[1:])
        ctx = zmq.Context()
        pull, public = bench.raw_pull(ctx, 2, args.mode == "encrypted")
        key = public.decode() if public else ""
        port = pull.bind_to_random_port(f"tcp://{netns_cluster.HEAD_IP}")
        go = os.path.join(tempfile.mkdtemp(prefix="dpexbench"), "go")
        procs = [subprocess.Popen(
            ["ip", "netns", "exec", args.node_nss[i % args.hosts], sys.executable, __file__,
             "--role", "raw-sender", "--scenario", scenario, "--count", str(per_sender),
             "--address", f"tcp://{netns_cluster.HEAD_IP}:{port}", f"--server-key={key}",
             "--go-file", go]) for i in range(senders)]
        try:
            for _ in range(senders):  # every sender started and connected (untimed)
                if not pull.poll(120_000):
                    raise TimeoutError("the raw senders did not start")
                pull.recv()
            open(go, "w").close()
            for _ in range(warm):
                if not pull.poll(120_000):
                    raise TimeoutError("the raw senders did not start")
                pull.recv_multipart(copy=False)
            n = per_sender * senders - warm
            cpu0, t0 = time.process_time(), time.perf_counter()
            for _ in range(n):
                if not pull.poll(60_000):
                    raise TimeoutError("a raw sender stopped sending")
                pull.recv_multipart(copy=False)
            elapsed, cpu = time.perf_counter() - t0, time.process_time() - cpu0
        finally:
            for p in procs:
                try:
                    p.wait(30)
                except subprocess.TimeoutExpired:
                    p.kill()
                    p.wait(5)
            pull.close()
            ctx.term()
            shutil.rmtree(os.path.dirname(go), ignore_errors=True)
        out[scenario] = {"batches_per_s": n / elapsed, "gb_per_s": n * nbytes / elapsed / 1e9,
                         "cpu_us_per_batch": cpu / n * 1e6}
    print(json.dumps(out))


def table(results: list[dict]) -> str:
    rows = ["| scenario | mode | hosts | dpex batches/s | dpex GB/s | raw ZeroMQ GB/s "
            "(ingest ceiling) | dpex / raw | trainer CPU µs/batch dpex / raw |",
            "|---|---|---:|---:|---:|---:|---:|---:|"]
    for r in results:
        d, w = r["dpex"], r["raw"]
        rows.append(f"| {r['scenario']} | {r['mode']} | {r['hosts']} | "
                    f"{d['batches_per_s']:.0f} | {d['gb_per_s']:.2f} | {w['gb_per_s']:.2f} | "
                    f"{d['gb_per_s'] / w['gb_per_s']:.2f} | "
                    f"{d['cpu_us_per_batch']:.0f} / {w['cpu_us_per_batch']:.0f} |")
    return "\n".join(rows)


def plot(results: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    scenarios = sorted({r["scenario"] for r in results}, key=list(SHAPES).index)
    fig, axes = plt.subplots(1, len(scenarios), figsize=(4 * len(scenarios), 3.6),
                             squeeze=False)
    for ax, scenario in zip(axes[0], scenarios, strict=True):
        for mode, colour in zip(MODES, ("tab:blue", "tab:red"), strict=True):
            rows = [r for r in results if r["scenario"] == scenario and r["mode"] == mode]
            if not rows:
                continue
            hosts = [r["hosts"] for r in rows]
            ax.plot(hosts, [r["dpex"]["gb_per_s"] for r in rows], "o-", color=colour,
                    label=f"dpex, {mode}")
            ax.plot(hosts, [r["raw"]["gb_per_s"] for r in rows], "s--", color=colour,
                    alpha=0.6, label=f"raw ZeroMQ, {mode}")
        ax.set_title(scenario)
        ax.set_xlabel("hosts feeding the rank")
        ax.set_xticks([1, 2, 3])
        ax.set_ylabel("GB/s into one trainer")
        ax.set_ylim(bottom=0)
    axes[0][0].legend(fontsize=7)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--role", choices=["main", "trainer", "raw-receiver", "raw-sender"],
                   default="main", help=argparse.SUPPRESS)
    p.add_argument("--hosts", type=int, nargs="+", default=[1, 2, 3])
    p.add_argument("--modes", nargs="+", default=list(MODES), choices=MODES)
    p.add_argument("--scenarios", nargs="+", default=list(SHAPES), choices=list(SHAPES))
    p.add_argument("--workers-per-host", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="a tenth of the batches")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    for name in ("--address", "--mode", "--scenario", "--server-key", "--go-file"):
        p.add_argument(name, default="", help=argparse.SUPPRESS)
    p.add_argument("--count", type=int, default=0, help=argparse.SUPPRESS)
    p.add_argument("--node-nss", nargs="*", default=[], help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.role == "trainer":
        args.hosts = args.hosts[0]
        return trainer(args)
    if args.role == "raw-receiver":
        args.hosts = args.hosts[0]
        return raw_receiver(args)
    if args.role == "raw-sender":
        return raw_sender(args)

    import netns_cluster

    reason = netns_cluster.available()
    if reason:
        sys.exit(f"bench_hosts: {reason}")
    most = max(args.hosts)
    common = ["--scenarios", *args.scenarios, "--workers-per-host", str(args.workers_per_host),
              *(["--quick"] if args.quick else [])]
    results = []
    print(f"building {most} hosts and a head (network namespaces on a bridge) ...", flush=True)
    with netns_cluster.hosts(most, node_cpus=args.workers_per_host) as cluster:
        def in_head(*extra: str) -> dict:
            proc = subprocess.run(cluster.cmd(cluster.head_ns, sys.executable, __file__, *extra,
                                              *common),
                                  env=cluster.env, cwd=ROOT, capture_output=True, text=True,
                                  timeout=900)
            if proc.returncode != 0:
                raise RuntimeError(f"{extra[:2]} failed:\n{proc.stderr[-3000:]}")
            return json.loads(proc.stdout.strip().splitlines()[-1])

        for mode in args.modes:
            for k in args.hosts:
                t0 = time.perf_counter()
                dpex = in_head("--role", "trainer", "--hosts", str(k), "--mode", mode,
                               "--address", cluster.address)
                raw = in_head("--role", "raw-receiver", "--hosts", str(k), "--mode", mode,
                              "--node-nss", *cluster.node_nss)
                for scenario in args.scenarios:
                    d, w = dpex[scenario], raw[scenario]
                    results.append({"scenario": scenario, "mode": mode, "hosts": k,
                                    "dpex": d, "raw": w})
                    print(f"{mode:13s} {k} host(s) {scenario:6s} dpex {d['gb_per_s']:5.2f} GB/s "
                          f"{d['batches_per_s']:7.0f} b/s (from {', '.join(d['hosts'])}, "
                          f"{d['security']})  raw {w['gb_per_s']:5.2f} GB/s "
                          f"{w['batches_per_s']:7.0f} b/s", flush=True)
                print(f"  ({time.perf_counter() - t0:.0f} s)", flush=True)
    results.sort(key=lambda r: (list(SHAPES).index(r["scenario"]), r["mode"], r["hosts"]))
    md = table(results)
    print("\n" + md)
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(),
            "workers_per_host": args.workers_per_host, "quick": args.quick}
    bench.write_outputs(args.out, "hosts", {"meta": meta, "results": results}, md,
                        lambda path: plot(results, path))


if __name__ == "__main__":
    main()
