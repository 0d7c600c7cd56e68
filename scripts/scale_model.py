"""Scale model: how fast can one training rank ingest from N remote dpex workers?

    throughput(N) = min( N / worker_s,          the workers' compute
                         1 / trainer_s,         the rank's CPU per batch (its ingest)
                         bandwidth / bytes )    the rank's network link

where worker_s is one worker's time per batch (fetch + collate + encode), trainer_s
the rank's CPU time per batch, and bytes the batch size on the wire. With
``--shared-cores C`` the workers share C cores with the trainer (as on one
machine): N·worker_s + trainer_s ≤ C seconds of CPU per second.

    python scripts/scale_model.py --scenario small --bandwidth-gbps 10
    python scripts/scale_model.py --scenario medium --check   # vs 1 and 2 workers here

worker_s is measured here on the scenario's data; trainer_s comes from
docs/bench/bench.json (``scripts/bench.py``), or from --trainer-us.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time

import torch
from torch.utils.data import default_collate

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
import cloudpickle  # noqa: E402

from dpex._protocol import Wire  # noqa: E402

cloudpickle.register_pickle_by_value(bench)  # Ray workers cannot import scripts/


def worker_seconds(scenario: str, batches: int = 30) -> tuple[float, int]:
    """One worker's time per batch (fetch + collate + encode) and the batch's bytes."""
    make, batch_size, _ = bench.SCENARIOS[scenario]
    dataset, wire = make(batch_size * batches), Wire.new()
    torch.set_num_threads(1)
    t0 = time.perf_counter()
    for b in range(batches):
        batch = default_collate([dataset[b * batch_size + i] for i in range(batch_size)])
        frames = wire.encode_data(1, b, 0, batch)
    per_batch = (time.perf_counter() - t0) / batches
    return per_batch, sum(memoryview(f).nbytes for f in frames)


def predict(n: int, worker_s: float, trainer_s: float, nbytes: int, bandwidth: float,
            shared_cores: float | None) -> tuple[float, str]:
    limits = {"workers": n / worker_s, "trainer CPU": 1 / trainer_s,
              "network": bandwidth / nbytes}
    if shared_cores:
        limits["shared cores"] = shared_cores / (n * worker_s + trainer_s)
    name = min(limits, key=limits.get)
    return limits[name], name


def measure(scenario: str, workers: int, batches: int) -> float:
    args = argparse.Namespace(workers=workers, prefetch_factor=2)
    return bench.one_run("dpex", scenario, args, batches)["batches_per_s"]


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="medium", choices=list(bench.SCENARIOS))
    p.add_argument("--bandwidth-gbps", type=float, default=10.0, help="the rank's link, Gbit/s")
    p.add_argument("--trainer-us", type=float, default=None,
                   help="trainer CPU per batch (default: from docs/bench/bench.json)")
    p.add_argument("--bench-json", default=os.path.join(bench.ROOT, "docs", "bench", "bench.json"))
    p.add_argument("--max-workers", type=int, default=64)
    p.add_argument("--shared-cores", type=float, default=None,
                   help="workers share this many cores with the trainer (one machine)")
    p.add_argument("--check", action="store_true",
                   help="measure 1 and 2 local workers and compare with the model")
    args = p.parse_args()
    worker_s, nbytes = worker_seconds(args.scenario)
    if args.trainer_us is None:
        with open(args.bench_json) as f:
            stats = json.load(f)["results"][args.scenario]["dpex"]
        args.trainer_us = stats["cpu_us_per_batch"]["median"]
    trainer_s = args.trainer_us / 1e6
    bandwidth = args.bandwidth_gbps * 1e9 / 8
    print(f"{args.scenario}: worker {worker_s * 1e3:.2f} ms/batch, trainer "
          f"{trainer_s * 1e6:.0f} µs/batch, {nbytes / 2**20:.2f} MiB/batch, link "
          f"{args.bandwidth_gbps:g} Gbit/s")
    ceiling = min(1 / trainer_s, bandwidth / nbytes)
    saturate = math.ceil(worker_s * ceiling)
    print(f"one rank saturates at {ceiling:.0f} batches/s with about {saturate} workers\n")
    print("| workers | predicted batches/s | limited by |\n|---:|---:|---|")
    n = 1
    while n <= args.max_workers:
        rate, limit = predict(n, worker_s, trainer_s, nbytes, bandwidth, args.shared_cores)
        print(f"| {n} | {rate:.0f} | {limit} |")
        n *= 2
    if args.check:
        import ray

        ray.init(include_dashboard=False, log_to_driver=False)
        cores = args.shared_cores or os.cpu_count()
        print(f"\ncheck on this machine ({cores:g} cores shared by trainer and workers):")
        print("| workers | predicted | measured | measured/predicted |\n|---:|---:|---:|---:|")
        try:
            for w in (1, 2):
                rate, _ = predict(w, worker_s, trainer_s, nbytes, bandwidth, cores)
                got = measure(args.scenario, w, bench.SCENARIOS[args.scenario][2])
                print(f"| {w} | {rate:.0f} | {got:.0f} | {got / rate:.2f} |", flush=True)
        finally:
            ray.shutdown()


if __name__ == "__main__":
    main()
