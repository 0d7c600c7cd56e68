"""How fast dpex notices a killed worker and has its replacement serving.

Kills (SIGKILL) one worker mid-epoch, N times, and prints a markdown table:
detection (kill → Ray reports the death), replacement ready (kill → its HELLO),
the longest gap between two batches the training loop saw, and whether the
epoch matched torch's DataLoader exactly.

    python scripts/fault_times.py --trials 5
"""

from __future__ import annotations

import argparse
import os
import signal
import statistics
import time

import ray
import torch
from torch.utils.data import DataLoader, Dataset

from dpex import DpexDataLoader
from dpex._ray_connect import connect_ray


class Items(Dataset):
    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        time.sleep(self.delay)
        return torch.tensor([i, i * i])


def trial(args) -> dict:
    kw = {"batch_size": 4, "shuffle": True, "num_workers": args.workers}
    dataset = Items(args.items, args.delay)
    torch.manual_seed(1)
    expected = list(DataLoader(dataset, multiprocessing_context="forkserver", **kw))
    torch.manual_seed(1)
    it = iter(DpexDataLoader(dataset, distribute_mode=True, timeout=60, **kw))
    got, gaps, t_kill, last = [], [], None, time.monotonic()
    for batch in it:
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        got.append(batch)
        if len(got) == args.kill_after:
            while len(it._ready) < it._num_workers:
                it._receive_one()
            t_kill = time.monotonic()
            os.kill(it._ready[1]["pid"], signal.SIGKILL)
    rec = it.stats()["recoveries"][0]
    exact = len(got) == len(expected) and all(torch.equal(a, b)
                                              for a, b in zip(got, expected, strict=True))
    return {"detect": rec["reported_at"] - t_kill, "ready": rec["ready_at"] - t_kill,
            "gap": max(gaps[args.kill_after:]), "exact": exact}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--items", type=int, default=400)
    p.add_argument("--delay", type=float, default=0.005)
    p.add_argument("--kill-after", type=int, default=10)
    args = p.parse_args()
    connect_ray("auto")  # as a user's first loader does
    rows = []
    try:
        for i in range(args.trials):
            rows.append(trial(args))
            r = rows[-1]
            print(f"trial {i + 1}/{args.trials}: detected {r['detect'] * 1000:.0f} ms, "
                  f"replacement ready {r['ready'] * 1000:.0f} ms, longest stall "
                  f"{r['gap'] * 1000:.0f} ms, exact={r['exact']}", flush=True)
    finally:
        ray.shutdown()
    print("\n| figure | median | min | max |\n|---|---:|---:|---:|")
    for key, name in (("detect", "kill → death reported"), ("ready", "kill → replacement ready"),
                      ("gap", "longest wait for a batch after the kill")):
        vals = [r[key] * 1000 for r in rows]
        print(f"| {name} (ms) | {statistics.median(vals):.0f} | {min(vals):.0f} | "
              f"{max(vals):.0f} |")
    print(f"\nepochs exactly torch's: {sum(r['exact'] for r in rows)}/{len(rows)}")


if __name__ == "__main__":
    main()
