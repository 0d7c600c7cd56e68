"""Benchmark: dpex (distribute_mode=True) against torch's DataLoader and the wire, A/B in one run.

The loaders get the same dataset, num_workers and prefetch_factor: torch's, dpex
(whose workers on this node use the shared-memory rings), dpex-socket (rings off:
the path of workers on other nodes, default security: authenticated, frames in
clear) and dpex-socket-enc (the same with encryption=True, CURVE). Beside them the
physical reference of the socket path: zmq-raw and zmq-raw-curve, ``num_workers``
sender processes pushing the very bytes of a batch message (structure and buffers,
made once) to one PULL socket in this process, with no dataset, no protocol and no
credits. Runs alternate (forward, then the reverse order, ...) so machine noise hits
all alike. Throughput is measured on the second epoch of persistent workers; the
first warms up (the raw senders likewise send one untimed round first).
Reported per scenario and loader: median and min–max of batches/s, GB/s, the
ratio to torch and, for the socket paths, to the raw reference of the same
security, the trainer process's CPU time per batch (all its threads) and, of it, the
training thread's CPU time inside ``next()`` (what the training loop itself loses to
the loader), per MiB, time to the first
batch (cold: fresh workers; warm: persistent workers, next epoch; fresh: a new
non-persistent iterator right after the run, on dpex's warm workers, see
docs/WARM_WORKERS.md) and the trainer's peak RSS above its level before the
run. Ray's start is timed apart.

    python scripts/bench.py                          # all scenarios, 3 repeats
    python scripts/bench.py --scenarios small large --repeats 5
    python scripts/bench.py --quick                  # a smoke run (seconds)
    python scripts/bench.py --loaders dpex-socket zmq-raw   # (torch always runs)

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
from typing import Any

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
    if loader_name == "dpex-socket-enc":  # the same, every frame encrypted (CURVE)
        return DpexDataLoader(dataset, distribute_mode=True, shm_ring_bytes=0,
                              encryption=True, **kw)
    return DpexDataLoader(dataset, distribute_mode=True, **kw)


# The raw reference of each socket path (the same security), for the wire ratio.
RAW_OF = {"dpex-socket": "zmq-raw", "dpex-socket-enc": "zmq-raw-curve"}


def raw_push(ctx: Any, hwm: int, server_public: bytes | None) -> Any:
    """A raw reference's PUSH socket: in clear, or a CURVE client of ``server_public``."""
    import zmq

    sock = ctx.socket(zmq.PUSH)
    sock.setsockopt(zmq.SNDHWM, hwm)
    sock.setsockopt(zmq.LINGER, 30_000)
    if server_public is not None:
        public, secret = zmq.curve_keypair()
        sock.setsockopt(zmq.CURVE_SERVERKEY, server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, secret)
    return sock


def raw_pull(ctx: Any, hwm: int, curve: bool) -> tuple[Any, bytes | None]:
    """A raw reference's PULL socket (a CURVE server with ``curve``) and its public key."""
    import zmq

    pull = ctx.socket(zmq.PULL)
    pull.setsockopt(zmq.RCVHWM, hwm)
    pull.setsockopt(zmq.LINGER, 0)
    if not curve:
        return pull, None
    public, secret = zmq.curve_keypair()
    pull.setsockopt(zmq.CURVE_SERVER, 1)
    pull.setsockopt(zmq.CURVE_PUBLICKEY, public)
    pull.setsockopt(zmq.CURVE_SECRETKEY, secret)
    return pull, public


def _raw_sender(address: str, server_public: bytes | None, frames: list[bytes], count: int,
                hwm: int, ready: Any, go: Any) -> None:
    """One sender process: once told to go, push ``count`` copies of one batch
    message's frames."""
    import zmq

    ctx = zmq.Context()
    sock = raw_push(ctx, hwm, server_public)
    sock.connect(address)
    ready.set()
    if not go.wait(120):
        return
    for _ in range(count):
        sock.send_multipart(frames, copy=False)
    sock.close()
    ctx.term()


def raw_run(curve: bool, scenario: str, args, batches: int) -> dict:
    """The wire alone: ``args.workers`` processes push the bytes of one batch message
    ``batches`` times in all (after an untimed warm-up round) to a PULL socket here."""
    import multiprocessing

    import zmq
    from torch.utils.data import default_collate

    from dpex._codec import encode_batch

    make, batch_size, _ = SCENARIOS[scenario]
    dataset = make(batch_size)
    parts = encode_batch(default_collate([dataset[i] for i in range(batch_size)]))
    frames = [bytes(memoryview(p).cast("B")) for p in parts]
    nbytes = sum(len(f) for f in frames[1:])  # the batch's tensor bytes, as for the loaders
    warm = max(1, args.workers * 2)
    per_sender = -(-(batches + warm) // args.workers)
    total = per_sender * args.workers
    hwm = args.prefetch_factor  # messages queued per connection, as dpex's credits allow
    ctx = zmq.Context()
    pull, server_public = raw_pull(ctx, hwm, curve)
    address = f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}"
    spawn = multiprocessing.get_context("spawn")
    go = spawn.Event()
    ready = [spawn.Event() for _ in range(args.workers)]
    senders = [spawn.Process(target=_raw_sender, args=(address, server_public, frames,
                                                       per_sender, hwm, r, go), daemon=True)
               for r in ready]
    for p in senders:  # started untimed: a process start is no part of the wire
        p.start()
    for r in ready:
        if not r.wait(120):
            raise TimeoutError("a raw sender did not start")
    with RssPeak() as rss:
        t0 = time.perf_counter()
        go.set()
        for _ in range(warm):
            pull.recv_multipart(copy=False)
        first = time.perf_counter() - t0
        cpu0, t1 = time.process_time(), time.perf_counter()
        for _ in range(total - warm):
            if not pull.poll(60_000):
                raise TimeoutError("a raw sender stopped sending")
            pull.recv_multipart(copy=False)
        elapsed, cpu = time.perf_counter() - t1, time.process_time() - cpu0
    for p in senders:
        p.join(30)
    pull.close()
    ctx.term()
    n = total - warm
    return {"ttfb_fresh_ms": float("nan"), "batches_per_s": n / elapsed,
            "gb_per_s": n * nbytes / elapsed / 1e9, "cpu_us_per_batch": cpu / n * 1e6,
            "cpu_ms_per_mib": cpu * 1e3 / (n * nbytes / 2**20),
            "ttfb_cold_ms": first * 1e3, "ttfb_warm_ms": float("nan"),
            "peak_rss_mib": (rss.peak - rss.base) / 2**20, "data_wait_pct": float("nan"),
            "next_cpu_us_per_batch": float("nan")}


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


LOADERS = ("torch", "dpex", "dpex-socket", "dpex-socket-enc", "zmq-raw", "zmq-raw-curve")


def one_run(loader_name: str, scenario: str, args, batches: int) -> dict:
    if loader_name.startswith("zmq-raw"):
        return raw_run(loader_name == "zmq-raw-curve", scenario, args, batches)
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
        n, waited, inside = 1, 0.0, 0.0
        while True:  # the loop body is empty: the share waited in next() is the stall
            t, c = time.perf_counter(), time.thread_time()
            try:
                batch = next(it)
            except StopIteration:
                break
            inside += time.thread_time() - c  # the training thread's CPU in next()
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
            "cpu_us_per_batch": cpu / (n - 1) * 1e6,
            "cpu_ms_per_mib": cpu * 1e3 / (nbytes / 2**20) if nbytes else float("nan"),
            "ttfb_cold_ms": ttfb_cold * 1e3,
            "ttfb_warm_ms": ttfb_warm * 1e3, "peak_rss_mib": (rss.peak - rss.base) / 2**20,
            "data_wait_pct": 100 * waited / elapsed,
            "next_cpu_us_per_batch": inside / (n - 1) * 1e6}


def summarize(runs: list[dict]) -> dict:
    out = {}
    for key in runs[0]:
        vals = [r.get(key, float("nan")) for r in runs]
        out[key] = {"median": statistics.median(vals), "min": min(vals), "max": max(vals)}
    return out


def _num(value: float, fmt: str = ".0f") -> str:
    return "–" if value != value else format(value, fmt)  # NaN: not measured for this one


def table(results: dict) -> str:
    rows = ["| scenario | loader | batches/s (min–max) | GB/s | vs torch | vs raw ZeroMQ "
            "| trainer CPU µs/batch | of it in next() µs | trainer CPU ms/MiB "
            "| first batch cold ms "
            "| first batch warm ms | first batch fresh ms | peak RSS +MiB | waited in next() % |",
            "|---|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|"]
    for scenario, by_loader in results.items():
        t = by_loader["torch"]["batches_per_s"]["median"]
        for name in by_loader:
            s = by_loader[name]
            b = s["batches_per_s"]
            ratio = f"{b['median'] / t:.2f}×" if name != "torch" else ""
            raw = by_loader.get(RAW_OF.get(name, ""))
            wire = f"{b['median'] / raw['batches_per_s']['median']:.2f}" if raw else ""
            rows.append(
                f"| {scenario} | {name} | {b['median']:.0f} ({b['min']:.0f}–{b['max']:.0f}) | "
                f"{s['gb_per_s']['median']:.2f} | {ratio} | {wire} | "
                f"{s['cpu_us_per_batch']['median']:.0f} | "
                f"{_num(s.get('next_cpu_us_per_batch', {}).get('median', float('nan')))} | "
                f"{_num(s['cpu_ms_per_mib']['median'], '.3f')} | "
                f"{_num(s['ttfb_cold_ms']['median'])} | "
                f"{_num(s['ttfb_warm_ms']['median'])} | {_num(s['ttfb_fresh_ms']['median'])} | "
                f"{s['peak_rss_mib']['median']:.0f} | "
                f"{_num(s['data_wait_pct']['median'])} |")
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
    p.add_argument("--loaders", nargs="+", default=list(LOADERS), choices=list(LOADERS),
                   help="which to run besides torch (the ratios' base)")
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
    loaders = ("torch", *(n for n in LOADERS if n in args.loaders and n != "torch"))
    runs: dict = {s: {name: [] for name in loaders} for s in args.scenarios}
    try:
        for rep in range(args.repeats):
            order = loaders if rep % 2 == 0 else loaders[::-1]
            for scenario in args.scenarios:
                batches = 8 if args.quick else SCENARIOS[scenario][2]
                for name in order:
                    r = one_run(name, scenario, args, batches)
                    runs[scenario][name].append(r)
                    print(f"[{rep + 1}/{args.repeats}] {scenario:6s} {name:15s} "
                          f"{r['batches_per_s']:8.1f} batches/s  {r['gb_per_s']:6.2f} GB/s  "
                          f"CPU {r['cpu_us_per_batch']:7.0f} µs/batch "
                          f"(next() {_num(r['next_cpu_us_per_batch'])}) "
                          f"{_num(r['cpu_ms_per_mib'], '.3f')} ms/MiB  first "
                          f"{_num(r['ttfb_cold_ms'])}/{_num(r['ttfb_warm_ms'])} ms", flush=True)
    finally:
        ray.shutdown()
    results = {s: {n: summarize(r) for n, r in by.items()} for s, by in runs.items()}
    md = table(results)
    print("\n" + md)
    meta = {"machine": platform.machine(), "cpus": os.cpu_count(), "torch": torch.__version__,
            "workers": args.workers, "prefetch_factor": args.prefetch_factor,
            "repeats": args.repeats, "ray_start_s": ray_start}
    write_outputs(args.out, "bench", {"meta": meta, "results": results, "runs": runs}, md,
                  lambda path: plot(results, path))


def write_outputs(out: str, name: str, data: dict, md: str, plot_to: Any) -> None:
    """``<out>/<name>.json`` (``data``), ``.md`` (the table) and ``.png`` (``plot_to(path)``)."""
    os.makedirs(out, exist_ok=True)
    with open(os.path.join(out, f"{name}.json"), "w") as f:
        json.dump(data, f, indent=1)
    with open(os.path.join(out, f"{name}.md"), "w") as f:
        f.write(md + "\n")
    plot_to(os.path.join(out, f"{name}.png"))
    print(f"wrote {out}/{name}.json, {name}.md, {name}.png")


if __name__ == "__main__":
    main()
