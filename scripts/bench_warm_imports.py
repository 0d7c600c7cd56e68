"""What a warm worker's later iterators cost when the dataset's code imports heavy libraries.

A dataset whose ``worker_init_fn`` is Lightning's (what ``seed_everything(...,
workers=True)`` gives every loader) imports Lightning, and with it torchmetrics,
transformers' import machinery and matplotlib, in every worker process. A warm
worker's later sessions run in processes forked from its forkserver; by default that
forkserver imports the installed libraries the worker's first session imported, so a
session finds them imported (docs/WARM_WORKERS.md). This script times the first batch
of several fresh iterators of one loader in two child processes, one with the default
and one with ``DPEX_FORKSERVER_PRELOAD=0``, one after the other, and prints a table.

    python scripts/bench_warm_imports.py [--iterators 4] [--gap 20]

``--gap``: seconds between iterators (the forkserver starts once a worker is kept idle
and imports those libraries then: an iterator that comes sooner waits for the rest).
Needs pytorch-lightning (the test extras); Ray runs on this node (the embedded default).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time

CHILD = "--child"


def child(iterators: int, gap: float) -> None:
    import torch
    from lightning_fabric.utilities.seed import pl_worker_init_function

    from dpex import DpexDataLoader, release_warm_workers

    loader = DpexDataLoader(torch.arange(64.0), batch_size=8, num_workers=2,
                            worker_init_fn=pl_worker_init_function, distribute_mode=True)
    times = []
    for i in range(iterators):
        t0 = time.monotonic()
        it = iter(loader)
        next(it)
        times.append(time.monotonic() - t0)
        print(f"  iterator {i}: first batch after {times[-1]:.2f} s", file=sys.stderr,
              flush=True)
        for _ in it:
            pass
        del it
        if i + 1 < iterators:
            time.sleep(gap)
    release_warm_workers()
    print(json.dumps(times))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--iterators", type=int, default=4)
    parser.add_argument("--gap", type=float, default=20.0)
    parser.add_argument(CHILD, action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        child(args.iterators, args.gap)
        return
    results = {}
    for label, setting in (("preloaded (default)", None), ("DPEX_FORKSERVER_PRELOAD=0", "0")):
        env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
        env.pop("DPEX_FORKSERVER_PRELOAD", None)
        if setting is not None:
            env["DPEX_FORKSERVER_PRELOAD"] = setting
        print(f"{label}:", file=sys.stderr, flush=True)
        out = subprocess.run([sys.executable, __file__, CHILD, "--iterators",
                              str(args.iterators), "--gap", str(args.gap)], env=env,
                             stdout=subprocess.PIPE, check=True, text=True, timeout=1800)
        results[label] = json.loads(out.stdout.strip().splitlines()[-1])
    print("\n| iterator | " + " | ".join(results) + " |")
    print("|---|" + "---:|" * len(results))
    for i in range(args.iterators):
        what = "1 (fresh actors)" if i == 0 else f"{i + 1} (warm workers)"
        print(f"| {what} | " + " | ".join(f"{r[i]:.2f} s" for r in results.values()) + " |")


if __name__ == "__main__":
    main()
