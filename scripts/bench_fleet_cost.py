#!/usr/bin/env python
"""What a fleet worker costs the node: one loader over a dataset held in memory, served
by a standalone fleet on this node (issue 47).

A `ray start --head` cluster of this machine's cores (loopback), then for each worker
count: `dpex fleet start --workers N --cpus-per-worker 0`, a trainer (this process)
that attaches one loader with ``num_workers=N`` (a session on each fleet worker, the
least busy first), ``persistent_workers=True``, batch 64, over a ``--mib`` MiB dataset
(a tensor, or bench_worker_cost.py's list of strings), 40 batches taken; then
`dpex fleet stop`.

Measured with the sessions alive (the largest of 5 readings, 0.5 s apart): the PSS of
every fleet worker's process tree (its forkserver, the fork bases, the sessions)
above the same trees before ``iter()``: the node memory serving the loader added,
shared pages counted once. Then per added fleet worker: (PSS at the most workers -
PSS at the fewest) / (the difference). A fleet worker that holds a copy of the
dataset of its own adds about the dataset's size; fleet workers that share their
node's base add what a forked worker adds (bench_worker_cost.py: ~14 MiB).

    python scripts/bench_fleet_cost.py [--mib 256] [--workers 2,6] [--kinds tensor]

Prints a markdown table (progress to stderr) and writes the JSON to ``--out``.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
sys.path.insert(0, os.path.join(ROOT, "scripts"))
sys.path.insert(0, os.path.join(ROOT, "tests"))


def say(text: str) -> None:
    print(text, file=sys.stderr, flush=True)


def fleet_tree_pss(pids: set[int]) -> tuple[float, int]:
    from bench_worker_cost import descendants, smaps_mib

    tree = descendants(pids)
    return sum(smaps_mib(p)["pss"] for p in tree), len(tree)


def fleet_pids(name: str) -> set[int]:
    from dpex._fleet_registry import fleet_workers, sample

    return {s["pid"] for s in sample(fleet_workers(name)).values()
            if isinstance(s.get("pid"), int)}


def one(address: str, env: dict, kind: str, workers: int, mib: int) -> dict:
    import raycluster
    from bench_worker_cost import BATCH, build, make_dataset

    from dpex import DpexDataLoader

    name = f"cost{workers}"
    dpex = os.path.join(os.path.dirname(sys.executable), "dpex")
    raycluster.run([dpex, "fleet", "start", "--name", name, "--workers", str(workers),
                    "--cpus-per-worker", "0", "--address", address], env)
    try:
        data, _ = build(kind, mib)
        dataset = make_dataset(kind, data)
        del data
        time.sleep(3.0)  # (the fleet workers' forkservers finish starting)
        pids = fleet_pids(name)
        before, _ = fleet_tree_pss(pids)
        loader = DpexDataLoader(dataset, batch_size=BATCH, num_workers=workers,
                                persistent_workers=True, distribute_mode=True,
                                worker_pool=name, timeout=300)
        t = time.perf_counter()
        it = iter(loader)
        next(it)
        first = time.perf_counter() - t
        for _ in range(39):
            next(it)
        readings = []
        for _ in range(5):
            time.sleep(0.5)
            pss, processes = fleet_tree_pss(pids)
            readings.append((pss - before, processes))
            next(it)
        served = {w["pid"] for w in loader.stats()["workers"].values()}
        loader.close()
    finally:
        raycluster.run([dpex, "fleet", "stop", "--name", name, "--address", address], env,
                       check=False)
    pss, processes = max(readings)
    return {"kind": kind, "workers": workers, "fleet_pss_mib": round(pss, 1),
            "processes": processes, "fleet_workers_serving": len(served),
            "first_batch_s": round(first, 3)}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--mib", type=int, default=256)
    p.add_argument("--workers", default="2,6")
    p.add_argument("--kinds", nargs="+", default=["tensor"], choices=["tensor", "strings"])
    p.add_argument("--copies", action="store_true",
                   help="start the fleets with DPEX_FLEET_SHARE_BASES=0: a base (a copy of "
                        "the dataset) per fleet worker, the opt-out (docs/FLEET.md)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "bench", "fleet_cost.json"))
    p.add_argument("--child", nargs=3, metavar=("ADDRESS", "KIND", "WORKERS"),
                   help=argparse.SUPPRESS)
    args = p.parse_args()
    if args.child:  # (a trainer of its own: Ray reads its token from the environment)
        import ray

        address, kind, n = args.child
        ray.init(address=address, logging_level="ERROR")
        print("RESULT " + json.dumps(one(address, dict(os.environ), kind, int(n), args.mib)))
        return
    counts = [int(n) for n in args.workers.split(",")]
    import raycluster

    rows = []
    with raycluster.ray_head() as (address, env):
        # (read by `dpex fleet start`, which hands it to its workers)
        env = dict(env, DPEX_FLEET_SHARE_BASES="0" if args.copies else "1")
        for kind in args.kinds:
            for n in counts:
                say(f"{kind}, {n} fleet workers ...")
                out = raycluster.run([sys.executable, os.path.abspath(__file__), "--mib",
                                      str(args.mib), "--child", address, kind, str(n)],
                                     env, timeout=600)
                line = [ln for ln in out.stdout.splitlines() if ln.startswith("RESULT ")][-1]
                rows.append(json.loads(line[len("RESULT "):]))
                say(f"  {rows[-1]}")
    print(f"| {args.mib} MiB dataset | fleet workers | fleet PSS +MiB | processes | "
          f"first batch s |")
    print("|---|---:|---:|---:|---:|")
    for r in rows:
        print(f"| {r['kind']} | {r['workers']} | {r['fleet_pss_mib']:.0f} | "
              f"{r['processes']} | {r['first_batch_s']:.2f} |")
    print()
    print("| dataset | fleet PSS per added fleet worker, MiB |")
    print("|---|---:|")
    for kind in args.kinds:
        mine = sorted((r for r in rows if r["kind"] == kind), key=lambda r: r["workers"])
        if len(mine) >= 2:
            lo, hi = mine[0], mine[-1]
            added = (hi["fleet_pss_mib"] - lo["fleet_pss_mib"]) / (hi["workers"] - lo["workers"])
            print(f"| {kind} | {added:.0f} |")
    os.makedirs(os.path.dirname(args.out), exist_ok=True)
    with open(args.out, "w") as f:
        json.dump({"mib": args.mib, "rows": rows}, f, indent=1)


if __name__ == "__main__":
    main()
