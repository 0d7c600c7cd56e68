"""Time to first batch: fresh iterators, as most training scripts create them.

A train loader and a validation loader, neither with persistent workers, alternate
over ``--epochs`` short epochs (Lightning's pattern): every epoch starts two fresh
iterators. For torch's DataLoader (its default start method, fork, as a user gets
it) and dpex, in one process with Ray already running
(its start is timed apart, as the cold start with no Ray), the table gives each
loader's first-batch time (median and max over the fresh iterators after the first)
and the whole alternation's wall time; dpex's later iterators start on its warm
workers (docs/WARM_WORKERS.md). Runs alternate torch, dpex, dpex, torch, ...

    python scripts/bench_first_batch.py                  # 10 epochs, 2 repeats
    python scripts/bench_first_batch.py --epochs 4 --repeats 1

Writes a markdown table to stdout, and JSON and a PNG plot to --out (default
docs/bench/).
"""

from __future__ import annotations

import argparse
import inspect
import json
import os
import statistics
import sys
import time

import cloudpickle
import torch
from torch.utils.data import DataLoader

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
from bench import ROOT, Synthetic  # noqa: E402

from dpex import DpexDataLoader  # noqa: E402

cloudpickle.register_pickle_by_value(bench)  # workers cannot import scripts/bench.py


def alternation(kind: str, epochs: int, train_batches: int, val_batches: int,
                workers: int) -> dict:
    item, batch = (3, 64, 64), 32

    def make(n: int) -> DataLoader:
        ds = Synthetic(item, torch.float32, n * batch)
        if kind == "torch":  # as a user gets it: fork, Linux's default (its workers never
            return DataLoader(ds, batch_size=batch, num_workers=workers)  # touch Ray)
        return DpexDataLoader(ds, batch_size=batch, num_workers=workers, distribute_mode=True)

    train, val = make(train_batches), make(val_batches)
    firsts: list[float] = []
    t0 = time.perf_counter()
    for epoch in range(epochs):
        for loader in (train, val):
            t = time.perf_counter()
            it = iter(loader)
            next(it)
            firsts.append(time.perf_counter() - t)
            for _ in it:
                pass
        print(f"  {kind}: epoch {epoch + 1}/{epochs}, {time.perf_counter() - t0:.1f} s",
              file=sys.stderr, flush=True)
    return {"total_s": time.perf_counter() - t0, "first_ms": [f * 1e3 for f in firsts]}


def plot(runs: dict, args: argparse.Namespace, path: str) -> None:
    """Each fresh iterator's first-batch time, every repeat (the first one includes
    dpex's actor start; later ones start on the warm workers of the one before)."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 4))
    for kind, color in (("torch", "tab:blue"), ("dpex", "tab:orange")):
        for r, run in enumerate(runs[kind]):
            ax.plot(range(1, len(run["first_ms"]) + 1), run["first_ms"], marker="o",
                    color=color, linestyle="-" if r == 0 else "--",
                    label=f"{kind}, repeat {r + 1}")
    ax.set_yscale("log")
    ax.set_xlabel("fresh iterator (train, val, train, ...)")
    ax.set_ylabel("iter() to first batch, ms (log)")
    ax.set_title(f"{args.epochs} train/val epochs, {args.workers} workers, "
                 "no persistent workers")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--epochs", type=int, default=10)
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--train-batches", type=int, default=32)
    p.add_argument("--val-batches", type=int, default=8)
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    args = p.parse_args()
    import ray

    from dpex._ray_connect import connect_ray

    t = time.perf_counter()
    connect_ray("auto")
    ray_start = time.perf_counter() - t
    # New actors (no warm workers; a tree from before them has no such argument).
    no_reuse = ({"warm_worker_timeout": 0} if "warm_worker_timeout"
                in inspect.signature(DpexDataLoader.__init__).parameters else {})
    cold = DpexDataLoader(torch.arange(64), batch_size=8, num_workers=args.workers,
                          distribute_mode=True, **no_reuse)
    t = time.perf_counter()
    next(iter(cold))
    cold_ms = (time.perf_counter() - t) * 1e3
    cold.close()
    print(f"Ray start {ray_start:.1f} s; a first dpex iterator on new actors {cold_ms:.0f} ms",
          file=sys.stderr)
    runs: dict[str, list[dict]] = {"torch": [], "dpex": []}
    for r in range(args.repeats):
        for kind in (("torch", "dpex") if r % 2 == 0 else ("dpex", "torch")):
            runs[kind].append(alternation(kind, args.epochs, args.train_batches,
                                          args.val_batches, args.workers))
    rows = ["| loader | first batch, first iterator ms | later fresh iterators: median ms "
            "| max ms | alternation total s (min–max) |", "|---|---:|---:|---:|---:|"]
    for kind, rs in runs.items():
        later = [ms for r in rs for ms in r["first_ms"][1:]]
        totals = [r["total_s"] for r in rs]
        rows.append(f"| {kind} | {statistics.median(r['first_ms'][0] for r in rs):.0f} | "
                    f"{statistics.median(later):.0f} | {max(later):.0f} | "
                    f"{statistics.median(totals):.2f} ({min(totals):.2f}–{max(totals):.2f}) |")
    print(f"Ray start (no Ray running): {ray_start:.1f} s; first batch of a dpex iterator "
          f"on new actors, Ray running: {cold_ms:.0f} ms\n")
    print("\n".join(rows))
    os.makedirs(args.out, exist_ok=True)
    with open(os.path.join(args.out, "first_batch.json"), "w") as f:
        json.dump({"ray_start_s": ray_start, "cold_ms": cold_ms, "runs": runs,
                   "args": vars(args)}, f, indent=1)
    plot(runs, args, os.path.join(args.out, "first_batch.png"))
    ray.shutdown()


if __name__ == "__main__":
    main()
