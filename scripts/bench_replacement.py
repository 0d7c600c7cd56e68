#!/usr/bin/env python
"""How long a killed worker's replacement takes with a large in-memory dataset, and
whether it put a copy of the dataset in Ray's object store (where its pages stay
written for the Ray instance's life).

A 256 MiB tensor dataset (``--mib``), 2 workers, batch 64; after 10 batches one
SIGKILL, of a worker's own process (``session``: its replacement is forked on the same
host) or of the host (``host``: every worker on it moves to a new host); the epoch
runs to its end. Prints, per case, the replacement's time from the death's report to
its HELLO, the batches (all of the epoch's), and whether a copy was stored. Each case
runs in a fresh process with its own embedded Ray.

    python scripts/bench_replacement.py [--mib 256]
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def one(kill: str, mib: int) -> None:
    sys.path.insert(0, os.path.join(ROOT, "tests"))
    import signal

    import cloudpickle
    import dsets
    import ray

    from dpex import DpexDataLoader
    from dpex.client._shipment import SHIPPED

    cloudpickle.register_pickle_by_value(dsets)
    ray.init(num_cpus=os.cpu_count(), include_dashboard=False, logging_level="ERROR")
    dataset = dsets.Rows(mib)
    loader = DpexDataLoader(dataset, batch_size=64, num_workers=2, distribute_mode=True,
                            timeout=120)
    time.sleep(3)  # (the trainer's own set-up: the hosts start meanwhile)
    it = iter(loader)
    for _ in range(10):
        next(it)
    deadline = time.monotonic() + 60
    while len(it._ready) < 2 and time.monotonic() < deadline:
        it._driver.receive_one()
    info = dict(it._ready)
    os.kill(info[1]["session_pid"] if kill == "session" else info[0]["pid"], signal.SIGKILL)
    batches = 10 + sum(1 for _ in it)
    ready = [r["ready_at"] - r["reported_at"] for r in it.stats()["recoveries"]]
    print(f"RESULT {kill} {max(ready):.3f} {batches} {SHIPPED.last(loader)[1] is not None}")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--mib", type=int, default=256)
    ap.add_argument("--one", choices=["session", "host"], help=argparse.SUPPRESS)
    args = ap.parse_args()
    if args.one:
        one(args.one, args.mib)
        return
    rows = []
    for n, kill in enumerate(("session", "host"), 1):
        env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
        proc = subprocess.run([sys.executable, __file__, "--one", kill, "--mib", str(args.mib)],
                              capture_output=True, text=True, timeout=600, env=env, cwd=ROOT)
        line = [x for x in proc.stdout.splitlines() if x.startswith("RESULT")]
        if proc.returncode != 0 or not line:
            sys.exit(f"{kill}: failed\n{proc.stdout[-2000:]}{proc.stderr[-3000:]}")
        _, _, ready, batches, stored = line[0].split()
        rows.append((kill, float(ready), int(batches), stored == "True"))
        print(f"[{n}/2] {kill}: replacement ready {float(ready):.3f} s", file=sys.stderr)
    print(f"\n{args.mib} MiB tensor dataset, 2 workers, one SIGKILL after 10 batches\n")
    print("| killed | replacement ready (death reported -> HELLO) s | batches | "
          "a copy put in Ray's object store |")
    print("|---|---:|---:|---|")
    for kill, ready, batches, stored in rows:
        print(f"| {kill} | {ready:.2f} | {batches} | {'yes' if stored else 'no'} |")


if __name__ == "__main__":
    main()
