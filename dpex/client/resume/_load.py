"""Loading: ``load_state_dict()`` checks a saved state against the loader and keeps it
(:func:`loaded`) for its next iterator, which replays it, as torchdata's
``next_iter_state``; :func:`replaying` and :func:`starting` put the generators where
the saved run had them when that iterator is made."""

from __future__ import annotations

import contextlib
import dataclasses
import logging
from collections.abc import Callable, Iterator
from typing import Any

import torch
from torch.utils.data import IterDataPipe

from dpex.client.resume._identity import check_identity, identity
from dpex.client.resume._replay import distributed_layout, sampler_generator, stateful
from dpex.client.resume._reshard import Layout
from dpex.client.resume._save import ranks, source
from dpex.client.resume._state import ResumeState
from dpex.client.resume._view import LoaderView
from dpex.errors import ResumeStateError, UnsupportedError

__all__ = ["loaded", "replaying", "starting"]

logger = logging.getLogger("dpex")


def _describe(source: str) -> str:
    return "a generator" if source == "generator" else "torch's global RNG (no generator)"


def _check_fits(view: LoaderView, state: ResumeState, reshard: bool) -> None:
    """The state is this loader's: the same sampler, batching, length and RNG sources."""
    check_identity(state.identity, identity(view), reshard=reshard)
    if state.length is not None and view.length is not None and state.length != view.length \
            and not reshard:
        raise ResumeStateError(
            f"the saved loader had {state.length} batches per epoch, this one has "
            f"{view.length}: the dataset, sampler, batch_size or drop_last differ, so the "
            "saved position means nothing here")
    drawn_from = sampler_generator(view.index_sampler)
    for what, saved, ours in (("sampler", state.rng_source, source(drawn_from)),
                              ("loader", state.base_rng_source, source(view.generator))):
        if saved != ours:
            raise ResumeStateError(
                f"the saved {what} drew from {_describe(saved)}, this one draws from "
                f"{_describe(ours)}: pass the same generator= arguments as the run that "
                "saved the state")


def _check_shards(view: LoaderView, state: ResumeState) -> None:
    """An IterableDataset's mid-epoch position lives where it was taken: in the trainer
    (num_workers=0), or in each of that many dpex workers' shards."""
    shards = state.iterable
    if not state.mid_epoch or shards is None:
        return
    if "trainer" in shards:
        if view.num_workers != 0:
            raise ResumeStateError(
                "this state was taken in the middle of an epoch of an IterableDataset with "
                "num_workers=0: the position is that of the dataset's one iterator in the "
                f"trainer, so it resumes with num_workers=0 only (this loader has "
                f"{view.num_workers})")
        return
    if shards.get("unknown") or not view.distributed:
        by = " by torch's own loader" if shards.get("unknown") else ""
        raise UnsupportedError(
            f"this state was taken in the middle of an epoch of an IterableDataset{by}; "
            "such a position lives in dpex's workers (each one's shard): take it and "
            "resume it with distribute_mode=True and num_workers > 0, or take the "
            "checkpoint between epochs")
    if view.num_workers != state.worker_rng_num_workers:
        raise ResumeStateError(
            f"this state was taken in the middle of an epoch of an IterableDataset with "
            f"num_workers={state.worker_rng_num_workers}; its shards are per worker, "
            f"so it resumes with that many workers only (this loader has "
            f"{view.num_workers})")


def _worker_rng(state: ResumeState, rest: Layout | None) -> dict | None:
    """The saved workers' RNG states, where they belong to the batches this rank makes."""
    if rest is not None:
        return None  # other batches than the saved run's workers made
    rank = ranks()[1]
    if state.worker_rng is not None and state.rank != rank:
        # Another rank's workers (a framework that saves rank 0's state only): their RNG
        # states belong to other batches; this rank's workers start from their seeds.
        logger.warning("dpex: this loader state was taken on rank %s, this is rank %s: its "
                       "workers' RNG states are not used (the batches' order is)",
                       state.rank, rank)
        return None
    return state.worker_rng


def _set_generators(view: LoaderView, state: ResumeState) -> None:
    """Between epochs: the next epoch draws from the generators as they were."""
    drawn_from = sampler_generator(view.index_sampler)
    if drawn_from is not None:
        drawn_from.set_state(state.sampler_rng)
    if view.generator is not None and view.generator is not drawn_from:
        view.generator.set_state(state.base_rng)
    own = stateful(view.index_sampler)
    if own is not None and state.sampler_state is not None:
        own.load_state_dict(state.sampler_state)


def loaded(view: LoaderView, plain: Any) -> ResumeState | None:
    """Check ``plain`` (what ``state_dict()`` returned) against the loader; apply what
    takes effect at once (at an epoch boundary, the generators' states); return the
    state the next iterator takes (None: nothing left to replay): the saved one, with
    the workers' RNG states only where they belong to this rank's batches, torch's
    global RNG only between epochs, and (another rank count) the rest of the epoch."""
    state = ResumeState.from_dict(plain)
    rest, reshard = _rest_of_epoch(view, state)
    _check_fits(view, state, reshard)
    _check_shards(view, state)
    if not state.mid_epoch:
        _set_generators(view, state)
        if state.iterator_rng is None and state.dataset is None and state.global_rng is None:
            return None
    return dataclasses.replace(state, worker_rng=_worker_rng(state, rest), rest=rest,
                               global_rng=None if state.mid_epoch else state.global_rng)


def _rest_of_epoch(view: LoaderView, state: ResumeState) -> tuple[Layout | None, bool]:
    """(The rest of the saved epoch where this loader deals it otherwise, whether the
    saved and this loader both deal by torch's DistributedSampler): a state taken by
    R ranks resumes on R' (or with another batch size) exactly. Another rank count
    with any other sampler, or an IterableDataset, is refused by name mid-epoch."""
    ours = distributed_layout(view.index_sampler)
    saved = Layout.from_state(state.layout) if state.layout else None
    reshard = ours is not None and saved is not None
    world, saved_world = ranks()[0], state.world_size
    if state.mid_epoch and world != saved_world and not reshard:
        what = ("an IterableDataset's position lives in each rank's own shard"
                if view.iterable else
                f"its sampler ({type(view.sampler).__name__}) does not say which samples "
                "the other ranks took")
        raise UnsupportedError(
            f"this state was taken in the middle of an epoch by a job of {saved_world} "
            f"ranks, and this job has {world}: {what}. dpex resumes on another number "
            "of ranks a map-style dataset with torch's DistributedSampler (shuffle or not, "
            "drop_last or not; Lightning's use_distributed_sampler gives one); otherwise "
            "resume on the same number of ranks, or take the checkpoint between epochs")
    if not state.mid_epoch or not reshard:
        return None, reshard
    assert ours is not None and saved is not None
    if (saved.start, saved.end, saved.num_replicas, saved.batch_size) == (
            0, ours.end, ours.num_replicas, ours.batch_size):
        return None, reshard  # the same dealing: replayed as the saved run drew it
    return saved.rest(state.yielded, ours.num_replicas, ours.batch_size), reshard


def starting(resume: ResumeState | None, generator: torch.Generator | None) -> torch.Tensor:
    """Right before an iterator is made: the RNG state its base seed is drawn from (the
    saved one when resuming). A state taken between epochs, when the next epoch draws
    its order or base seed from torch's global RNG, sets that RNG as the saved run had it."""
    if resume is not None and resume.global_rng is not None:
        torch.set_rng_state(resume.global_rng)
    if resume is not None and resume.iterator_rng is not None:
        return resume.iterator_rng
    return generator.get_state() if generator is not None else torch.get_rng_state()


@contextlib.contextmanager
def replaying(view: LoaderView, resume: ResumeState | None,
              set_generator: Callable[[torch.Generator | None], None]) -> Iterator[None]:
    """While an iterator is made: its base seed drawn from the saved state, from a
    copy of the loader's generator at that state (``set_generator`` puts it in the
    loader's place; with no generator, a copy of torch's global RNG at that state: the
    global RNG itself then moves as the uninterrupted run's iterator moved it when it
    was made in the resumed epoch, by its seed draws, before a dataset's own state is
    loaded)."""
    if resume is None or resume.iterator_rng is None:
        yield
        return
    generator = view.generator
    if generator is None and resume.mid_epoch and resume.epochs_before == 0:
        # (the uninterrupted run made this iterator in this epoch: a persistent one's
        # later epochs, or the next one after a state between epochs, drew nothing)
        for _ in range(1 + isinstance(view.dataset, IterDataPipe)):  # base (+ shared) seed
            torch.empty((), dtype=torch.int64).random_()
    copy = torch.Generator()
    copy.set_state(resume.iterator_rng)
    set_generator(copy)
    try:
        yield
    finally:
        set_generator(generator)
        if generator is not None and generator is not sampler_generator(view.index_sampler):
            generator.set_state(copy.get_state())  # it serves base seeds alone: advance it
