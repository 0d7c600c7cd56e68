"""What resuming costs: the size of ``state_dict()`` and the time ``load_state_dict()``
plus the first batch take, for a 1 M-sample dataset checkpointed at several points of
an epoch.

    python scripts/bench_resume.py [--samples 1000000] [--batch-size 64] [--workers 2]

For each cut point it iterates a dpex loader (``distribute_mode=True``) to the cut,
takes ``state_dict()`` (timed; it asks the workers for their RNG states), saves it
with ``torch.save`` (size), then in a new loader times ``load_state_dict()`` and the
first batch (Ray running, workers warm). The same with ``distribute_mode=False``
(torch's loader, same resume code) is shown beside it. Prints a table and writes
``docs/bench/resume.json``.
"""

from __future__ import annotations

import argparse
import io
import json
import os
import sys
import time

import torch
from torch.utils.data import Dataset

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))

from dpex import DpexDataLoader  # noqa: E402

HERE = os.path.dirname(os.path.abspath(__file__))


class Samples(Dataset):
    """Cheap samples: the cost measured is dpex's, not the dataset's."""

    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, torch.randint(0, 100, ()).item()])


def measure(samples: int, batch_size: int, workers: int, distribute: bool, cut: int) -> dict:
    def make() -> DpexDataLoader:
        return DpexDataLoader(Samples(samples), batch_size=batch_size, shuffle=True,
                              num_workers=workers, generator=torch.Generator().manual_seed(0),
                              distribute_mode=distribute)

    loader = make()
    it = iter(loader)
    for _ in range(cut):
        next(it)
    t0 = time.perf_counter()
    state = loader.state_dict()
    state_s = time.perf_counter() - t0
    buf = io.BytesIO()
    torch.save(state, buf)
    del it
    loader.close()
    buf.seek(0)
    resumed = make()
    t0 = time.perf_counter()
    resumed.load_state_dict(torch.load(buf, weights_only=True))
    load_s = time.perf_counter() - t0
    first = next(iter(resumed))
    first_s = time.perf_counter() - t0
    resumed.close()
    return {"distribute_mode": distribute, "cut_batches": cut, "state_bytes": buf.getbuffer().nbytes,
            "state_dict_ms": state_s * 1e3, "load_state_dict_ms": load_s * 1e3,
            "load_and_first_batch_ms": first_s * 1e3, "first_index": int(first[0, 0])}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--samples", type=int, default=1_000_000)
    parser.add_argument("--batch-size", type=int, default=64)
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--out", default=os.path.join(HERE, "..", "docs", "bench", "resume.json"))
    args = parser.parse_args()
    per_epoch = -(-args.samples // args.batch_size)
    cuts = [1, per_epoch // 2, per_epoch - 1]
    print("starting Ray and the warm workers (the cold start is any first iterator's, "
          "measured in BENCHMARKS.md) ...", flush=True)
    measure(1000, args.batch_size, args.workers, True, 1)
    rows = []
    for distribute in (True, False):
        for cut in cuts:
            print(f"distribute_mode={distribute}: iterating to batch {cut} of {per_epoch} ...",
                  flush=True)
            rows.append(measure(args.samples, args.batch_size, args.workers, distribute, cut))
    print(f"\n{args.samples:,} samples, batch {args.batch_size}, {args.workers} workers, "
          f"{per_epoch:,} batches per epoch\n")
    print("| loader | cut at batch | state size | state_dict() | load_state_dict() | "
          "load + first batch |")
    print("|---|---:|---:|---:|---:|---:|")
    for r in rows:
        name = "dpex (distribute_mode=True)" if r["distribute_mode"] else "torch's (distribute_mode=False)"
        print(f"| {name} | {r['cut_batches']:,} | {r['state_bytes'] / 1024:.1f} KiB | "
              f"{r['state_dict_ms']:.1f} ms | {r['load_state_dict_ms']:.1f} ms | "
              f"{r['load_and_first_batch_ms']:.0f} ms |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"samples": args.samples, "batch_size": args.batch_size,
                   "workers": args.workers, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
