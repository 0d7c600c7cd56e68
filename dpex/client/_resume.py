"""Exact mid-epoch resume: what ``DpexDataLoader.state_dict()`` records and how
``load_state_dict()`` replays it, for torch's loader and dpex's alike.

The sampler runs in the trainer, so the position in an epoch is the number of
index batches already yielded, and the rest of the epoch is what the sampler
draws after them (``_replay``: how each epoch's draws are counted and replayed),
so index batches are exactly an uninterrupted run's whatever ``num_workers`` is.
The iterator's base seed (its workers' seeds) is drawn again from the state it was
drawn from.

The state is plain data (tensors, ints, tuples, dicts): ``torch.load(...,
weights_only=True)`` reads it. Its keys are described in docs/RESUME.md.
"""

from __future__ import annotations

import contextlib
import dataclasses
import logging
import weakref
from collections.abc import Iterator
from typing import Any

import torch
from torch.utils.data import IterDataPipe

from dpex.client._replay import (
    Drawing,
    ResumePlan,
    distributed_layout,
    rng_state,
    sampler_generator,
    stateful,
)
from dpex.client._reshard import Layout
from dpex.client._resume_identity import check_identity, identity, sampler_epoch
from dpex.client._resume_trainer import in_trainer, trainer_states
from dpex.errors import DpexTimeoutError, ResumeStateError, UnsupportedError

__all__ = ["STATE_VERSION", "Position", "capture", "identity", "in_trainer",
           "mid_epoch_state", "plan_from", "replaying"]

logger = logging.getLogger("dpex")
STATE_VERSION = 1
_FORMAT = "dpex.DpexDataLoader"
_ITERABLE = torch.utils.data.dataloader._DatasetKind.Iterable



def _source(generator: torch.Generator | None) -> str:
    return "generator" if generator is not None else "global"


@dataclasses.dataclass
class Position:
    """Where a loader stood, taken cheaply (a framework may take one per batch); the
    dpex workers' RNG states are asked for only by :meth:`state`."""

    partial: dict  # the state, but for the workers' RNG states
    iterator: weakref.ref | None = None  # the dpex iterator to ask them of (not kept)
    asked: dict[int, tuple[int, int]] | None = None  # worker -> its last batch taken

    def state(self, limit: float | None = None) -> dict:
        """The full state (``state_dict()``): plain data. (An iterator gone since has
        no workers to ask: its resumed workers start from their seeds.) ``limit``:
        how long the workers may take to answer, if not the default."""
        state = dict(self.partial)
        iterator = self.iterator() if self.iterator is not None else None
        if self.asked is not None and iterator is not None:
            state["worker_rng"] = iterator.worker_rng_states(self.asked, limit)
        if not state["mid_epoch"] and state["worker_rng"]:
            # Between epochs a worker's dataset state is the one after its last batch,
            # before its shard's end ran (a dataset that counts its epochs counts then):
            # the resumed worker runs what is left of that epoch (nothing) first, as
            # torchdata's workers do.
            state["worker_rng"] = {
                w: {**rng, "finish_epoch": True}
                if rng is not None and {"dataset", "dataset_iter"} & set(rng) else rng
                for w, rng in state["worker_rng"].items()}
        return state


def capture(loader: Any, iterator: Any | None, pending: ResumePlan | None) -> Position:
    """Where ``iterator`` (the loader's current one, or None) stands in its epoch;
    ``pending``: a loaded state no iterator has taken yet."""
    index_sampler = loader._torch_index_sampler
    drawn_from = sampler_generator(index_sampler)
    state: dict[str, Any] = {
        "format": _FORMAT, "version": STATE_VERSION,
        "rng_source": _source(drawn_from), "base_rng_source": _source(loader.generator),
        "num_workers": int(loader.num_workers),  # (plain data: an Autoscale is an int)
        "rank": _rank(), "world_size": _world_size(),
        "identity": identity(loader),
        "length": _length(loader),
        "sampler_epoch": sampler_epoch(loader.sampler),
        "mid_epoch": False, "yielded": 0, "sampler_rng": None, "base_rng": None,
        "sampler_draw_rng": None, "iterator_rng": None, "sampler_state": None,
        "worker_rng": None, "worker_rng_num_workers": 0, "iterable": None,
        "epochs_before": 0, "dataset": None, "dataset_iter": None, "global_rng": None,
        "layout": None,
    }
    in_trainer = loader.num_workers == 0  # the dataset runs here (torch's single process)
    fetcher = getattr(iterator, "_dataset_fetcher", None) if in_trainer else None

    def boundary() -> dict:
        """At an epoch boundary: what the next epoch draws its order and base seed from
        (taken only here: a framework may capture a position per batch)."""
        own = stateful(index_sampler)
        state.update(sampler_rng=rng_state(drawn_from),
                     base_rng=None if loader.generator is None else loader.generator.get_state(),
                     sampler_state=own.state_dict() if own else None)
        if drawn_from is None or loader.generator is None:
            state["global_rng"] = torch.get_rng_state()
        if in_trainer:
            state.update(trainer_states(loader, fetcher, mid_epoch=False))
        return state

    drawing = getattr(iterator, "_sampler_iter", None) if iterator is not None else None
    if isinstance(drawing, Drawing) and drawing.plan is not None:
        pending = drawing.plan  # an iterator made since, that has not drawn yet
    if pending is not None:  # still where the loaded state left off
        loaded = {"iterator_rng": pending.iterator_rng, "worker_rng": pending.worker_rng,
                  "worker_rng_num_workers": pending.worker_rng_num_workers,
                  "epochs_before": pending.epochs_before,
                  "iterable": pending.iterable if pending.armed else None,
                  "dataset": pending.dataset_state, "dataset_iter": pending.dataset_iter_state}
        if not pending.armed:
            boundary().update(loaded)
            if pending.global_rng is not None:
                state["global_rng"] = pending.global_rng
            return Position(state)
        layout = pending.rest or distributed_layout(index_sampler)
        state.update(loaded, mid_epoch=True, yielded=pending.skip,
                     sampler_rng=pending.sampler_rng, sampler_draw_rng=pending.draw_rng,
                     sampler_state=pending.sampler_state,
                     layout=layout.to_state() if layout is not None else None)
        return Position(state)
    if not isinstance(drawing, Drawing):
        return Position(boundary())  # no iterator: the next epoch starts anew
    yielded = iterator._num_yielded + drawing.skipped
    iterable = loader._dataset_kind == _ITERABLE
    finished = (drawing.exhausted and yielded >= drawing.position) or getattr(
        iterator, "epoch_ended", False) or getattr(fetcher, "ended", False) or (
        # (an IterableDataset's length is a hint)
        not iterable and state["length"] is not None and yielded >= state["length"])
    persistent = loader.persistent_workers and loader.num_workers > 0
    if finished and not persistent:
        return Position(boundary())  # the next epoch: a new iterator, from generators now
    state["iterator_rng"] = iterator._dpex_iterator_rng  # its base seed, drawn again
    # (a persistent iterator's next epoch is its base seed's next one)
    state["epochs_before"] = max(0, getattr(iterator, "epochs_served", 0) - (not finished))
    position = Position(boundary() if finished else state)
    dpex_workers = callable(getattr(iterator, "worker_rng_states", None))
    if dpex_workers:
        state["worker_rng_num_workers"] = getattr(iterator, "rng_worker_count",
                                                  loader.num_workers)
        position.iterator = weakref.ref(iterator)
        position.asked = iterator.resume_points(mid_epoch=not finished)
    if finished:
        return position  # a persistent iterator's next epoch: same base seed, sampler anew
    if not getattr(loader, "in_order", True) and loader.num_workers > 0:
        raise UnsupportedError(
            "state_dict() in the middle of an epoch of a loader with in_order=False: the "
            "batches taken so far are not the epoch's first ones, so no position resumes "
            "it exactly; use in_order=True (torch's default) to checkpoint mid-epoch, or "
            "take the state between epochs")
    if in_trainer:  # the dataset's own states, or (an IterableDataset) how far it went
        state.update(trainer_states(loader, fetcher, mid_epoch=True))
        if iterable:
            state["iterable"] = {"trainer": {"ended": bool(getattr(fetcher, "ended", False))}}
    elif iterable:  # the position is in the workers' shards; torch's workers cannot tell it
        state["iterable"] = iterator.shard_positions() if dpex_workers else {"unknown": True}
    state.update(mid_epoch=True, yielded=yielded, sampler_rng=drawing.iter_rng,
                 layout=drawing.layout.to_state() if drawing.layout is not None else None,
                 # not drawn yet: the first draw will find the generator as it is now
                 sampler_draw_rng=(drawing.draw_rng if drawing.draw_rng is not None
                                   else rng_state(drawn_from)),
                 sampler_state=drawing.sampler_state_at(yielded))
    return position


def mid_epoch_state(loader: Any, iterator: Any, ask_workers: bool, limit: float | None = None
                    ) -> dict | None:
    """The state of ``iterator``'s position if it ends in the middle of an epoch, else
    None: with its workers' RNG and dataset states where they can be asked for (within
    ``limit`` s) before they stop; else its resumed workers start from their seeds."""
    position = capture(loader, iterator, None)
    if not position.partial["mid_epoch"]:
        return None
    if ask_workers and position.asked:
        try:
            return position.state(limit=limit)
        except DpexTimeoutError:
            pass
    if position.asked:
        position.iterator = None
        logger.info("dpex: an iterator was dropped in the middle of an epoch; "
                    "state_dict() keeps its position, without its workers' RNG states "
                    "(take state_dict() before leaving the loop to keep them)")
    return position.state()


def _rank() -> int:
    """This process's rank (torch.distributed), 0 without it."""
    return torch.utils.data.dataloader._get_distributed_settings()[1]


def _world_size() -> int:
    """This job's number of ranks (torch.distributed), 1 without it."""
    return torch.utils.data.dataloader._get_distributed_settings()[0]


def _length(loader: Any) -> int | None:
    """Batches per epoch of a map-style loader (an IterableDataset's length is a hint,
    and asking for it would make torch warn when the epoch runs longer)."""
    if loader._dataset_kind == _ITERABLE:
        return None
    try:
        return len(loader)
    except TypeError:
        return None


def _describe(source: str) -> str:
    return "a generator" if source == "generator" else "torch's global RNG (no generator)"


def plan_from(loader: Any, state: dict) -> ResumePlan | None:
    """Check ``state`` against ``loader``; apply what takes effect at once (at an epoch
    boundary, the generators' states); return what the next iterator replays."""
    if not isinstance(state, dict) or state.get("format") != _FORMAT:
        raise ResumeStateError(
            "load_state_dict() takes what DpexDataLoader.state_dict() returned; got "
            f"{type(state).__name__}" + (f" with keys {sorted(state)[:8]}"
                                         if isinstance(state, dict) else ""))
    if state.get("version") != STATE_VERSION:
        raise ResumeStateError(
            f"this loader state has version {state.get('version')!r}; this dpex reads "
            f"version {STATE_VERSION}: resume with the dpex version that saved it")
    rest, reshard = _rest_of_epoch(loader, state)
    check_identity(state.get("identity"), identity(loader), reshard=reshard)
    length = _length(loader)
    if state["length"] is not None and length is not None and state["length"] != length \
            and not reshard:
        raise ResumeStateError(
            f"the saved loader had {state['length']} batches per epoch, this one has "
            f"{length}: the dataset, sampler, batch_size or drop_last differ, so the "
            "saved position means nothing here")
    drawn_from = sampler_generator(loader._torch_index_sampler)
    for what, saved, ours in (("sampler", state["rng_source"], _source(drawn_from)),
                              ("loader", state["base_rng_source"], _source(loader.generator))):
        if saved != ours:
            raise ResumeStateError(
                f"the saved {what} drew from {_describe(saved)}, this one draws from "
                f"{_describe(ours)}: pass the same generator= arguments as the run that "
                "saved the state")
    shards = state["iterable"]
    if state["mid_epoch"] and shards is not None and "trainer" in shards:
        if loader.num_workers != 0:
            raise ResumeStateError(
                "this state was taken in the middle of an epoch of an IterableDataset with "
                "num_workers=0: the position is that of the dataset's one iterator in the "
                f"trainer, so it resumes with num_workers=0 only (this loader has "
                f"{loader.num_workers})")
    elif state["mid_epoch"] and shards is not None:
        if shards.get("unknown") or not loader._distributed:
            by = " by torch's own loader" if shards.get("unknown") else ""
            raise UnsupportedError(
                f"this state was taken in the middle of an epoch of an IterableDataset{by}; "
                "such a position lives in dpex's workers (each one's shard): take it and "
                "resume it with distribute_mode=True and num_workers > 0, or take the "
                "checkpoint between epochs")
        if loader.num_workers != state["worker_rng_num_workers"]:
            raise ResumeStateError(
                f"this state was taken in the middle of an epoch of an IterableDataset with "
                f"num_workers={state['worker_rng_num_workers']}; its shards are per worker, "
                f"so it resumes with that many workers only (this loader has "
                f"{loader.num_workers})")
    worker_rng = state["worker_rng"]
    if rest is not None:
        worker_rng = None  # other batches than the saved run's workers made
    elif worker_rng is not None and state.get("rank", 0) != _rank():
        # Another rank's workers (a framework that saves rank 0's state only): their RNG
        # states belong to other batches; this rank's workers start from their seeds.
        logger.warning("dpex: this loader state was taken on rank %s, this is rank %s: its "
                       "workers' RNG states are not used (the batches' order is)",
                       state.get("rank", 0), _rank())
        worker_rng = None
    if not state["mid_epoch"]:  # the next epoch draws from the generators as they were
        if drawn_from is not None:
            drawn_from.set_state(state["sampler_rng"])
        if loader.generator is not None and loader.generator is not drawn_from:
            loader.generator.set_state(state["base_rng"])
        own = stateful(loader._torch_index_sampler)
        if own is not None and state["sampler_state"] is not None:
            own.load_state_dict(state["sampler_state"])
        if state["iterator_rng"] is None and state.get("dataset") is None and (
                state.get("global_rng") is None):
            return None
    return ResumePlan(skip=state["yielded"], sampler_rng=state["sampler_rng"],
                      draw_rng=state["sampler_draw_rng"], iterator_rng=state["iterator_rng"],
                      sampler_state=state["sampler_state"], armed=state["mid_epoch"],
                      worker_rng=worker_rng,
                      worker_rng_num_workers=state["worker_rng_num_workers"],
                      iterable=state["iterable"],
                      epochs_before=state.get("epochs_before", 0),
                      dataset_state=state.get("dataset"),
                      dataset_iter_state=state.get("dataset_iter"),
                      global_rng=None if state["mid_epoch"] else state.get("global_rng"),
                      sampler_epoch=state.get("sampler_epoch"), rest=rest)


def _rest_of_epoch(loader: Any, state: dict) -> tuple[Layout | None, bool]:
    """(The rest of the saved epoch where this loader deals it otherwise, whether the
    saved and this loader both deal by torch's DistributedSampler): a state taken by
    R ranks resumes on R' (or with another batch size) exactly. Another rank count
    with any other sampler, or an IterableDataset, is refused by name mid-epoch."""
    ours = distributed_layout(loader._torch_index_sampler)
    saved = Layout.from_state(state["layout"]) if state.get("layout") else None
    reshard = ours is not None and saved is not None
    world, saved_world = _world_size(), state.get("world_size", 1)
    if state["mid_epoch"] and world != saved_world and not reshard:
        what = ("an IterableDataset's position lives in each rank's own shard"
                if loader._dataset_kind == _ITERABLE else
                f"its sampler ({type(loader.sampler).__name__}) does not say which samples "
                "the other ranks took")
        raise UnsupportedError(
            f"this state was taken in the middle of an epoch by a job of {saved_world} "
            f"ranks, and this job has {world}: {what}. dpex resumes on another number "
            "of ranks a map-style dataset with torch's DistributedSampler (shuffle or not, "
            "drop_last or not; Lightning's use_distributed_sampler gives one); otherwise "
            "resume on the same number of ranks, or take the checkpoint between epochs")
    if not state["mid_epoch"] or not reshard:
        return None, reshard
    assert ours is not None and saved is not None
    if (saved.start, saved.end, saved.num_replicas, saved.batch_size) == (
            0, ours.end, ours.num_replicas, ours.batch_size):
        return None, reshard  # the same dealing: replayed as the saved run drew it
    return saved.rest(state["yielded"], ours.num_replicas, ours.batch_size), reshard


@contextlib.contextmanager
def replaying(loader: Any, plan: ResumePlan | None) -> Iterator[None]:
    """While an iterator is made: its base seed drawn from the plan's state, from a
    copy of the loader's generator at that state (with no generator, a copy of torch's
    global RNG at that state: the global RNG itself then moves as the uninterrupted
    run's iterator moved it when it was made in the resumed epoch, by its seed draws,
    before a dataset's own state is loaded)."""
    if plan is None or plan.iterator_rng is None:
        yield
        return
    generator = loader.generator
    if generator is None and plan.armed and plan.epochs_before == 0:
        # (the uninterrupted run made this iterator in this epoch: a persistent one's
        # later epochs, or the next one after a state between epochs, drew nothing)
        for _ in range(1 + isinstance(loader.dataset, IterDataPipe)):  # base (+ shared) seed
            torch.empty((), dtype=torch.int64).random_()
    copy = torch.Generator()
    copy.set_state(plan.iterator_rng)
    loader.__dict__["generator"] = copy  # (DataLoader refuses setting attributes later)
    try:
        yield
    finally:
        loader.__dict__["generator"] = generator
        if generator is not None and generator is not sampler_generator(
                loader._torch_index_sampler):
            generator.set_state(copy.get_state())  # it serves base seeds alone: advance it
