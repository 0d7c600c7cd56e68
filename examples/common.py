"""Datasets and the model the examples and ``scripts/accuracy_parity.py`` share.

- ``load_images(data_dir)``: scikit-learn's bundled 8×8 digits (no download) by
  default, or FashionMNIST read straight from its IDX files in ``data_dir``.
- ``ImageSet``: a map-style dataset over those arrays with an optional random
  shift (drawn from torch's RNG, so the worker seeds decide it: the same seeds
  give the same augmented batches in torch's and dpex's workers).
- ``SmallCNN``: two convolutions and a linear layer; fits 8×8 and 28×28 inputs.

Ray workers cannot import this file by name; the scripts ship it by value with
``cloudpickle.register_pickle_by_value``.
"""

from __future__ import annotations

import gzip
import os
import struct

import numpy as np
import torch
import torch.nn as nn
from torch.utils.data import Dataset

__all__ = ["load_images", "read_idx", "ImageSet", "SmallCNN", "pick_device", "evaluate", "example_args"]

_FASHION = {
    "train": ("train-images-idx3-ubyte", "train-labels-idx1-ubyte"),
    "test": ("t10k-images-idx3-ubyte", "t10k-labels-idx1-ubyte"),
}
_IDX_TYPES = {0x08: np.uint8, 0x09: np.int8, 0x0B: ">i2", 0x0C: ">i4", 0x0D: ">f4", 0x0E: ">f8"}


def read_idx(path: str) -> np.ndarray:
    """An IDX file (MNIST's format; ``.gz`` or plain) as a NumPy array.

    Header: two zero bytes, a type code, the number of dimensions, then one
    big-endian uint32 per dimension; the data follow, big-endian.
    """
    opener = gzip.open if path.endswith(".gz") else open
    with opener(path, "rb") as f:
        raw = f.read()
    zero, code, ndim = struct.unpack(">HBB", raw[:4])
    if zero != 0 or code not in _IDX_TYPES:
        raise ValueError(f"{path}: not an IDX file (magic {raw[:4].hex()})")
    shape = struct.unpack(f">{ndim}I", raw[4:4 + 4 * ndim])
    data = np.frombuffer(raw, dtype=_IDX_TYPES[code], offset=4 + 4 * ndim)
    if data.size != int(np.prod(shape)):
        raise ValueError(f"{path}: header says {shape}, file holds {data.size} values")
    return data.reshape(shape)


def _find(data_dir: str, name: str) -> str:
    for candidate in (name, name + ".gz"):
        for sub in ("", "FashionMNIST/raw", "raw"):
            path = os.path.join(data_dir, sub, candidate)
            if os.path.exists(path):
                return path
    raise FileNotFoundError(f"{name}[.gz] not found under {data_dir}")


def load_images(data_dir: str | None = None) -> dict[str, tuple[np.ndarray, np.ndarray]]:
    """``{"train": (images, labels), "test": (...)}``; images float32 N×1×H×W in [0, 1].

    ``data_dir=None``: scikit-learn's digits (1,797 images, the first 80 % for
    training). Otherwise FashionMNIST's four IDX files in ``data_dir``.
    """
    if data_dir is None:
        from sklearn.datasets import load_digits

        digits = load_digits()
        images = (digits.images / 16.0).astype(np.float32)[:, None]
        labels = digits.target.astype(np.int64)
        cut = int(len(images) * 0.8)
        return {"train": (images[:cut], labels[:cut]), "test": (images[cut:], labels[cut:])}
    out = {}
    for split, (img_name, lbl_name) in _FASHION.items():
        images = read_idx(_find(data_dir, img_name)).astype(np.float32)[:, None] / 255.0
        labels = read_idx(_find(data_dir, lbl_name)).astype(np.int64)
        out[split] = (images, labels)
    return out


class ImageSet(Dataset):
    """Images and labels; with ``shift > 0`` each image moves by up to ``shift`` pixels."""

    def __init__(self, images: np.ndarray, labels: np.ndarray, shift: int = 0) -> None:
        self.images, self.labels, self.shift = images, labels, shift

    def __len__(self) -> int:
        return len(self.images)

    def __getitem__(self, i: int) -> tuple[torch.Tensor, int]:
        image = torch.from_numpy(self.images[i])
        if self.shift:
            dy, dx = torch.randint(-self.shift, self.shift + 1, (2,)).tolist()
            image = torch.roll(image, shifts=(dy, dx), dims=(1, 2))
        return image, int(self.labels[i])


class SmallCNN(nn.Module):
    def __init__(self, classes: int = 10) -> None:
        super().__init__()
        self.features = nn.Sequential(
            nn.Conv2d(1, 16, 3, padding=1), nn.ReLU(),
            nn.Conv2d(16, 32, 3, padding=1), nn.ReLU(),
            nn.AdaptiveAvgPool2d(4),
        )
        self.head = nn.Linear(32 * 4 * 4, classes)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.head(self.features(x).flatten(1))


def pick_device() -> torch.device:
    return torch.device("cuda" if torch.cuda.is_available() else "cpu")


@torch.no_grad()
def evaluate(model: nn.Module, images: np.ndarray, labels: np.ndarray,
             device: torch.device) -> tuple[float, float]:
    """Accuracy (%) and mean loss of ``model`` on the whole split, in one pass."""
    model.eval()
    x, y = torch.from_numpy(images).to(device), torch.from_numpy(labels).to(device)
    logits = torch.cat([model(x[i:i + 1000]) for i in range(0, len(x), 1000)])
    loss = nn.functional.cross_entropy(logits, y).item()
    model.train()
    return (logits.argmax(1) == y).float().mean().item() * 100, loss


def example_args(description: str):
    """The command-line options every example takes."""
    import argparse

    p = argparse.ArgumentParser(description=description)
    p.add_argument("--data", default=None,
                   help="folder with FashionMNIST's IDX files (default: scikit-learn's digits)")
    p.add_argument("--epochs", type=int, default=3)
    p.add_argument("--batch-size", type=int, default=100)
    p.add_argument("--lr", type=float, default=0.001)
    p.add_argument("--num-workers", type=int, default=2)
    p.add_argument("--worker-cpus", type=float, default=0.0,
                   help="CPUs each Ray worker reserves (ray_remote_args['num_cpus']; "
                        "default 0: none, as torch's workers)")
    p.add_argument("--head-address", default="auto", help="Ray cluster to join")
    p.add_argument("--torch-loader", action="store_true",
                   help="distribute_mode=False: torch's own worker processes")
    p.add_argument("--max-batches", type=int, default=None,
                   help="stop each epoch after this many batches (quick runs)")
    return p


def train_epochs(model: nn.Module, loader, data: dict, args, device: torch.device,
                 before_epoch=None, log=print) -> float:
    """Adam + cross-entropy over ``args.epochs`` epochs; one progress line per epoch.

    Returns the last training loss.
    """
    import time

    opt = torch.optim.Adam(model.parameters(), lr=args.lr)
    loss_fn = nn.CrossEntropyLoss()
    loss = torch.tensor(float("nan"))
    for epoch in range(args.epochs):
        if before_epoch is not None:
            before_epoch(epoch)
        t0, n = time.perf_counter(), 0
        for n, (images, labels) in enumerate(loader, 1):
            images, labels = images.to(device), labels.to(device)
            loss = loss_fn(model(images), labels)
            opt.zero_grad()
            loss.backward()
            opt.step()
            if n == args.max_batches:
                break
        acc, _ = evaluate(model, *data["test"], device)
        log(f"epoch {epoch + 1}/{args.epochs}: train loss {loss.item():.4f}, "
            f"test accuracy {acc:.2f} %, {n / (time.perf_counter() - t0):.1f} batches/s")
    return loss.item()
