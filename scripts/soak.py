"""Soak: stream many small batches and watch the trainer's memory and file descriptors.

Streams ``--batches`` batches (default 1,000,000) of 8 small items through one
DpexDataLoader iterator (one epoch) with 2 Ray workers, from a map-style dataset
or, with ``--iterable``, an endless IterableDataset (the loop stops after
``--batches``), samples the trainer's RSS and open
file descriptors every ``--every`` seconds, prints a progress line per sample,
and ends with a table. ``--json`` saves the samples and ``--plot`` draws them.
It exits with 1 if either grew past the warm-up by more than ``--rss-slack-mb``
MiB or ``--fd-slack`` descriptors.

    python scripts/soak.py                         # ~1M batches
    python scripts/soak.py --iterable              # ~1M batches of an endless stream
    python scripts/soak.py --batches 20000 --json soak.json --plot soak.png
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info

from dpex import DpexDataLoader


class Tiny(Dataset):
    def __init__(self, n: int) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.full((16,), i, dtype=torch.int64)


class Endless(IterableDataset):
    """Items without end; worker ``w`` of ``k`` yields w, w + k, w + 2k, ..."""

    def __iter__(self):
        info = get_worker_info()
        i, step = (info.id, info.num_workers) if info is not None else (0, 1)
        while True:
            yield torch.full((16,), i, dtype=torch.int64)
            i += step


def rss_mib() -> float:
    with open("/proc/self/statm") as f:
        return int(f.read().split()[1]) * os.sysconf("SC_PAGE_SIZE") / 2**20


def open_fds() -> int:
    return len(os.listdir("/proc/self/fd"))


def soak(batches: int, every: float, workers: int, iterable: bool = False) -> list[dict]:
    dataset = Endless() if iterable else Tiny(batches * 8)
    loader = DpexDataLoader(dataset, batch_size=8, num_workers=workers,
                            timeout=60, distribute_mode=True)
    samples: list[dict] = []
    t0 = last = time.monotonic()
    with loader:
        for n, batch in enumerate(loader, 1):
            # Map-style: batch k holds items 8k..8k+7. Endless: batch k comes from worker
            # k % workers (round robin), its (k // workers)-th batch.
            first = (n - 1) * 8 if not iterable else (
                (n - 1) % workers + ((n - 1) // workers) * 8 * workers)
            if batch[0, 0].item() != first:
                raise AssertionError(f"batch {n - 1} is out of place")
            now = time.monotonic()
            if now - last >= every or n == batches:
                last = now
                samples.append({"t": now - t0, "batches": n, "rss_mib": rss_mib(),
                                "fds": open_fds()})
                s = samples[-1]
                print(f"{n:>10,} batches  {s['t']:7.1f} s  {n / s['t']:8.0f} batches/s  "
                      f"RSS {s['rss_mib']:7.1f} MiB  fds {s['fds']}", flush=True)
            if n == batches:
                break
    return samples


def growth(samples: list[dict]) -> tuple[float, int]:
    """RSS (MiB) and fd growth from the end of the warm-up (first quarter) to the end."""
    base = samples[len(samples) // 4]
    end = samples[-1]
    return end["rss_mib"] - base["rss_mib"], end["fds"] - base["fds"]


def plot(samples: list[dict], path: str) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(8, 3.5))
    x = [s["batches"] for s in samples]
    ax.plot(x, [s["rss_mib"] for s in samples], label="RSS (MiB)")
    ax.set_xlabel("batches")
    ax.set_ylabel("RSS (MiB)")
    ax2 = ax.twinx()
    ax2.plot(x, [s["fds"] for s in samples], color="tab:orange", label="open fds")
    ax2.set_ylabel("open file descriptors")
    # Axes at least ±5 around the data: a flat line should look flat.
    rss = [s["rss_mib"] for s in samples]
    fds = [s["fds"] for s in samples]
    ax.set_ylim(min(rss) - 5, max(rss) + 5)
    ax2.set_ylim(min(fds) - 5, max(fds) + 5)
    fig.legend(loc="upper right", bbox_to_anchor=(0.85, 0.85))
    ax.set_title("dpex soak: trainer memory and file descriptors")
    fig.tight_layout()
    fig.savefig(path, dpi=110)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--batches", type=int, default=1_000_000)
    p.add_argument("--workers", type=int, default=2)
    p.add_argument("--iterable", action="store_true",
                   help="an endless IterableDataset instead of a map-style dataset")
    p.add_argument("--every", type=float, default=5.0, help="seconds between samples")
    p.add_argument("--json", default=None)
    p.add_argument("--plot", default=None)
    p.add_argument("--rss-slack-mb", type=float, default=20.0)
    p.add_argument("--fd-slack", type=int, default=0)
    args = p.parse_args()
    samples = soak(args.batches, args.every, args.workers, args.iterable)
    rss, fds = growth(samples)
    print("\n| batches | seconds | batches/s | RSS start (MiB) | RSS end (MiB) | fds start | "
          "fds end |\n|---:|---:|---:|---:|---:|---:|---:|")
    first, last = samples[len(samples) // 4], samples[-1]
    print(f"| {last['batches']:,} | {last['t']:.0f} | {last['batches'] / last['t']:.0f} | "
          f"{first['rss_mib']:.1f} | {last['rss_mib']:.1f} | {first['fds']} | {last['fds']} |")
    print(f"\ngrowth after warm-up: RSS {rss:+.1f} MiB, fds {fds:+d}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"samples": samples, "rss_growth_mib": rss, "fd_growth": fds}, f)
    if args.plot:
        plot(samples, args.plot)
    sys.exit(0 if rss <= args.rss_slack_mb and fds <= args.fd_slack else 1)


if __name__ == "__main__":
    main()
