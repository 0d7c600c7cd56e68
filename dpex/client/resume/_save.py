"""Saving: what ``state_dict()`` records of a loader and its current iterator.

Pure: from the loader's :class:`~dpex.client.resume._view.LoaderView`, the iterator's
:class:`~dpex.client.resume._position.IteratorPosition` and a loaded state no
iterator has taken yet, :func:`capture` builds the
:class:`~dpex.client.resume._state.ResumeState`. The one thing it cannot compute, dpex's
workers' RNG states, :class:`Saving` asks for only when the full state is wanted.
"""

from __future__ import annotations

import dataclasses
import logging
import weakref
from typing import Any

import torch

from dpex.client.resume._identity import identity, sampler_epoch
from dpex.client.resume._position import IteratorPosition
from dpex.client.resume._replay import distributed_layout, rng_state, sampler_generator, stateful
from dpex.client.resume._state import ResumeState
from dpex.client.resume._trainer import trainer_states
from dpex.client.resume._view import LoaderView
from dpex.errors import DpexTimeoutError, UnsupportedError

__all__ = ["Saving", "capture", "mid_epoch_state", "ranks", "source"]

logger = logging.getLogger("dpex")


def source(generator: torch.Generator | None) -> str:
    return "generator" if generator is not None else "global"


def ranks() -> tuple[int, int]:
    """(This job's number of ranks, this process's rank): torch.distributed's, else (1, 0)."""
    dist = torch.distributed
    if dist.is_available() and dist.is_initialized():
        return dist.get_world_size(), dist.get_rank()
    return 1, 0


@dataclasses.dataclass
class Saving:
    """Where a loader stood, taken cheaply (a framework may take one per batch); dpex's
    workers' RNG states are asked for only by :meth:`state`."""

    partial: ResumeState  # the state, but for the workers' RNG states
    workers: weakref.ref | None = None  # the dpex iterator to ask them of (not kept)
    asked: dict[int, tuple[int, int]] | None = None  # worker -> its last batch taken

    def resume_state(self, limit: float | None = None) -> ResumeState:
        """The full state. (An iterator gone since has no workers to ask: its resumed
        workers start from their seeds.) ``limit``: how long the workers may take to
        answer, if not the default."""
        state = dataclasses.replace(self.partial)
        workers = self.workers() if self.workers is not None else None
        if self.asked is not None and workers is not None:
            state.worker_rng = workers.worker_rng_states(self.asked, limit)
        # (between epochs a worker's dataset state is the one after its last batch,
        # before its shard's end ran)
        return state.between_epochs()

    def state(self, limit: float | None = None) -> dict:
        """``state_dict()``: the full state as plain data."""
        return self.resume_state(limit).to_dict()


def _new_state(view: LoaderView) -> ResumeState:
    world_size, rank = ranks()
    return ResumeState(
        rng_source=source(sampler_generator(view.index_sampler)),
        base_rng_source=source(view.generator),
        num_workers=int(view.num_workers),  # (plain data: an Autoscale is an int)
        rank=rank, world_size=world_size, identity=identity(view), length=view.length,
        sampler_epoch=sampler_epoch(view.sampler))


def _boundary(view: LoaderView, state: ResumeState, fetcher: Any) -> ResumeState:
    """At an epoch boundary: what the next epoch draws its order and base seed from
    (taken only here: a framework may capture a position per batch)."""
    drawn_from = sampler_generator(view.index_sampler)
    own = stateful(view.index_sampler)
    state.sampler_rng = rng_state(drawn_from)
    state.base_rng = None if view.generator is None else view.generator.get_state()
    state.sampler_state = own.state_dict() if own else None
    if drawn_from is None or view.generator is None:
        state.global_rng = torch.get_rng_state()
    if view.num_workers == 0:  # the dataset runs here (torch's single process)
        _set(state, trainer_states(view, fetcher, mid_epoch=False))
    return state


def _set(state: ResumeState, values: dict) -> None:
    for name, value in values.items():
        setattr(state, name, value)


# What a loaded state no iterator has taken yet takes from the loader that holds it
# (its own sampler, rank and worker count), not from the run that saved it.
_THE_LOADERS = ("rng_source", "base_rng_source", "num_workers", "rank", "world_size",
                "identity", "length", "sampler_epoch")


def _pending(view: LoaderView, pending: ResumeState) -> ResumeState:
    """Still where a loaded state left off (no iterator has drawn from it): that state,
    as this loader says it (mid-epoch, the layout it deals the rest by), as torchdata's
    ``state_dict()`` gives back its ``next_iter_state``."""
    ours = _new_state(view)
    mine = {name: getattr(ours, name) for name in _THE_LOADERS}
    if not pending.mid_epoch:
        return dataclasses.replace(pending, **mine, rest=None)
    layout = pending.rest or distributed_layout(view.index_sampler)
    return dataclasses.replace(pending, **mine, rest=None,
                               layout=layout.to_state() if layout is not None else None)


def _mid_epoch(view: LoaderView, state: ResumeState, position: IteratorPosition) -> None:
    """In the middle of an epoch: where its draws and (IterableDataset) shards stand."""
    if not view.in_order and view.num_workers > 0:
        raise UnsupportedError(
            "state_dict() in the middle of an epoch of a loader with in_order=False: the "
            "batches taken so far are not the epoch's first ones, so no position resumes "
            "it exactly; use in_order=True (torch's default) to checkpoint mid-epoch, or "
            "take the state between epochs")
    fetcher, drawing = position.fetcher, position.drawing
    assert drawing is not None
    if view.num_workers == 0:  # the dataset's own states, or (iterable) how far it went
        _set(state, trainer_states(view, fetcher, mid_epoch=True))
        if view.iterable:
            state.iterable = {"trainer": {"ended": bool(getattr(fetcher, "ended", False))}}
    elif view.iterable:  # the position is in the workers' shards; torch's cannot tell it
        workers = position.workers
        state.iterable = workers.shard_positions() if workers is not None else {"unknown": True}
    # not drawn yet: the first draw will find the generator as it is now
    draw_rng = drawing.draw_rng if drawing.draw_rng is not None else rng_state(
        sampler_generator(view.index_sampler))
    _set(state, {"mid_epoch": True, "yielded": position.yielded,
                 "drawn": drawing.draw_rng is not None, "sampler_rng": drawing.iter_rng,
                 "layout": drawing.layout.to_state() if drawing.layout is not None else None,
                 "sampler_draw_rng": draw_rng,
                 "sampler_state": drawing.sampler_state_at(position.yielded)})


def capture(view: LoaderView, position: IteratorPosition | None,
            pending: ResumeState | None) -> Saving:
    """Where the loader's current iterator (at ``position``, or None) stands in its
    epoch; ``pending``: a loaded state no iterator has taken yet."""
    state = _new_state(view)
    drawing = position.drawing if position is not None else None
    fetcher = position.fetcher if position is not None else None
    if drawing is not None and drawing.resume is not None:
        pending = drawing.resume  # an iterator made since, that has not drawn yet
    if pending is not None:
        return Saving(_pending(view, pending))
    if position is None or drawing is None:
        return Saving(_boundary(view, state, fetcher))  # the next epoch starts anew
    ended = position.ended or (  # (an IterableDataset's length is a hint)
        not view.iterable and view.length is not None and position.yielded >= view.length)
    if ended and not view.persistent:
        return Saving(_boundary(view, state, fetcher))  # a new iterator, from generators now
    state.iterator_rng = position.iterator_rng  # its base seed, drawn again
    # (a persistent iterator's next epoch is its base seed's next one)
    state.epochs_before = max(0, position.epochs_served - (not ended))
    saving = Saving(_boundary(view, state, fetcher) if ended else state)
    workers = position.workers
    if workers is not None:
        state.worker_rng_num_workers = workers.rng_worker_count
        saving.workers = weakref.ref(workers)
        saving.asked = workers.resume_points(mid_epoch=not ended)
    if not ended:
        _mid_epoch(view, state, position)
    return saving


def mid_epoch_state(view: LoaderView, position: IteratorPosition, ask_workers: bool,
                    limit: float | None = None) -> ResumeState | None:
    """The state at ``position`` if its iterator ends in the middle of an epoch, else
    None: with its workers' RNG and dataset states where they can be asked for (within
    ``limit`` s) before they stop; else its resumed workers start from their seeds."""
    saving = capture(view, position, None)
    if not saving.partial.mid_epoch:
        return None
    if ask_workers and saving.asked:
        try:
            return saving.resume_state(limit=limit)
        except DpexTimeoutError:
            pass
    if saving.asked:
        saving.workers = None
        logger.info("dpex: an iterator was dropped in the middle of an epoch; "
                    "state_dict() keeps its position, without its workers' RNG states "
                    "(take state_dict() before leaving the loop to keep them)")
    return saving.resume_state()
