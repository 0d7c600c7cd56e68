"""Benchmark: batch latency, from a batch being ready in a worker to the training loop holding it.

Each of ``--workers`` workers makes one batch every ``--interval-ms`` (the dataset
sleeps once per batch), so the training loop (an empty body) is always waiting and
no batch queues behind another: what is measured is the path's own latency, not the
prefetch window. The worker stamps the header with its wall clock once the batch is
collated (``stats()["batch_latency"]``, docs/STATS.md); the loop reads the clock
when ``next()`` returns it. Paths: the same-node ring (``dpex``), the socket path of
workers on other nodes in each security mode (``dpex-socket``: authenticated,
frames in clear; ``dpex-socket-enc``: CURVE) and, beside them, raw ZeroMQ's one-way
latency for the same bytes at the same pace (``zmq-raw``, ``zmq-raw-curve``: one
sender process per worker stamps a frame right before ``send``, this process reads
the clock right after ``recv``). All on this machine, one clock: no skew.

    python scripts/bench_latency.py                  # small, medium, large; 300 batches each
    python scripts/bench_latency.py --quick          # a smoke run

Writes a markdown table (p50 / p99 in ms, and the dpex-added part: dpex's p50 minus
raw ZeroMQ's in the same mode) to stdout, and JSON and a PNG plot to --out
(default docs/bench/).
"""

from __future__ import annotations

import argparse
import multiprocessing
import os
import platform
import statistics
import struct
import sys
import time
from typing import Any

import torch
from torch.utils.data import Dataset, default_collate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402  (the scenarios' datasets and loaders, the same bytes)

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SCENARIOS = ("small", "medium", "large")
DPEX = ("dpex", "dpex-socket", "dpex-socket-enc")
RAW_OF = {"dpex-socket": "zmq-raw", "dpex-socket-enc": "zmq-raw-curve"}  # (the ring has no wire)


class Paced(Dataset):
    """A scenario's items; the first item of each batch sleeps ``interval`` s, so each
    worker makes one batch per interval (plus the making)."""

    def __init__(self, inner: Dataset, batch_size: int, interval: float) -> None:
        self.inner, self.batch_size, self.interval = inner, batch_size, interval

    def __len__(self) -> int:
        return len(self.inner)

    def __getitem__(self, i: int) -> Any:
        if i % self.batch_size == 0:
            time.sleep(self.interval)
        return self.inner[i]


def percentiles(ms: list[float]) -> dict:
    ordered = sorted(ms)
    n = len(ordered)
    return {"n": n, "p50_ms": ordered[max(0, -(-n // 2) - 1)],
            "p99_ms": ordered[max(0, -(-99 * n // 100) - 1)], "max_ms": ordered[-1]}


def dpex_run(name: str, scenario: str, args: Any, batches: int) -> dict:
    make, batch_size, _ = bench.SCENARIOS[scenario]
    dataset = Paced(make(batch_size * batches), batch_size, args.interval_ms / 1e3)
    loader = bench.make_loader(name, dataset, batch_size=batch_size, num_workers=args.workers,
                               prefetch_factor=args.prefetch_factor, persistent_workers=True)
    with loader:
        for _ in range(2):  # the first epoch warms up: the workers' start, caches, pages
            for _ in loader:
                pass
        return loader.stats()["batch_latency"]  # the second epoch's own


def _raw_sender(address: str, server_public: bytes | None, frames: list[bytes], count: int,
                interval: float, ready: Any, go: Any) -> None:
    import zmq

    ctx = zmq.Context()
    sock = bench.raw_push(ctx, 1000, server_public)  # (paced: never at the limit)
    sock.connect(address)
    ready.set()
    if not go.wait(120):
        return
    for _ in range(count):
        time.sleep(interval)
        sock.send_multipart([struct.pack("<q", time.time_ns()), *frames], copy=False)
    sock.close()
    ctx.term()


def raw_run(curve: bool, scenario: str, args: Any, batches: int) -> dict:
    """One sender process per worker, each pushing the bytes of one batch message once
    per interval, stamped right before the send; latency read right after the recv."""
    import zmq

    from dpex._codec import encode_batch

    make, batch_size, _ = bench.SCENARIOS[scenario]
    dataset = make(batch_size)
    parts = encode_batch(default_collate([dataset[i] for i in range(batch_size)]))
    frames = [bytes(memoryview(p).cast("B")) for p in parts]
    warm = 2 * args.workers
    per_sender = -(-(batches + warm) // args.workers)
    ctx = zmq.Context()
    pull, server_public = bench.raw_pull(ctx, 1000, curve)
    address = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    spawn = multiprocessing.get_context("spawn")
    go = spawn.Event()
    ready = [spawn.Event() for _ in range(args.workers)]
    senders = [spawn.Process(target=_raw_sender, daemon=True,
                             args=(address, server_public, frames, per_sender,
                                   args.interval_ms / 1e3, r, go)) for r in ready]
    for p in senders:
        p.start()
    try:
        for r in ready:
            if not r.wait(120):
                raise TimeoutError("a raw sender did not start")
        go.set()
        latencies = []
        for k in range(per_sender * args.workers):
            if not pull.poll(60_000):
                raise TimeoutError("a raw sender stopped sending")
            msg = pull.recv_multipart(copy=False)
            took = time.time_ns() - struct.unpack("<q", msg[0].buffer)[0]
            if k >= warm:
                latencies.append(took / 1e6)
    finally:
        for p in senders:
            p.join(30)
            if p.is_alive():
                p.kill()
        pull.close()
        ctx.term()
    return percentiles(latencies)


def table(results: dict) -> str:
    rows = ["| scenario | path | p50 ms | p99 ms | max ms | dpex-added p50 ms (vs raw, same mode) |",
            "|---|---|---:|---:|---:|---:|"]
    for scenario, by_path in results.items():
        for name, r in by_path.items():
            raw = by_path.get(RAW_OF.get(name, ""))
            added = f"{r['p50_ms'] - raw['p50_ms']:.2f}" if raw else ""
            rows.append(f"| {scenario} | {name} | {r['p50_ms']:.2f} | {r['p99_ms']:.2f} | "
                        f"{r['max_ms']:.2f} | {added} |")
    return "\n".join(rows)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt
    import numpy as np

    scenarios = list(results)
    paths = list(results[scenarios[0]])
    fig, ax = plt.subplots(figsize=(8, 4))
    width = 0.8 / len(paths)
    for k, name in enumerate(paths):
        p50 = [results[s][name]["p50_ms"] for s in scenarios]
        p99 = [results[s][name]["p99_ms"] - results[s][name]["p50_ms"] for s in scenarios]
        x = np.arange(len(scenarios)) + (k - (len(paths) - 1) / 2) * width
        ax.bar(x, p50, width, yerr=[[0] * len(p99), p99], capsize=3, label=name)
    ax.set_xticks(np.arange(len(scenarios)), scenarios)
    ax.set_yscale("log")
    ax.set_ylabel("ms, batch ready → loop holds it (p50, bar to p99)")
    ax.set_title("Batch latency: dpex paths beside raw ZeroMQ")
    ax.legend(fontsize=8)
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=SCENARIOS)
    p.add_argument("--batches", type=int, default=300)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prefetch-factor", type=int, default=2)
    p.add_argument("--interval-ms", type=float, default=40.0,
                   help="each worker makes one batch per interval")
    p.add_argument("--quick", action="store_true", help="30 batches a path (a smoke test)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    args = p.parse_args()
    if args.quick:
        args.batches = 30
    import cloudpickle
    import ray

    from dpex._ray_connect import connect_ray

    cloudpickle.register_pickle_by_value(bench)  # workers import neither script
    cloudpickle.register_pickle_by_value(sys.modules[__name__])
    connect_ray("auto")
    results: dict = {}
    try:
        for scenario in args.scenarios:
            results[scenario] = {}
            for name in (*DPEX, "zmq-raw", "zmq-raw-curve"):
                t0 = time.perf_counter()
                r = (raw_run(name == "zmq-raw-curve", scenario, args, args.batches)
                     if name.startswith("zmq-raw") else dpex_run(name, scenario, args, args.batches))
                results[scenario][name] = r
                print(f"{scenario:6s} {name:15s} p50 {r['p50_ms']:7.2f} ms  p99 "
                      f"{r['p99_ms']:7.2f} ms  max {r['max_ms']:7.2f} ms  ({r['n']} batches, "
                      f"{time.perf_counter() - t0:.0f} s)", flush=True)
    finally:
        ray.shutdown()
    md = table(results)
    print("\n" + md)
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "workers": args.workers, "prefetch_factor": args.prefetch_factor,
            "interval_ms": args.interval_ms, "batches": args.batches,
            "median_of_p50s_ms": {s: statistics.median(r["p50_ms"] for r in by.values())
                                  for s, by in results.items()}}
    bench.write_outputs(args.out, "latency", {"meta": meta, "results": results}, md,
                        lambda path: plot(results, path))


if __name__ == "__main__":
    main()
