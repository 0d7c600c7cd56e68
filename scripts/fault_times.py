"""How long the training loop waits when a worker dies or a batch is lost.

``--mode kill`` (default) kills (SIGKILL) one worker mid-epoch, N times, and prints
a markdown table: detection (kill → Ray reports the death), replacement ready
(kill → its HELLO; "-" when the survivors finished the epoch first), the longest
gap between two batches the training loop saw, and whether the epoch matched
torch's DataLoader exactly. ``--mode lose`` instead makes worker 1 lose one data
message on the way (its socket drops it) in the middle of its tasks ("gap") and
its last one ("silence"), and prints the longest gap and exactness of each.
``--mode step`` runs one epoch per dataset style (map-style, IterableDataset) whose
training loop takes a ``--step``-second step every ``--every`` batches (a validation
loop, a checkpoint save) with default limits, and prints the workers replaced, the
batches presumed lost and redone, and whether the epoch matched torch's.

    python scripts/fault_times.py --trials 5
    python scripts/fault_times.py --mode lose --trials 3
    python scripts/fault_times.py --mode step --step 30 --every 10 --items 120
"""

from __future__ import annotations

import argparse
import functools
import os
import signal
import statistics
import time

import ray
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, get_worker_info

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


class Stream(IterableDataset):
    """Items' values as a stream, sharded by worker as torch's docs advise."""

    def __init__(self, n: int, delay: float) -> None:
        self.n, self.delay = n, delay

    def __iter__(self):
        info = get_worker_info()
        first, step = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(first, self.n, step):
            time.sleep(self.delay)
            yield torch.tensor([i, i * i])


def lose(worker_id: int, seq: int) -> None:
    """worker_init_fn: worker 1's socket drops the data message of batch ``seq``."""
    if worker_id != 1:
        return
    import struct

    import zmq

    send = zmq.Socket.send_multipart

    def send_multipart(self, frames, *args, **kwargs):
        head = memoryview(frames[0]).tobytes()
        if len(head) == 36 and head[1] in (1, 4) and struct.unpack_from("<q", head, 22)[0] == seq:
            return None
        return send(self, frames, *args, **kwargs)

    zmq.Socket.send_multipart = send_multipart


def exact(got, expected) -> bool:
    return len(got) == len(expected) and all(torch.equal(a, b)
                                             for a, b in zip(got, expected, strict=True))


def lose_trial(args, where: str) -> dict:
    kw = {"batch_size": 4, "shuffle": True, "num_workers": 2}
    dataset = Items(args.items, args.delay)
    n = len(dataset) // 4
    seq = args.kill_after + 1 if where == "gap" else n - 1  # worker 1 has the odd batches
    torch.manual_seed(1)
    expected = list(DataLoader(dataset, multiprocessing_context="forkserver", **kw))
    torch.manual_seed(1)
    it = iter(DpexDataLoader(dataset, distribute_mode=True, timeout=120,
                             worker_init_fn=functools.partial(lose, seq=seq), **kw))
    got, gaps, last = [next(it)], [], time.monotonic()
    for batch in it:
        now = time.monotonic()
        gaps.append(now - last)
        last = now
        got.append(batch)
    return {"gap": max(gaps), "exact": exact(got, expected),
            "lost": it.stats()["dropped"].get("lost", 0)}


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
                it._driver.receive_one()
            t_kill = time.monotonic()
            info = it._ready[1]  # the process computing its batches (a warm worker's session)
            os.kill(info.get("session_pid", info["pid"]), signal.SIGKILL)
    rec = it.stats()["recoveries"][0]
    ready = rec["ready_at"] - t_kill if "ready_at" in rec else None
    return {"detect": rec["reported_at"] - t_kill, "ready": ready,
            "gap": max(gaps[args.kill_after:]), "exact": exact(got, expected)}


def step_trial(args, style: str) -> dict:
    """One epoch whose loop sleeps ``args.step`` s every ``args.every`` batches."""
    dataset = (Items if style == "map-style" else Stream)(args.items, args.delay)
    kw = {"batch_size": 4, "num_workers": args.workers}
    expected = list(DataLoader(dataset, multiprocessing_context="forkserver", **kw))
    it = iter(DpexDataLoader(dataset, distribute_mode=True, **kw))
    got, started = [], time.monotonic()
    for batch in it:
        got.append(batch)
        if len(got) % args.every == 0:
            print(f"  {style}: batch {len(got)}/{len(expected)}, a {args.step:g} s step",
                  flush=True)
            time.sleep(args.step)
    stats = it.stats()
    dropped = stats["dropped"]
    return {"style": style, "took": time.monotonic() - started,
            "replaced": len(stats["recoveries"]), "lost": dropped.get("lost", 0),
            "redone": dropped.get("handed_over", 0) + dropped.get("redispatched", 0),
            "exact": exact(got, expected)}


def main_step(args) -> None:
    rows = [step_trial(args, style) for style in ("map-style", "IterableDataset")]
    print(f"\n{args.step:g} s step every {args.every} batches, default limits:\n")
    print("| dataset | epoch (s) | workers replaced | presumed lost | redone | exact |")
    print("|---|---:|---:|---:|---:|---|")
    for r in rows:
        print(f"| {r['style']} | {r['took']:.0f} | {r['replaced']} | {r['lost']} | "
              f"{r['redone']} | {r['exact']} |")


def ms(values: list) -> str:
    vals = [v * 1000 for v in values if v is not None]
    if not vals:
        return "- | - | -"
    return f"{statistics.median(vals):.0f} | {min(vals):.0f} | {max(vals):.0f}"


def main_lose(args) -> None:
    rows: dict[str, list[dict]] = {"gap": [], "silence": []}
    for i in range(args.trials):
        for where, results in rows.items():
            results.append(lose_trial(args, where))
            r = results[-1]
            print(f"trial {i + 1}/{args.trials} ({where}): longest stall "
                  f"{r['gap'] * 1000:.0f} ms, lost {r['lost']}, exact={r['exact']}", flush=True)
    print("\n| batch lost | longest wait for a batch (ms): median | min | max | epochs exact |")
    print("|---|---:|---:|---:|---:|")
    for where, label in (("gap", "mid-epoch (a later result overtakes it)"),
                         ("silence", "a worker's last (found by silence)")):
        results = rows[where]
        print(f"| {label} | {ms([r['gap'] for r in results])} | "
              f"{sum(r['exact'] for r in results)}/{len(results)} |")


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--trials", type=int, default=5)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--items", type=int, default=400)
    p.add_argument("--delay", type=float, default=0.005)
    p.add_argument("--kill-after", type=int, default=10)
    p.add_argument("--mode", choices=["kill", "lose", "step"], default="kill")
    p.add_argument("--step", type=float, default=30.0, help="--mode step: seconds")
    p.add_argument("--every", type=int, default=10, help="--mode step: batches")
    args = p.parse_args()
    connect_ray("auto")  # as a user's first loader does
    if args.mode in ("lose", "step"):
        try:
            (main_lose if args.mode == "lose" else main_step)(args)
        finally:
            ray.shutdown()
        return
    rows = []
    try:
        for i in range(args.trials):
            rows.append(trial(args))
            r = rows[-1]
            ready = "-" if r["ready"] is None else f"{r['ready'] * 1000:.0f} ms"
            print(f"trial {i + 1}/{args.trials}: detected {r['detect'] * 1000:.0f} ms, "
                  f"replacement ready {ready}, longest stall "
                  f"{r['gap'] * 1000:.0f} ms, exact={r['exact']}", flush=True)
    finally:
        ray.shutdown()
    print("\n| figure | median | min | max |\n|---|---:|---:|---:|")
    for key, name in (("detect", "kill → death reported"), ("ready", "kill → replacement ready"),
                      ("gap", "longest wait for a batch after the kill")):
        print(f"| {name} (ms) | {ms([r[key] for r in rows])} |")
    print(f"\nepochs exactly torch's: {sum(r['exact'] for r in rows)}/{len(rows)}")


if __name__ == "__main__":
    main()
