"""Scale model: how fast can one training rank ingest from N remote dpex workers?

    throughput(N) = min( N / worker_s,          the workers' compute
                         1 / trainer_s,         the rank's CPU per batch (its ingest)
                         bandwidth / bytes )    the rank's network link

worker_s and trainer_s are CPU seconds per batch (every thread: collate, encode,
ZeroMQ's I/O thread, the kernel's socket work), measured here in a real run of
one worker over the socket path that remote workers use; bytes is the batch's
size on the wire. With ``--shared-cores C`` trainer and workers share C cores
(as on one machine): C / (worker_s + trainer_s) batches/s at most.

    python scripts/scale_model.py --scenario small --bandwidth-gbps 10
    python scripts/scale_model.py --scenario medium --check   # vs 2 workers here
    python scripts/scale_model.py --scenario small --loop-step-ms 5   # workers it needs
"""

from __future__ import annotations

import argparse
import math
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import bench  # noqa: E402
import cloudpickle  # noqa: E402

from dpex import DpexDataLoader  # noqa: E402

cloudpickle.register_pickle_by_value(bench)  # Ray workers cannot import scripts/


def _cpu_seconds(pid: int) -> float:
    """CPU time (user + system, all threads) of a process so far."""
    with open(f"/proc/{pid}/stat") as f:
        fields = f.read().rsplit(")", 1)[1].split()
    return (int(fields[11]) + int(fields[12])) / os.sysconf("SC_CLK_TCK")


def measure(scenario: str, workers: int, batches: int) -> dict:
    """A real run over the socket path (the one remote workers take): batches/s, and
    the CPU per batch of the trainer and of the workers (every thread, from /proc)."""
    make, batch_size, _ = bench.SCENARIOS[scenario]
    loader = DpexDataLoader(make(batch_size * batches), batch_size=batch_size,
                            num_workers=workers, persistent_workers=True,
                            distribute_mode=True, shm_ring_bytes=0)
    try:
        for _ in loader:  # warm-up epoch
            pass
        it = iter(loader)
        next(it)
        # Each worker's process (a session forked on its host) and the host's own.
        pids = {p for w in loader.stats()["workers"].values()
                for p in (w["pid"], w.get("session_pid")) if p}
        w0, c0, t0 = sum(map(_cpu_seconds, pids)), time.process_time(), time.perf_counter()
        n, nbytes = 0, 0
        for batch in it:
            n += 1
            nbytes = batch.numel() * batch.element_size()
        wall = time.perf_counter() - t0
        return {"rate": n / wall, "trainer_s": (time.process_time() - c0) / n,
                "worker_s": (sum(map(_cpu_seconds, pids)) - w0) / n, "bytes": nbytes}
    finally:
        loader.close()


def predict(n: int, worker_s: float, trainer_s: float, nbytes: int, bandwidth: float,
            shared_cores: float | None) -> tuple[float, str]:
    limits = {"workers": n / worker_s, "trainer CPU": 1 / trainer_s,
              "network": bandwidth / nbytes}
    if shared_cores:  # every batch costs worker_s + trainer_s of the same cores
        limits["shared cores"] = shared_cores / (worker_s + trainer_s)
    name = min(limits, key=limits.get)
    return limits[name], name


def workers_needed(batch_s: float, step_s: float, margin: float = 0.15) -> int:
    """Workers that keep a training loop whose own step takes ``step_s`` fed, when a
    worker takes ``batch_s`` per batch: batch_s / step_s, plus ``margin``, at least 1
    (what ``dpex.Autoscale`` aims for when the loop stalls; docs/AUTOSCALE.md)."""
    return max(1, math.ceil(batch_s / step_s * (1 + margin)))


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenario", default="medium", choices=list(bench.SCENARIOS))
    p.add_argument("--bandwidth-gbps", type=float, default=10.0, help="the rank's link, Gbit/s")
    p.add_argument("--max-workers", type=int, default=64)
    p.add_argument("--shared-cores", type=float, default=None,
                   help="workers share this many cores with the trainer (one machine)")
    p.add_argument("--batches", type=int, default=None, help="per measured epoch")
    p.add_argument("--check", action="store_true",
                   help="also measure 2 local workers and compare with the model")
    p.add_argument("--loop-step-ms", type=float, default=None,
                   help="the training loop's own time per batch: print the workers it needs")
    args = p.parse_args()
    import ray

    from dpex._ray_connect import connect_ray

    connect_ray("auto")  # as a user's first loader does
    try:
        batches = args.batches or bench.SCENARIOS[args.scenario][2]
        print(f"measuring the costs with 1 worker ({args.scenario}, {batches} batches) ...",
              flush=True)
        one = measure(args.scenario, 1, batches)
        worker_s, trainer_s, nbytes = one["worker_s"], one["trainer_s"], one["bytes"]
        bandwidth = args.bandwidth_gbps * 1e9 / 8
        print(f"{args.scenario}: worker {worker_s * 1e3:.2f} ms CPU/batch, trainer "
              f"{trainer_s * 1e6:.0f} µs CPU/batch, {nbytes / 2**20:.2f} MiB/batch, link "
              f"{args.bandwidth_gbps:g} Gbit/s")
        ceiling = min(1 / trainer_s, bandwidth / nbytes)
        print(f"one rank saturates at {ceiling:.0f} batches/s with about "
              f"{math.ceil(worker_s * ceiling)} remote workers\n")
        if args.loop_step_ms:
            step = args.loop_step_ms / 1e3
            print(f"a loop whose step takes {args.loop_step_ms:g} ms needs "
                  f"{workers_needed(worker_s, step)} workers (worker CPU per batch / step, "
                  f"+15 %), if the rank can take {1 / step:.0f} batches/s "
                  f"({'yes' if 1 / step <= ceiling else 'no: it saturates first'})\n")
        print("| workers | predicted batches/s | limited by |\n|---:|---:|---|")
        n = 1
        while n <= args.max_workers:
            rate, limit = predict(n, worker_s, trainer_s, nbytes, bandwidth, args.shared_cores)
            print(f"| {n} | {rate:.0f} | {limit} |")
            n *= 2
        if args.check:
            cores = args.shared_cores or os.cpu_count()
            print(f"\ncheck on this machine ({cores:g} cores shared by trainer and workers; "
                  "the costs come from the 1-worker run):")
            print("| workers | predicted | measured | measured/predicted |\n|---:|---:|---:|---:|")
            for w, got in ((1, one), (2, measure(args.scenario, 2, batches))):
                # Loopback here: no link limit, the cores are the shared resource.
                rate, limit = predict(w, worker_s, trainer_s, nbytes, math.inf, cores)
                print(f"| {w} | {rate:.0f} ({limit}) | {got['rate']:.0f} | "
                      f"{got['rate'] / rate:.2f} |", flush=True)
    finally:
        ray.shutdown()


if __name__ == "__main__":
    main()
