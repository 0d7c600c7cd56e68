"""dpex demo: the same augmented image batches from torch's DataLoader and from dpex.

Streams a synthetic image-augmentation dataset (decode-like noise, random crop,
flip, normalise) through ``torch.utils.data.DataLoader`` and through
``DpexDataLoader(distribute_mode=True)`` on the embedded local Ray instance, with
the same arguments and seed, checks the batches are identical, and prints
batches/s for both. Run it with ``scripts/demo.sh`` (which installs everything).
"""

from __future__ import annotations

import argparse
import time

import torch
from torch.utils.data import DataLoader, Dataset
from tqdm import tqdm

from dpex import DpexDataLoader
from dpex._ray_connect import connect_ray


class AugmentedImages(Dataset):
    """Item i: a seeded 3×H×W uint8 'photo', randomly cropped, flipped and normalised."""

    def __init__(self, n: int, size: int = 160, crop: int = 128) -> None:
        self.n, self.size, self.crop = n, size, crop

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        img = torch.randint(0, 256, (3, self.size, self.size), dtype=torch.uint8, generator=g)
        # The augmentation draws from the worker's seeded RNG, as torchvision's do.
        top, left = torch.randint(0, self.size - self.crop + 1, (2,)).tolist()
        img = img[:, top:top + self.crop, left:left + self.crop]
        if torch.rand(1).item() < 0.5:
            img = img.flip(-1)
        x = img.float().div_(255)
        x = (x - x.mean((1, 2), keepdim=True)) / (x.std((1, 2), keepdim=True) + 1e-6)
        return x, i % 10


def run(name: str, loader: DataLoader, epochs: int) -> tuple[list[float], list[torch.Tensor]]:
    """Iterate ``epochs`` epochs; return batches/s per epoch and a checksum per batch."""
    rates, sums = [], []
    for epoch in range(epochs):
        t0 = time.perf_counter()
        # disable=None: a live bar on a terminal, none in a CI log (the line below stays).
        for x, y in tqdm(loader, desc=f"{name:>5} epoch {epoch + 1}", unit="batch",
                         leave=False, disable=None):
            sums.append(x.double().sum() + y.sum())
        took = time.perf_counter() - t0
        rates.append(len(loader) / took)
        stall = ""
        if isinstance(loader, DpexDataLoader):  # how much of the epoch the loop waited
            stall = f", waited for data {100 * loader.stats()['data_wait_share']:.0f} % of it"
        print(f"{name:>5} epoch {epoch + 1}: {len(loader)} batches in {took:.1f} s "
              f"({rates[-1]:.1f} batches/s{stall})", flush=True)
    return rates, sums


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=6400)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=2)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    t0 = time.perf_counter()
    connect_ray("auto")  # what DpexDataLoader does on first use; timed apart from the loaders
    print(f"Ray ready in {time.perf_counter() - t0:.1f} s (embedded local instance unless "
          "RAY_ADDRESS or a `ray start` cluster is found)")

    dataset = AugmentedImages(args.items)
    common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                  persistent_workers=True)
    results = {}
    for name, make in (
        ("torch", lambda g: DataLoader(dataset, generator=g, multiprocessing_context="forkserver",
                                       **common)),
        ("dpex", lambda g: DpexDataLoader(dataset, generator=g, distribute_mode=True, **common)),
    ):
        loader = make(torch.Generator().manual_seed(args.seed))
        results[name] = run(name, loader, args.epochs)
        if isinstance(loader, DpexDataLoader):
            loader.close()
        del loader

    same = all(torch.equal(a, b) for a, b in zip(*(r[1] for r in results.values()), strict=True))
    n_batches = len(results["torch"][1]) // args.epochs
    print(f"\n{args.items} items, batch {args.batch_size}, {args.workers} workers, "
          f"{n_batches} batches per epoch, persistent workers\n")
    print("| loader | " + " | ".join(f"epoch {e + 1} batches/s" for e in range(args.epochs)) + " |")
    print("|---|" + "---:|" * args.epochs)
    for name, (rates, _) in results.items():
        print(f"| {name} | " + " | ".join(f"{r:.1f}" for r in rates) + " |")
    print(f"\nbatches identical to torch's: {'yes' if same else 'NO'}")
    print("(epoch 1 includes starting the workers; these 2 cores run both the workers and "
          "the trainer, so dpex's gain shows when the workers live on other machines)")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
