"""What a warm worker costs in memory: PSS of each worker actor and of its forkserver.

Runs two iterators of one loader (``persistent_workers=False``: the second starts
on the first one's warm workers, each session in a process forked from the
worker's forkserver) and a ``persistent_workers=True`` loader for comparison, and
reads PSS (``/proc/<pid>/smaps_rollup``: shared pages split between the processes
that map them) of each worker actor and of the forkserver it started, at three
moments: during the first iterator (after its first epoch's batches), idle in the
warm pool after it, and during the second iterator. It also times the first batch
of each iterator. Ray must run on this node (the embedded default is used).

    python scripts/worker_memory.py
"""

from __future__ import annotations

import argparse
import os
import time

import torch

from dpex import DpexDataLoader, release_warm_workers


def pss_mib(pid: int) -> float:
    try:
        with open(f"/proc/{pid}/smaps_rollup") as f:
            for line in f:
                if line.startswith("Pss:"):
                    return int(line.split()[1]) / 1024
    except OSError:
        pass
    return 0.0


def children(pid: int) -> list[int]:
    found = []
    for name in os.listdir("/proc"):
        if not name.isdigit():
            continue
        try:
            with open(f"/proc/{name}/stat") as f:
                if int(f.read().rsplit(")", 1)[1].split()[1]) == pid:
                    found.append(int(name))
        except (OSError, IndexError, ValueError):
            pass
    return found


def forkservers(pid: int) -> list[int]:
    out = []
    for child in children(pid):
        try:
            with open(f"/proc/{child}/cmdline", "rb") as f:
                if b"forkserver" in f.read():
                    out.append(child)
        except OSError:
            pass
    return out


def snapshot(label: str, pids: list[int]) -> dict:
    actor = sum(pss_mib(p) for p in pids)
    servers = [s for p in pids for s in forkservers(p)]
    fork = sum(pss_mib(s) for s in servers)
    sessions = [c for s in servers for c in children(s)]  # forked from a forkserver
    forked = sum(pss_mib(c) for c in sessions)
    total = (actor + fork + forked) / len(pids)
    print(f"{label:<30} actors {actor:6.1f}  forkservers ({len(servers)}) {fork:6.1f}  "
          f"sessions ({len(sessions)}) {forked:6.1f}  per worker {total:6.1f} MiB PSS",
          flush=True)
    return {"actors": actor, "forkservers": fork, "sessions": forked}


def first_batch_s(loader: DpexDataLoader) -> tuple[float, object]:
    started = time.perf_counter()
    it = iter(loader)
    next(it)
    return time.perf_counter() - started, it


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--settle", type=float, default=5.0,
                        help="seconds to wait before each reading (background starts)")
    args = parser.parse_args()
    data = torch.arange(4096, dtype=torch.float32).reshape(-1, 4)
    release_warm_workers()

    loader = DpexDataLoader(data, batch_size=32, num_workers=args.workers,
                            distribute_mode=True)
    took, it = first_batch_s(loader)
    print(f"first iterator: first batch after {took:.2f} s", flush=True)
    time.sleep(args.settle)
    pids = sorted(w["pid"] for w in loader.stats()["workers"].values())
    snapshot("during the first iterator", pids)
    for _ in it:
        pass
    it._shutdown_workers()  # (its workers go to the warm pool)
    time.sleep(args.settle)
    snapshot("idle in the warm pool", pids)
    took, it = first_batch_s(loader)
    print(f"second iterator: first batch after {took:.2f} s (warm)", flush=True)
    time.sleep(args.settle)
    snapshot("during the second iterator", pids)
    for _ in it:
        pass
    del it
    release_warm_workers()

    persistent = DpexDataLoader(data, batch_size=32, num_workers=args.workers,
                                distribute_mode=True, persistent_workers=True)
    for _ in persistent:
        pass
    time.sleep(args.settle)
    pids = sorted(w["pid"] for w in persistent.stats()["workers"].values())
    snapshot("persistent_workers=True, idle", pids)
    del persistent
    release_warm_workers()


if __name__ == "__main__":
    main()
