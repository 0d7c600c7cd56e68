"""Benchmark: dpex (distribute_mode=True) against torch's DataLoader, A/B in one run.

Three loaders get the same dataset, num_workers and prefetch_factor: torch's,
dpex (whose workers on this node use the shared-memory rings) and dpex-socket
(rings off: the path of workers on other nodes). Runs alternate (torch, dpex,
dpex-socket, then the reverse, ...) so machine noise hits all alike. Throughput
is measured on the second epoch of persistent workers; the first warms up.
Reported per scenario and loader: median and min–max of batches/s, GB/s, the
dpex/torch ratio, the trainer process's CPU time per batch, time to the first
batch (cold: fresh workers; warm: persistent workers, next epoch; fresh: a new
non-persistent iterator right after the run, on dpex's warm workers, see
docs/WARM_WORKERS.md) and the trainer's peak RSS above its level before the
run. Ray's start is timed apart.

    python scripts/bench.py                          # all scenarios, 3 repeats
    python scripts/bench.py --scenarios small large --repeats 5
    python scripts/bench.py --quick                  # a smoke run (seconds)

Writes a markdown table to stdout, and JSON and a PNG plot to --out (default
docs/bench/).
"""

from __future__ import annotations

import argparse
import io
import json
import os
import platform
import statistics
import threading
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from dpex import DpexDataLoader

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


class Synthetic(Dataset):
    """Items of one shape and dtype, made without computation (transport-bound)."""

    def __init__(self, shape: tuple, dtype: torch.dtype, n: int) -> None:
        self.shape, self.dtype, self.n = shape, dtype, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full(self.shape, i % 251, dtype=self.dtype)


class Jpegs(Dataset):
    """CPU-bound: JPEG decode (Pillow), random-resized crop to 224, flip, to tensor."""

    def __init__(self, n: int, size: tuple = (320, 240), distinct: int = 64) -> None:
        from PIL import Image

        rng = np.random.default_rng(0)
        self.n, self.images = n, []
        for _ in range(distinct):
            pixels = rng.integers(0, 255, (size[1], size[0], 3), dtype=np.uint8)
            pixels = np.cumsum(pixels, axis=1, dtype=np.uint16).astype(np.uint8)  # some structure
            buf = io.BytesIO()
            Image.fromarray(pixels).save(buf, format="JPEG", quality=90)
            self.images.append(buf.getvalue())

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        from PIL import Image

        img = Image.open(io.BytesIO(self.images[i % len(self.images)])).convert("RGB")
        w, h = img.size
        scale = float(torch.empty(()).uniform_(0.3, 1.0))
        cw, ch = max(8, int(w * scale ** 0.5)), max(8, int(h * scale ** 0.5))
        x = int(torch.randint(0, w - cw + 1, ()))
        y = int(torch.randint(0, h - ch + 1, ()))
        img = img.resize((224, 224), Image.BILINEAR, box=(x, y, x + cw, y + ch))
        if torch.rand(()) < 0.5:
            img = img.transpose(Image.FLIP_LEFT_RIGHT)
        return torch.from_numpy(np.array(img)).permute(2, 0, 1).contiguous()


SCENARIOS = {
    # name: (dataset factory given a number of items, batch size, batches per run)
    "large": (lambda n: Synthetic((3, 224, 224), torch.uint8, n), 64, 300),
    "medium": (lambda n: Synthetic((3, 64, 64), torch.float32, n), 32, 1000),
    "small": (lambda n: Synthetic((64,), torch.float32, n), 256, 3000),
    "cpu": (lambda n: Jpegs(n), 32, 60),
}


class RssPeak:
    """Samples this process's RSS every 5 ms; ``peak`` is the highest seen."""

    def __init__(self) -> None:
        self.peak = self.base = self._rss()
        self._stop = threading.Event()
        self._thread = threading.Thread(target=self._run, daemon=True)

    @staticmethod
    def _rss() -> int:
        with open("/proc/self/statm") as f:
            return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE")

    def _run(self) -> None:
        while not self._stop.wait(0.005):
            self.peak = max(self.peak, self._rss())

    def __enter__(self) -> RssPeak:
        self._thread.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._stop.set()
        self._thread.join(5)


def make_loader(loader_name: str, dataset: Dataset, **kw) -> DataLoader:
    if loader_name == "torch":
        # forkserver: forking a process connected to Ray breaks Ray's client.
        return DataLoader(dataset, multiprocessing_context="forkserver", **kw)
    if loader_name == "dpex-socket":  # the path remote workers take: no shared memory
        return DpexDataLoader(dataset, distribute_mode=True, shm_ring_bytes=0, **kw)
    return DpexDataLoader(dataset, distribute_mode=True, **kw)


def fresh_first_batch(loader_name: str, dataset: Dataset, kw: dict) -> float:
    """Seconds from ``iter()`` to the first batch of a new loader's fresh iterator (no
    persistent workers), as each epoch of most training scripts starts; drains it."""
    if loader_name == "torch":  # as a user gets it: fork, Linux's default, which starts
        # workers fastest (they never touch Ray, so forking this process is safe for them)
        loader = DataLoader(dataset, **{**kw, "persistent_workers": False})
    else:
        loader = make_loader(loader_name, dataset, **{**kw, "persistent_workers": False})
    t0 = time.perf_counter()
    it = iter(loader)
    next(it)
    took = time.perf_counter() - t0
    for _ in it:
        pass
    return took


def one_run(loader_name: str, scenario: str, args, batches: int) -> dict:
    make, batch_size, _ = SCENARIOS[scenario]
    dataset = make(batch_size * batches)
    kw = {"batch_size": batch_size, "num_workers": args.workers,
          "prefetch_factor": args.prefetch_factor, "persistent_workers": True}
    loader = make_loader(loader_name, dataset, **kw)
    nbytes = 0
    with RssPeak() as rss:
        t0 = time.perf_counter()
        it = iter(loader)
        next(it)
        ttfb_cold = time.perf_counter() - t0
        for _ in it:  # the first epoch warms up: processes, pages, caches
            pass
        t1 = time.perf_counter()
        it = iter(loader)  # persistent workers: the next epoch starts warm
        next(it)
        ttfb_warm = time.perf_counter() - t1
        cpu0, t1 = time.process_time(), time.perf_counter()
        n, waited = 1, 0.0
        while True:  # the loop body is empty: the share waited in next() is the stall
            t = time.perf_counter()
            try:
                batch = next(it)
            except StopIteration:
                break
            waited += time.perf_counter() - t
            nbytes += batch.numel() * batch.element_size()
            n += 1
        elapsed, cpu = time.perf_counter() - t1, time.process_time() - cpu0
    del it
    if loader_name != "torch":
        loader.close()
    else:
        loader._iterator._shutdown_workers()
    short = make(batch_size * 4)  # a short epoch: the start is what is timed
    ttfb_fresh = fresh_first_batch(loader_name, short, kw)
    return {"ttfb_fresh_ms": ttfb_fresh * 1e3, "batches_per_s": (n - 1) / elapsed, "gb_per_s": nbytes / elapsed / 1e9,
            "cpu_us_per_batch": cpu / (n - 1) * 1e6, "ttfb_cold_ms": ttfb_cold * 1e3,
            "ttfb_warm_ms": ttfb_warm * 1e3, "peak_rss_mib": (rss.peak - rss.base) / 2**20,
            "data_wait_pct": 100 * waited / elapsed}


def summarize(runs: list[dict]) -> dict:
    out = {}
    for key in runs[0]:
        vals = [r[key] for r in runs]
        out[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def table(results: dict) -> str:
    rows = ["| scenario | loader | batches/s (min–max) | GB/s | dpex/torch | trainer CPU µs/batch "
            "| first batch cold ms | first batch warm ms | first batch fresh ms "
            "| peak RSS +MiB | waited in next() % |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for scenario, by_loader in results.items():
        t = by_loader["torch"]["batches_per_s"]["median"]
        for name in by_loader:
            s = by_loader[name]
            b = s["batches_per_s"]
            ratio = f"{b['median'] / t:.2f}×" if name != "torch" else ""
            rows.append(
                f"| {scenario} | {name} | {b['median']:.0f} ({b['min']:.0f}–{b['max']:.0f}) | "
                f"{s['gb_per_s']['median']:.2f} | {ratio} | "
                f"{s['cpu_us_per_batch']['median']:.0f} | {s['ttfb_cold_ms']['median']:.0f} | "
                f"{s['ttfb_warm_ms']['median']:.0f} | {s['ttfb_fresh_ms']['median']:.0f} | "
                f"{s['peak_rss_mib']['median']:.0f} | "
                f"{s['data_wait_pct']['median']:.0f} |")
    return "\n".join(rows)


def plot(results: dict, path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    names = list(results)
    fig, ax = plt.subplots(figsize=(8, 4))
    loaders = list(results[names[0]])
    width = 0.8 / len(loaders)
    for k, loader in enumerate(loaders):
        med = [results[s][loader]["batches_per_s"]["median"] for s in names]
        lo = [m - results[s][loader]["batches_per_s"]["min"] for m, s in zip(med, names, strict=True)]
        hi = [results[s][loader]["batches_per_s"]["max"] - m for m, s in zip(med, names, strict=True)]
        x = np.arange(len(names)) + (k - (len(loaders) - 1) / 2) * width
        ax.bar(x, med, width, yerr=[lo, hi], capsize=3, label=loader)
    ax.set_xticks(np.arange(len(names)), names)
    ax.set_yscale("log")
    ax.set_ylabel("batches/s (median, min–max)")
    ax.set_title("dpex vs torch DataLoader, same workers and prefetch")
    ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--scenarios", nargs="+", default=list(SCENARIOS), choices=list(SCENARIOS))
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--prefetch-factor", type=int, default=2)
    p.add_argument("--quick", action="store_true", help="tiny runs, 1 repeat (a smoke test)")
    p.add_argument("--out", default=os.path.join(ROOT, "docs", "bench"))
    args = p.parse_args()
    if args.quick:
        args.repeats = 1
    import ray

    from dpex._ray_connect import connect_ray

    t0 = time.perf_counter()
    connect_ray("auto")  # as a user's first loader does
    ray_start = time.perf_counter() - t0
    print(f"Ray start: {ray_start:.2f} s (not in any timed region)", flush=True)
    loaders = ("torch", "dpex", "dpex-socket")
    runs: dict = {s: {name: [] for name in loaders} for s in args.scenarios}
    try:
        for rep in range(args.repeats):
            order = loaders if rep % 2 == 0 else loaders[::-1]
            for scenario in args.scenarios:
                batches = 8 if args.quick else SCENARIOS[scenario][2]
                for name in order:
                    r = one_run(name, scenario, args, batches)
                    runs[scenario][name].append(r)
                    print(f"[{rep + 1}/{args.repeats}] {scenario:6s} {name:11s} "
                          f"{r['batches_per_s']:8.1f} batches/s  {r['gb_per_s']:6.2f} GB/s  "
                          f"CPU {r['cpu_us_per_batch']:7.0f} µs/batch  first "
                          f"{r['ttfb_cold_ms']:5.0f}/{r['ttfb_warm_ms']:4.0f} ms", flush=True)
    finally:
        ray.shutdown()
    results = {s: {n: summarize(r) for n, r in by.items()} for s, by in runs.items()}
    md = table(results)
    print("\n" + md)
    os.makedirs(args.out, exist_ok=True)
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "workers": args.workers, "prefetch_factor": args.prefetch_factor,
            "repeats": args.repeats, "ray_start_s": ray_start}
    with open(os.path.join(args.out, "bench.json"), "w") as f:
        json.dump({"meta": meta, "results": results, "runs": runs}, f, indent=1)
    with open(os.path.join(args.out, "bench.md"), "w") as f:
        f.write(md + "\n")
    plot(results, os.path.join(args.out, "bench.png"))
    print(f"wrote {args.out}/bench.json, bench.md, bench.png")


if __name__ == "__main__":
    main()
