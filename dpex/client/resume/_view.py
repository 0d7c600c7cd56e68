"""What resuming reads of a loader, in one frozen object the loader builds
(``DpexDataLoader._resume_view``): saving and loading a state see these fields and
nothing else of the loader, so they can be tested with any loader's configuration."""

from __future__ import annotations

import dataclasses
from typing import Any

import torch

__all__ = ["LoaderView"]


@dataclasses.dataclass(frozen=True)
class LoaderView:
    index_sampler: Any  # torch's (the batch sampler, or the sampler), not dpex's IndexView
    sampler: Any
    batch_sampler: Any
    generator: torch.Generator | None  # the loader's (its iterators' base seeds)
    dataset: Any
    iterable: bool  # an IterableDataset
    num_workers: int
    distributed: bool  # dpex's workers (distribute_mode=True, num_workers > 0)
    persistent: bool  # persistent workers (num_workers > 0)
    in_order: bool
    batch_size: int | None
    drop_last: bool
    length: int | None  # batches per epoch of a map-style loader (None: unknown)
