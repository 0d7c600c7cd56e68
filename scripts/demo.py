"""dpex demo: the same augmented image batches from torch's DataLoader and from dpex.

Streams a synthetic image-augmentation dataset (decode-like noise, random crop,
flip, normalise) through ``torch.utils.data.DataLoader`` and through
``DpexDataLoader(distribute_mode=True)`` on the embedded local Ray instance, with
the same arguments and seed, epochs alternating between the loaders; checks the
batches are identical, and prints batches/s and this node's CPU per batch for
both. A third loader, dpex-remote, takes its batches over the socket, as from
workers on other nodes: its CPU per batch is what this node would spend on data
if the workers ran elsewhere. Run it with ``scripts/demo.sh`` (which installs
everything).
"""

from __future__ import annotations

import argparse
import os
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


def _cpu_s(pids: list[int]) -> float:
    """CPU seconds (user + system) the processes ``pids`` have used so far."""
    tick, total = os.sysconf("SC_CLK_TCK"), 0.0
    for pid in pids:
        try:
            with open(f"/proc/{pid}/stat") as f:
                fields = f.read().rsplit(")", 1)[1].split()
        except OSError:  # gone
            continue
        total += (int(fields[11]) + int(fields[12])) / tick
    return total


def node_cpu_pids(loader: DataLoader) -> list[int]:
    """What preprocessing costs this node: torch's loader runs its workers here (their
    CPU counts); dpex's workers could run on any node, so only this process counts."""
    it = loader._iterator
    workers = [] if isinstance(loader, DpexDataLoader) or it is None else it._workers
    return [os.getpid(), *(w.pid for w in workers)]


def one_epoch(name: str, loader: DataLoader, epoch: int, out: dict) -> None:
    """Iterate one epoch; record batches/s, the CPU this node spends per batch on data
    (the process, and torch's workers, outside the loop's own work) and a checksum per
    batch (the batches are compared after the run)."""
    t0, cpu0 = time.perf_counter(), None
    n, body_cpu = 0, 0.0
    # disable=None: a live bar on a terminal, none in a CI log (the line below stays).
    for x, y in tqdm(loader, desc=f"{name:>11} epoch {epoch + 1}", unit="batch",
                     leave=False, disable=None):
        if cpu0 is None:  # torch's workers exist once the epoch has started
            pids, cpu0 = node_cpu_pids(loader), _cpu_s(node_cpu_pids(loader))
        body0 = time.process_time()  # the loop's own work is not the loader's
        out["sums"].append(x.double().sum() + y.sum())
        body_cpu += time.process_time() - body0
        n += 1
    took = time.perf_counter() - t0
    out["rates"].append(n / took)
    out["cpu_ms"].append((_cpu_s(pids) - cpu0 - body_cpu) / max(1, n - 1) * 1e3)
    stall = ""
    if isinstance(loader, DpexDataLoader):  # how much of the epoch the loop waited
        stall = f", waited for data {100 * loader.stats()['data_wait_share']:.0f} % of it"
    print(f"{name:>11} epoch {epoch + 1}: {n} batches in {took:.1f} s "
          f"({out['rates'][-1]:.1f} batches/s, this node's CPU for data "
          f"{out['cpu_ms'][-1]:.1f} ms/batch{stall})", flush=True)


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--items", type=int, default=6400)
    ap.add_argument("--batch-size", type=int, default=32)
    ap.add_argument("--workers", type=int, default=2)
    ap.add_argument("--epochs", type=int, default=3)
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args()

    t0 = time.perf_counter()
    connect_ray("auto")  # what DpexDataLoader does on first use; timed apart from the loaders
    print(f"Ray ready in {time.perf_counter() - t0:.1f} s (embedded local instance unless "
          "RAY_ADDRESS or a `ray start` cluster is found)")

    dataset = AugmentedImages(args.items)
    common = dict(batch_size=args.batch_size, shuffle=True, num_workers=args.workers,
                  persistent_workers=True)
    loaders = {
        "torch": DataLoader(dataset, generator=torch.Generator().manual_seed(args.seed),
                            multiprocessing_context="forkserver", **common),
        "dpex": DpexDataLoader(dataset, generator=torch.Generator().manual_seed(args.seed),
                               distribute_mode=True, **common),
        # The path of workers on other nodes (no shared memory with this process): what
        # this node would spend per batch if the workers ran elsewhere.
        "dpex-remote": DpexDataLoader(dataset, distribute_mode=True, shm_ring_bytes=0,
                                      generator=torch.Generator().manual_seed(args.seed),
                                      **common),
    }
    results = {name: {"rates": [], "cpu_ms": [], "sums": []} for name in loaders}
    try:
        # Epochs alternate between the loaders (torch, dpex, ..., then the reverse), so
        # that what else this machine does hits both alike.
        for epoch in range(args.epochs):
            order = list(loaders) if epoch % 2 == 0 else list(loaders)[::-1]
            for name in order:
                one_epoch(name, loaders[name], epoch, results[name])
    finally:
        for loader in loaders.values():
            if isinstance(loader, DpexDataLoader):
                loader.close()
    same = all(torch.equal(a, b) for name in ("dpex", "dpex-remote")
               for a, b in zip(results["torch"]["sums"], results[name]["sums"], strict=True))
    n_batches = len(results["torch"]["sums"]) // args.epochs
    print(f"\n{args.items} items, batch {args.batch_size}, {args.workers} workers, "
          f"{n_batches} batches per epoch, persistent workers; epochs alternate between "
          "the loaders\n")
    print("| loader | " + " | ".join(f"epoch {e + 1} batches/s" for e in range(args.epochs))
          + " | CPU for data on the training node, ms/batch (last epoch) * |")
    print("|---|" + "---:|" * (args.epochs + 1))
    for name, r in results.items():
        print(f"| {name} | " + " | ".join(f"{x:.1f}" for x in r["rates"])
              + f" | {r['cpu_ms'][-1]:.1f} |")
    print("* the training process outside the loop's own work, plus torch's workers, which "
          "must run there; dpex's workers may run on any node and are not counted")
    print(f"\nbatches identical to torch's: {'yes' if same else 'NO'}")
    later = range(1, args.epochs)
    ahead = [results["dpex"]["rates"][e] / results["torch"]["rates"][e] for e in later]
    if ahead:
        print("dpex vs torch after the first epoch (same workers, this node): "
              + ", ".join(f"{r:.2f}x" for r in ahead))
    torch_ms, remote_ms = results["torch"]["cpu_ms"][-1], results["dpex-remote"]["cpu_ms"][-1]
    print(f"With the workers on other nodes, this node would spend {remote_ms:.1f} ms of CPU "
          f"per batch on data instead of torch's {torch_ms:.1f} ms (its workers included; "
          "measured above, the loop's own work left out: dpex-remote takes its batches as "
          f"remote workers send them), {torch_ms / remote_ms:.1f}x less, and those cores "
          "go to training instead.")
    if not same:
        raise SystemExit(1)


if __name__ == "__main__":
    main()
