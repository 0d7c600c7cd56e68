"""The position every iterator reports, and the one adapter that reads it off torch's.

Saving a state needs the same few facts of any iterator: its epoch's draws, how many
batches it yielded, whether its epoch ended, the RNG state its base seed came from,
and (where the dataset runs in the trainer) torch's fetcher, or (dpex's workers) who
to ask for the workers' states. :class:`IteratorPosition` declares them. dpex's
iterator reports its own (``RayDataLoaderIter.position``); for torch's iterators
(``distribute_mode=False``, and ``num_workers=0``) :func:`position_of` is the only
reader of their private attributes (``_sampler_iter``, ``_num_yielded``,
``_dataset_fetcher``). With a position in hand, saving is pure (``_save.capture``).
"""

from __future__ import annotations

import dataclasses
from typing import Any, Protocol

import torch

from dpex.client.resume._replay import Drawing

__all__ = ["IteratorPosition", "WorkerStates", "fetcher_of", "position_of"]


class WorkerStates(Protocol):
    """What ``state_dict()`` asks of dpex's workers (``RayDataLoaderIter`` has it)."""

    rng_worker_count: int  # the worker count their RNG states belong to (0: changed)

    def resume_points(self, mid_epoch: bool) -> dict[int, tuple[int, int]]: ...

    def shard_positions(self) -> dict: ...

    def worker_rng_states(self, asked: dict[int, tuple[int, int]],
                          limit: float | None = None) -> dict[int, dict | None] | None: ...


@dataclasses.dataclass(frozen=True)
class IteratorPosition:
    """Where an iterator stands in its epoch."""

    drawing: Drawing | None  # its epoch's draws (None: not drawn through dpex's IndexView)
    yielded: int  # batches of the epoch yielded, a resumed run's passed-over ones included
    ended: bool  # its epoch ended: the next state is between epochs
    iterator_rng: torch.Tensor | None  # the RNG state its base seed was drawn from
    epochs_served: int = 0  # epochs begun with its base seed, a resumed run's included
    fetcher: Any = None  # num_workers=0: torch's fetcher (the dataset runs in the trainer)
    workers: WorkerStates | None = None  # dpex's workers, asked for their own states


def fetcher_of(iterator: Any) -> Any:
    """torch's single-process iterator's fetcher (the dataset in the trainer)."""
    return iterator._dataset_fetcher


def position_of(iterator: Any, iterator_rng: torch.Tensor | None) -> IteratorPosition:
    """The position of ``iterator``: dpex's reports its own; torch's is read here."""
    report = getattr(iterator, "position", None)
    if callable(report):
        return report(iterator_rng)
    drawing = iterator._sampler_iter
    if not isinstance(drawing, Drawing):
        return IteratorPosition(None, iterator._num_yielded, False, iterator_rng)
    fetcher = getattr(iterator, "_dataset_fetcher", None)  # (num_workers=0 only)
    yielded = drawing.yielded_of(iterator._num_yielded)
    ended = drawing.ended_at(yielded) or bool(getattr(fetcher, "ended", False))
    return IteratorPosition(drawing, yielded, ended, iterator_rng, fetcher=fetcher)
