"""What resuming on another number of ranks costs, and what per-sample seeding costs.

    python scripts/bench_reshard.py [--samples 10000000] [--batch-size 64] [--workers 2]

1. A ``--samples`` epoch dealt by torch's ``DistributedSampler`` (shuffled) to 4
   ranks, checkpointed halfway by rank 0 and resumed on 3 ranks (rank 0 of 3): the
   state's size (``torch.save``), ``load_state_dict()``, and the time to the first
   batch with ``num_workers=0`` (the trainer's own cost: no data is read to reach
   the position) and with dpex workers (warm). Beside it, the same resumed on 4
   ranks (the same dealing: the sampler's draws are replayed) and the first batch
   of a fresh epoch with torch's DataLoader (torch's DistributedSampler orders the
   whole epoch before its first batch, too).
2. ``worker_seeding="per_sample"``: the worker CPU each sample's seeding takes
   (torch, ``random`` and NumPy seeded from a BLAKE2b digest), measured in this
   process, beside the time to fetch a small sample, and an epoch of dpex workers
   with ``"per_sample"`` against one with torch's seeding.

Prints two tables and writes ``docs/bench/reshard.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

import torch
from torch.utils.data import DataLoader, DistributedSampler

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import bench_resume  # noqa: E402
import cloudpickle  # noqa: E402
from bench_resume import Samples  # noqa: E402  (the same cheap samples)

from dpex import DpexDataLoader  # noqa: E402
from dpex.client._warm import POOL  # noqa: E402
from dpex.server._rng import sample_seed, seed_sample  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))
cloudpickle.register_pickle_by_value(bench_resume)  # (dpex's workers cannot import scripts/)


def make(cls: type, samples: int, batch_size: int, ranks: int, workers: int, **kw) -> DataLoader:
    dataset = Samples(samples)
    sampler = DistributedSampler(dataset, num_replicas=ranks, rank=0, shuffle=True, seed=1)
    return cls(dataset, batch_size=batch_size, sampler=sampler, num_workers=workers, **kw)


def resume(state: dict, samples: int, batch_size: int, ranks: int, workers: int) -> dict:
    loader = make(DpexDataLoader, samples, batch_size, ranks, workers, distribute_mode=True)
    t0 = time.perf_counter()
    loader.load_state_dict(state)
    load_s = time.perf_counter() - t0
    it = iter(loader)
    next(it)
    first_s = time.perf_counter() - t0
    loader.close()
    return {"load_ms": load_s * 1e3, "first_batch_ms": first_s * 1e3}


def resharding(samples: int, batch_size: int, workers: int) -> list[dict]:
    saver = make(DpexDataLoader, samples, batch_size, 4, 0, distribute_mode=True)
    it = iter(saver)
    next(it)  # (the epoch's order is made here, as torch's sampler makes it)
    half = len(saver) // 2
    for _ in range(half - 1):
        next(it)
    state = saver.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    size = buf.tell()
    state = torch.load(io.BytesIO(buf.getvalue()), weights_only=True)
    saver.close()
    rows = []
    for ranks, what in ((3, "4 ranks -> 3"), (4, "4 ranks -> 4 (same dealing)")):
        for n in (0, workers):
            # (two runs warm Ray, the workers and their forkservers; the third is
            # measured, once the workers are back in the warm pool)
            for _ in range(2):
                resume(state, samples, batch_size, ranks, n)
                POOL.wait_settled(10)
            rows.append({"resume": what, "num_workers": n, "state_kib": size / 1024,
                         **resume(state, samples, batch_size, ranks, n)})
            print(rows[-1], flush=True)
    t0 = time.perf_counter()
    next(iter(make(DataLoader, samples, batch_size, 4, 0)))
    rows.append({"resume": "none: torch's DataLoader, a fresh epoch", "num_workers": 0,
                 "state_kib": 0.0, "load_ms": 0.0,
                 "first_batch_ms": (time.perf_counter() - t0) * 1e3})
    return rows


def epoch_s(seeding_mode: str, samples: int, batch_size: int, workers: int) -> float:
    """One epoch of a dpex loader over cheap samples (after one to warm it)."""
    loader = DpexDataLoader(Samples(samples), batch_size=batch_size, shuffle=True,
                            num_workers=workers, persistent_workers=True,
                            distribute_mode=True, worker_seeding=seeding_mode)
    for _ in loader:
        pass
    t0 = time.perf_counter()
    for _ in loader:
        pass
    took = time.perf_counter() - t0
    loader.close()
    return took


def seeding(rounds: int = 20000, batch_size: int = 64, workers: int = 2) -> dict:
    dataset = Samples(rounds)
    t0 = time.perf_counter()
    for i in range(rounds):
        seed_sample(sample_seed(1, 0, i))
    seed_us = (time.perf_counter() - t0) / rounds * 1e6
    t0 = time.perf_counter()
    for i in range(rounds):
        dataset[i]
    fetch_us = (time.perf_counter() - t0) / rounds * 1e6
    plain = epoch_s("torch", rounds, batch_size, workers)
    per_sample = epoch_s("per_sample", rounds, batch_size, workers)
    return {"seed_us_per_sample": seed_us, "small_sample_fetch_us": fetch_us,
            "epoch_s_torch_seeding": plain, "epoch_s_per_sample": per_sample,
            "epoch_samples": rounds, "workers": workers}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--samples", type=int, default=10_000_000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "..", "docs", "bench",
                                                      "reshard.json"))
    args = parser.parse_args()
    print(f"resuming a {args.samples:,}-sample epoch halfway ...", flush=True)
    rows = resharding(args.samples, args.batch_size, args.workers)
    print("| resumed | num_workers | state size | `load_state_dict()` | load + first batch |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['resume']} | {r['num_workers']} | {r['state_kib']:.1f} KiB | "
              f"{r['load_ms']:.1f} ms | {r['first_batch_ms']:.0f} ms |")
    cost = seeding(workers=args.workers)
    print(f"\nper-sample seeding: {cost['seed_us_per_sample']:.1f} µs per sample "
          f"(a small sample's fetch: {cost['small_sample_fetch_us']:.1f} µs); an epoch of "
          f"{cost['epoch_samples']:,} cheap samples on {cost['workers']} workers: "
          f"{cost['epoch_s_torch_seeding']:.2f} s with torch's seeding, "
          f"{cost['epoch_s_per_sample']:.2f} s per sample")
    with open(args.out, "w") as f:
        json.dump({"samples": args.samples, "batch_size": args.batch_size,
                   "resume": rows, "seeding": cost}, f, indent=1)


if __name__ == "__main__":
    main()
