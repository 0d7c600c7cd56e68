#!/usr/bin/env python
"""What the worker host's two guarded paths cost (issue 47): a dataset each worker
unpickles itself, and a host that cannot use the trainer's memfd.

A dataset held in the trainer's memory (``--mib`` MiB: a tensor, or a list of short
strings as bench_worker_cost.py builds them), 2 persistent workers, batch 64, in order,
iterated 3 s after the loader was built (the hosts start meanwhile), 20 batches. Cases:

- ``shared``: a plain dataset class: the host's fork base unpickles it once and every
  worker forks with it (what bench_worker_cost.py measures);
- ``per-worker``: the same class with a ``__setstate__`` (it only restores its dict):
  unpickling runs the dataset's own code, so each worker unpickles its own copy over
  the base's pages (docs/WARM_WORKERS.md, "What each worker still gets");
- ``fallback``: the plain class, with every host handed a reference to the memfd that
  it cannot use (a wrong nonce: as a memfd closed and its number reused): each first
  worker fails its start, and is started again from the object store's copy, put then.

Each case runs in a fresh process with its own embedded Ray. Prints a markdown table:
the first batch after ``iter()``, the workers' own pages (USS of their session
processes, what their exit would free) and the fallbacks ``loader.stats()`` counted.

    python scripts/bench_host_paths.py [--mib 256] [--kinds tensor strings]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
CASES = ("shared", "per-worker", "fallback")


class Held:
    """Rows of a tensor, or strings as 40-byte tensors (bench_worker_cost's items)."""

    def __init__(self, kind, data):
        self.kind, self.data = kind, data

    def __len__(self):
        return len(self.data)

    def __getitem__(self, i):
        import torch

        if self.kind == "tensor":
            return self.data[i].clone()
        raw = self.data[i].encode().ljust(40, b"\0")
        return torch.frombuffer(bytearray(raw), dtype=torch.uint8)


class HeldWithSetstate(Held):
    def __setstate__(self, state):
        self.__dict__.update(state)


def one(kind: str, case: str, mib: int) -> dict:
    sys.path.insert(0, os.path.join(ROOT, "scripts"))
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import ray
    import torch
    from bench_worker_cost import build
    from dsets import private_mib

    from dpex import DpexDataLoader, _shipfile

    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    data, _ = build(kind, mib)
    if kind == "tensor":
        data = data.reshape(-1, 64)
    if case == "fallback":  # every host is handed a reference it cannot use
        lend = _shipfile.Delivery.lend

        def refused(self):
            ref = lend(self)
            return None if ref is None else ref.__class__(
                ref.node_id, ref.pid, ref.fd, b"\0" * len(ref.nonce), ref.size)

        _shipfile.Delivery.lend = refused
    dataset = (HeldWithSetstate if case == "per-worker" else Held)(kind, data)
    loader = DpexDataLoader(torch.utils.data.Subset(dataset, range(64 * 40)), batch_size=64,
                            num_workers=2, persistent_workers=True, distribute_mode=True,
                            timeout=300)
    time.sleep(3)
    start = time.perf_counter()
    it = iter(loader)
    next(it)
    first = time.perf_counter() - start
    for _ in range(19):
        next(it)
    stats = loader.stats()
    sessions = [w.get("session_pid") for w in stats["workers"].values()]
    own = sum(private_mib(pid) for pid in sessions if pid)
    loader.close()
    ray.shutdown()
    return {"kind": kind, "case": case, "first_batch_s": round(first, 3),
            "workers_uss_mib": round(own, 1), "fallbacks": stats["dataset_fallbacks"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--kinds", nargs="+", default=["tensor", "strings"],
                   choices=["tensor", "strings"])
    p.add_argument("--child", nargs=2, metavar=("KIND", "CASE"), help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:
        print(json.dumps(one(*args.child, args.mib)))
        return
    rows = []
    for kind in args.kinds:
        for case in CASES:
            print(f"{kind} {case} ...", file=sys.stderr, flush=True)
            out = subprocess.run([sys.executable, __file__, "--mib", str(args.mib), "--child",
                                  kind, case], capture_output=True, text=True, timeout=600)
            if out.returncode != 0:
                raise SystemExit(out.stderr[-3000:])
            rows.append(json.loads(out.stdout.strip().splitlines()[-1]))
    print(f"| {args.mib} MiB, 2 workers | case | first batch s | workers' USS MiB | fallbacks |")
    print("|---|---|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kind']} | {r['case']} | {r['first_batch_s']:.2f} | "
              f"{r['workers_uss_mib']:.0f} | {r['fallbacks']} |")


if __name__ == "__main__":
    main()
