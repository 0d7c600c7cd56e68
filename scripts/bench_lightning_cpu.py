"""What a short Lightning script costs the machine: CPU-seconds of all processes, dpex
against torch's DataLoader.

Runs ``tests/lightning_app.py --scenario single`` (``Trainer.fit`` on one CPU device
with a train and a validation loader from a LightningDataModule, ``fit`` again with
persistent loaders passed directly, then ``predict``; 2 workers each,
``seed_everything(..., workers=True)``) with ``--loader torch`` and ``--loader dpex``
(which starts its own Ray, the embedded default), alternating, ``--repeats`` times
each, every run a fresh process. The figure is the machine's busy CPU time during
the run (``/proc/stat``: every process, Ray's own included), so run it on an
otherwise idle machine; the wall time beside it.

    python scripts/bench_lightning_cpu.py [--repeats 2]

Prints a markdown table (progress to stderr).
"""

from __future__ import annotations

import argparse
import os
import statistics
import subprocess
import sys
import tempfile
import time

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
APP = os.path.join(ROOT, "tests", "lightning_app.py")
TICK = os.sysconf("SC_CLK_TCK")


def busy_s() -> float:
    """CPU-seconds the whole machine has spent busy (not idle, not waiting for I/O)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / TICK


def run(loader: str, timeout: float) -> tuple[float, float]:
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    env.setdefault("PYTHONPATH", ROOT)
    with tempfile.TemporaryDirectory() as out:
        c0, t0 = busy_s(), time.perf_counter()
        subprocess.run([sys.executable, APP, "--loader", loader, "--scenario", "single",
                        "--out", out], check=True, timeout=timeout, env=env, cwd=ROOT,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
        time.sleep(2.0)  # (what it left to end: Ray's processes after its exit)
        return busy_s() - c0 - 2.0 * _idle_rate, time.perf_counter() - t0 - 2.0


_idle_rate = 0.0  # busy CPU-seconds per second of the idle machine (measured first)


def main() -> None:
    global _idle_rate
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--repeats", type=int, default=2)
    p.add_argument("--timeout", type=float, default=600.0)
    args = p.parse_args()
    c0 = busy_s()
    time.sleep(5.0)
    _idle_rate = (busy_s() - c0) / 5.0
    print(f"idle machine: {_idle_rate:.2f} busy CPU-s per s", file=sys.stderr)
    results: dict[str, list[tuple[float, float]]] = {"torch": [], "dpex": []}
    for r in range(args.repeats):
        for loader in (("torch", "dpex") if r % 2 == 0 else ("dpex", "torch")):
            cpu, wall = run(loader, args.timeout)
            cpu -= wall * _idle_rate  # the machine's own background
            results[loader].append((cpu, wall))
            print(f"[{loader} {r + 1}/{args.repeats}] {cpu:.1f} CPU-s, {wall:.1f} s",
                  file=sys.stderr, flush=True)
    torch_cpu = statistics.median(c for c, _ in results["torch"])
    print(f"Lightning `single` scenario ({APP.replace(ROOT + os.sep, '')}), "
          f"{os.cpu_count()} cores, median of {args.repeats}\n")
    print("| loader | CPU-s, all processes | wall s | CPU / torch's |")
    print("|---|---:|---:|---:|")
    for loader, runs in results.items():
        cpu = statistics.median(c for c, _ in runs)
        wall = statistics.median(w for _, w in runs)
        print(f"| {loader} | {cpu:.1f} | {wall:.1f} | {cpu / torch_cpu:.1f}× |")


if __name__ == "__main__":
    main()
