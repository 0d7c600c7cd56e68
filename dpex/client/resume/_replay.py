"""The sampler's draws, and how a resume replays them.

The loader sees its index sampler through :class:`IndexView`; each epoch's
iteration of it is a :class:`Drawing`, which remembers the state of the generator
the sampler draws from when the epoch began (the loader's ``generator``, else
torch's global one) and counts its draws. A loaded mid-epoch
:class:`~dpex.client.resume._state.ResumeState` (``_load.loaded``) sets that
generator back and draws the batches already yielded again, without fetching any
data, or loads a stateful sampler's own ``state_dict``: the first epoch of the
iterator that took it that draws does so, and it is spent (``IndexView.resume``).
"""

from __future__ import annotations

import collections
import contextlib
from collections.abc import Iterator
from typing import Any

import torch

from dpex._spec import Positioned
from dpex.client.resume._identity import check_epoch
from dpex.client.resume._reshard import Layout, epoch_order
from dpex.client.resume._state import ResumeState
from dpex.errors import ResumeStateError

__all__ = ["IndexView", "Drawing", "stateful", "sampler_generator", "rng_state",
           "forked_global", "distributed_layout", "distributed_seed"]


def stateful(sampler: Any) -> Any | None:
    """The object whose own ``state_dict`` / ``load_state_dict`` give the position: the
    index sampler itself, or the sampler inside torch's ``BatchSampler``."""
    for candidate in (sampler, getattr(sampler, "sampler", None)):
        if callable(getattr(candidate, "state_dict", None)) and callable(
                getattr(candidate, "load_state_dict", None)):
            return candidate
    return None


def sampler_generator(sampler: Any) -> torch.Generator | None:
    """The generator an index sampler draws from: its own ``generator`` (torch's random
    samplers; DataLoader gives them its ``generator``), or the one of the sampler
    inside a batch sampler; None for torch's global RNG."""
    for candidate in (sampler, getattr(sampler, "sampler", None)):
        generator = getattr(candidate, "generator", None)
        if isinstance(generator, torch.Generator):
            return generator
    return None


def rng_state(generator: torch.Generator | None) -> torch.Tensor:
    return generator.get_state() if generator is not None else torch.get_rng_state()


@contextlib.contextmanager
def forked_global(state: torch.Tensor) -> Iterator[None]:
    """torch's global RNG at ``state`` inside; afterwards as it was before, moved on by
    as many seed draws as the code inside took from it. dpex replays the sampler's
    draws from the saved state whatever the training loop's RNG is, and that RNG still
    moves as torch's own loader would move it (a job that seeds as before finds it
    where the uninterrupted run had it)."""
    saved = torch.get_rng_state()
    torch.set_rng_state(state)
    try:
        yield
    finally:
        after = torch.get_rng_state()
        torch.set_rng_state(saved)
        for _ in range(_seed_draws(state, after)):
            torch.empty((), dtype=torch.int64).random_()


def _seed_draws(start: torch.Tensor, end: torch.Tensor, limit: int = 4) -> int:
    """How many 64-bit seed draws (torch's samplers and iterators draw theirs so) lead
    from RNG state ``start`` to ``end``; 0 if none up to ``limit`` does (other draws:
    the training loop's RNG is left as it was)."""
    generator = torch.Generator()
    generator.set_state(start)
    for draws in range(limit + 1):
        if torch.equal(generator.get_state(), end):
            return draws
        torch.empty((), dtype=torch.int64).random_(generator=generator)
    return 0


def distributed_layout(index_sampler: Any) -> Layout | None:
    """A fresh epoch's :class:`Layout` where the index sampler is torch's ``BatchSampler``
    over torch's own ``DistributedSampler`` (a subclass may deal otherwise), else None."""
    inner = getattr(index_sampler, "sampler", None)
    if type(index_sampler) is not torch.utils.data.BatchSampler or (
            type(inner) is not torch.utils.data.DistributedSampler):
        return None
    return Layout(0, len(inner.dataset), inner.num_replicas, index_sampler.batch_size,
                  inner.drop_last, index_sampler.drop_last)


def distributed_seed(index_sampler: Any) -> int | None:
    """The ``seed`` of the DistributedSampler inside the loader's index sampler (the
    same on every rank), or None."""
    if isinstance(index_sampler, IndexView):
        index_sampler = index_sampler.sampler
    inner = getattr(index_sampler, "sampler", None)
    return inner.seed if isinstance(inner, torch.utils.data.DistributedSampler) else None


class IndexView:
    """The loader's index sampler as its iterators see it: the same indices, each
    epoch a :class:`Drawing`. ``len`` is the sampler's. ``resume``: the loaded state
    the iterator was made with (None: none), until an epoch of it draws (the one
    mutable bit of a resume: a mid-epoch state is replayed once)."""

    def __init__(self, sampler: Any, resume: ResumeState | None, keep: int | None) -> None:
        self.sampler, self.resume, self.keep = sampler, resume, keep
        self.generator = sampler_generator(sampler)

    def __len__(self) -> int:
        return len(self.sampler)

    def __iter__(self) -> Drawing:
        return Drawing(self, self.keep)


def _rest_batches(sampler: Any, rest: Layout) -> Iterator[list[int]]:
    inner = sampler.sampler  # (a DistributedSampler: _load.loaded checked)
    order = epoch_order(len(inner.dataset), inner.shuffle, inner.seed, inner.epoch)
    return rest.rank_batches(order, inner.rank)


class Drawing:
    """One epoch's draws from the index sampler (torch's ``_sampler_iter``)."""

    def __init__(self, view: IndexView, keep: int | None) -> None:
        sampler, generator = view.sampler, view.generator
        self.generator, self._view = generator, view
        # The loaded mid-epoch state this epoch replays at its first draw (None: none).
        self.resume = view.resume if view.resume is not None and view.resume.mid_epoch \
            else None
        self.stateful = stateful(sampler)
        if self.resume is not None and generator is not None:
            # (also before iter(): a sampler may draw in __iter__ itself)
            generator.set_state(self.resume.sampler_rng)
        if self.resume is not None and self.resume.sampler_state is not None and self.stateful:
            self.stateful.load_state_dict(self.resume.sampler_state)
        self.iter_rng = (self.resume.sampler_rng if self.resume is not None
                         else rng_state(generator))
        self.draw_rng: torch.Tensor | None = None  # taken at the first draw
        self.position = 0  # index batches of this epoch drawn (skipped ones included)
        self.skipped = 0  # of them, passed over when resuming (yielded by the saved run)
        self.exhausted = False
        # A stateful sampler's state before each draw not yet yielded, by position: the
        # newest ``keep`` (torch's iterators: their window and a margin), or those that
        # :meth:`yielded` has not released (dpex's, whose window changes with its workers).
        self.states: collections.OrderedDict[int, Any] = collections.OrderedDict()
        self.keep = keep
        # Where this rank's entries stand in the epoch (worker_seeding="per_sample"):
        # the epoch as its DistributedSampler deals it, or the rest of a saved one.
        self.layout = distributed_layout(sampler)
        self._sampler = sampler
        self.rank = getattr(getattr(sampler, "sampler", None), "rank", 0)
        self.sampler_epoch: int | None = None  # a DistributedSampler's, at the first draw
        self.items = 0  # entries drawn this epoch (skipped ones included)
        self.batch_size = getattr(sampler, "batch_size", None)
        if self.resume is not None and self.resume.rest is not None:
            self.layout = self.resume.rest  # (its batches are dealt at the first draw)
        self._it = iter(sampler)  # (torch's samplers order the epoch at the first draw)

    def __iter__(self) -> Drawing:
        return self

    def __next__(self) -> Any:
        if self.position == 0 and self.layout is not None and self.sampler_epoch is None:
            self.sampler_epoch = self._sampler.sampler.epoch
        if self.resume is None:
            if self.draw_rng is None:
                self.draw_rng = rng_state(self.generator)
            return self._draw()
        # The sampler must be at the saved epoch by now (a framework may set it after
        # iter(): dpex's iterator draws a resumed epoch's first batch at the first next()).
        if self.resume.sampler_state is None or self.stateful is None:
            check_epoch(self.resume.sampler_epoch, getattr(self._sampler, "sampler", None))
        resume, self.resume = self.resume, None
        self._view.resume = None  # spent: taken by the epoch that draws first
        if resume.rest is not None:  # another rank count: this rank's part of the rest
            self._it = _rest_batches(self._sampler, resume.rest)
            self.draw_rng = rng_state(self.generator)
            return self._draw()
        self.draw_rng = (resume.sampler_draw_rng if resume.sampler_draw_rng is not None
                         else resume.sampler_rng)
        if self.generator is not None:
            self.generator.set_state(self.draw_rng)
            self._replay(resume)
            return self._draw()
        # With no generator the sampler draws from torch's global RNG: replay under a
        # fork of it, up to and including the first new draw (torch's samplers draw
        # their whole epoch's randomness then; see forked_global).
        with forked_global(self.draw_rng):
            self._replay(resume)
            return self._draw()

    def _draw(self) -> Any:
        if self.stateful is not None:
            self.states[self.position] = self.stateful.state_dict()
            while self.keep is not None and len(self.states) > self.keep:
                self.states.popitem(last=False)
        try:
            index = next(self._it)
        except StopIteration:
            self.exhausted = True
            raise
        self.position += 1
        self.items += _size(index)
        return index

    def positioned(self, indices: Any, epoch: int) -> Positioned:
        """The batch just drawn, with each entry's position in the epoch: the same for
        a sample whichever rank or worker takes it, and in a resumed run. The epoch is
        the DistributedSampler's (``set_epoch``), else ``epoch``."""
        before = self.items - _size(indices)
        if self.layout is not None:
            return Positioned(indices, self.layout.position(self.rank, before),
                              self.layout.num_replicas, self.sampler_epoch)
        return Positioned(indices, before, 1, epoch)

    def yielded(self, position: int) -> None:
        """The batches before ``position`` were yielded: their states are not needed."""
        while self.states and next(iter(self.states)) < position:
            self.states.popitem(last=False)

    def _replay(self, resume: ResumeState) -> None:
        """Pass over the batches already yielded, without fetching anything."""
        self.skipped = skip = resume.yielded
        if resume.sampler_state is not None and self.stateful is not None:
            self.position = skip  # the sampler's own state put it there
            self.items = skip * (self.batch_size or 1)
            return
        for _ in range(skip):
            try:
                self.items += _size(next(self._it))
            except StopIteration:
                raise ResumeStateError(
                    f"the state says {skip} batches of this epoch were yielded, but "
                    f"the sampler gives only {self.position}: the dataset, sampler or "
                    "batch size differ from the run that saved it") from None
            self.position += 1

    def yielded_of(self, num_yielded: int) -> int:
        """Batches of the epoch yielded, when the iterator yielded ``num_yielded`` (the
        batches a resume passed over are the epoch's too)."""
        return num_yielded + self.skipped

    def ended_at(self, yielded: int) -> bool:
        """Whether the epoch ended with ``yielded`` batches yielded: none is left to draw."""
        return self.exhausted and yielded >= self.position

    def sampler_state_at(self, position: int) -> Any:
        """A stateful sampler's state with ``position`` batches drawn (None if there is
        no stateful sampler, or that position is out of the recent window)."""
        if self.stateful is not None and position == self.position:
            return self.stateful.state_dict()  # nothing drawn beyond it: as it is now
        return self.states.get(position)


def _size(index: Any) -> int:
    try:
        return len(index)
    except TypeError:  # batch_size=None: one sample
        return 1
