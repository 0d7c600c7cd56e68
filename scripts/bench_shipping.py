#!/usr/bin/env python
"""What shipping a dataset to a node's host costs, step by step, no Ray: pickling on the
trainer, the change digest, writing the memfd, and the host's fork base taking and
unpickling it; dpex's way (pickle 5, buffers out of band, XXH3, the memfd mapped) beside
the way before (cloudpickle in band, BLAKE2b, the memfd read into bytes) and beside
the physical reference, one memcpy of the same bytes into fresh pages. Datasets as in
``bench_worker_cost.py``: ``--mib`` MiB held as a torch tensor, a NumPy array and a
Python list of short strings. Each step is timed ``--repeats`` times, the median kept.

    python scripts/bench_shipping.py                 # 256 MiB, 3 repeats
    python scripts/bench_shipping.py --mib 64 --kinds tensor

Prints a table (ms) and writes JSON to ``--out`` (default docs/bench/shipping.json).
"""

from __future__ import annotations

import argparse
import hashlib
import json
import os
import statistics
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

import cloudpickle  # noqa: E402
import numpy as np  # noqa: E402
from bench_worker_cost import KINDS, build  # noqa: E402

from dpex._shipfile import ShipmentFile, map_shipment  # noqa: E402
from dpex._spec import ShippedLoader  # noqa: E402
from dpex.client._shipping import ship_loader  # noqa: E402
from dpex.server._task_runner import load_pickled  # noqa: E402
from dpex.server._trainer_state import leave_trainer_state  # noqa: E402

NODE = "b" * 56


def timed(fn, repeats: int) -> tuple[float, object]:
    times, out = [], None
    for _ in range(repeats):
        out = None
        start = time.perf_counter()
        out = fn()
        times.append(time.perf_counter() - start)
    return statistics.median(times) * 1000, out


def loader_of(data) -> ShippedLoader:
    return ShippedLoader(dataset={"data": data}, dataset_kind=0, auto_collation=True,
                         collate_fn=None, drop_last=False, worker_init_fn=None)


def dpex_way(shipped: ShippedLoader, repeats: int) -> dict:
    row = {}
    row["pickle"], parts = timed(lambda: ship_loader(shipped), repeats)
    row["digest"], _ = timed(parts.digest, repeats)
    row["memfd write"], file = timed(lambda: ShipmentFile(parts, NODE), repeats)

    def take_and_load():
        try:
            return load_pickled(map_shipment(file.ref))
        finally:
            leave_trainer_state()

    row["take + unpickle"], _ = timed(take_and_load, repeats)
    file.close()
    row["bytes"] = parts.nbytes
    return row


def before_way(shipped: ShippedLoader, repeats: int) -> dict:
    row = {}
    row["pickle"], data = timed(lambda: cloudpickle.dumps(shipped, protocol=5), repeats)
    row["digest"], _ = timed(lambda: hashlib.blake2b(data, digest_size=16).digest(), repeats)
    row["memfd write"], file = timed(lambda: ShipmentFile(data, NODE), repeats)
    row["take + unpickle"], _ = timed(lambda: cloudpickle.loads(file.read()),  # (pread: a copy)
                                      repeats)
    file.close()
    row["bytes"] = len(data)
    return row


def memcpy(nbytes: int, repeats: int) -> float:
    """One copy of ``nbytes`` into fresh pages (as a new memfd's are): the page faults
    and zeroing included, as they are in the memfd's write."""
    src = np.ones(nbytes, dtype=np.uint8)
    return timed(lambda: np.copyto(np.empty_like(src), src), repeats)[0]


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--kinds", nargs="+", default=list(KINDS), choices=KINDS)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--out", default="docs/bench/shipping.json")
    args = ap.parse_args()
    steps = ("pickle", "digest", "memfd write", "take + unpickle")
    results = []
    for n, kind in enumerate(args.kinds, 1):
        data, _ = build(kind, args.mib)
        shipped = loader_of(data)
        row = {"kind": kind, "before": before_way(shipped, args.repeats),
               "dpex": dpex_way(shipped, args.repeats)}
        row["memcpy"] = memcpy(row["dpex"]["bytes"], args.repeats)
        results.append(row)
        total = {way: sum(row[way][s] for s in steps) for way in ("before", "dpex")}
        print(f"[{n}/{len(args.kinds)}] {kind}: before {total['before']:.0f} ms, "
              f"dpex {total['dpex']:.0f} ms, one memcpy {row['memcpy']:.0f} ms", flush=True)
        del data, shipped
    print(f"\n{args.mib} MiB, median of {args.repeats}, ms (before -> dpex)\n")
    print("| dataset | " + " | ".join(steps) + " | in all | one memcpy into fresh pages |")
    print("|---|" + "---:|" * (len(steps) + 2))
    for row in results:
        cells = [f"{row['before'][s]:.0f} → {row['dpex'][s]:.0f}" for s in steps]
        before = sum(row["before"][s] for s in steps)
        after = sum(row["dpex"][s] for s in steps)
        print(f"| {row['kind']} | " + " | ".join(cells)
              + f" | **{before:.0f} → {after:.0f}** | {row['memcpy']:.0f} |")
    os.makedirs(os.path.dirname(os.path.abspath(args.out)), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"mib": args.mib, "repeats": args.repeats, "results": results}, f, indent=1)
    print(f"\nJSON: {args.out}")


if __name__ == "__main__":
    main()
