"""What resuming reads of a loader, in one frozen object the loader builds
(``DpexDataLoader._resume_view``): saving and loading a state see these fields and
nothing else of the loader, so they can be tested with any loader's configuration."""

from __future__ import annotations

import dataclasses
import functools
from collections.abc import Callable
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
    measure: Callable[[], int]  # len(loader): asked for only where a state needs it

    @functools.cached_property
    def length(self) -> int | None:
        """Batches per epoch of a map-style loader (None: an IterableDataset, whose
        length is a hint and would make torch warn when the epoch runs longer, or a
        sampler with no length)."""
        if self.iterable:
            return None
        try:
            return self.measure()
        except (TypeError, NotImplementedError):  # (the two ways samplers say "none")
            return None
