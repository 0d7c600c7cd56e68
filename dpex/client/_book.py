"""A loader's book of its iterators: the one object a loader keeps them in, and the one
an iterator reports to.

The loader hands its book to each dpex iterator it makes (``RayDataLoaderIter(...,
book)``); the iterator writes nothing into the loader, it reports here: that it
scaled (:meth:`scaled`: the next iterator starts with that count), that it shut down
(:meth:`ended`, with its last counters) and that it was dropped (:meth:`dropped`: a
loop left with ``break``; where it stood is kept if it is the current one). The
loader asks the book which iterator is current (the newest one made, until
``load_state_dict()`` empties the slot: it describes what was loaded), which dpex
iterators live (``close()`` stops them) and which is the newest (``stats()`` and
``scale_workers()`` reach it whether or not it is current: an iterator still running
after ``load_state_dict()`` runs on).

The book holds no strong reference to its loader (its view of the loader is a weak
method) nor to a dpex iterator (a dropped one goes with its workers); torch's
single-process iterator is held, as torchdata's loader holds it, so that
``state_dict()`` after a ``break`` says where it stood.
"""

from __future__ import annotations

import logging
import weakref
from collections.abc import Callable
from typing import Any

import torch

from dpex.client.resume import (
    IteratorPosition,
    LoaderView,
    ResumeState,
    mid_epoch_state,
    position_of,
)

__all__ = ["IteratorBook"]

logger = logging.getLogger("dpex")


class IteratorBook:
    def __init__(self, view: Callable[[], LoaderView]) -> None:
        self._view = weakref.WeakMethod(view)  # (the loader's _resume_view)
        self._ref: weakref.ref | None = None  # the current iterator
        self._id: int | None = None  # (a dropped iterator's weakref is dead in its __del__)
        self._held: Any = None  # the current one, where it is held (num_workers=0)
        self.iterator_rng: torch.Tensor | None = None  # what its base seed came from
        self.kept: ResumeState | None = None  # where it ended mid-epoch (closed, dropped)
        self._live: weakref.WeakSet = weakref.WeakSet()  # dpex iterators close() stops
        self._newest: weakref.ref | None = None  # the newest dpex iterator
        self.final_stats: dict = {}  # what the newest one to shut down reported last
        self.scaled_to: int | None = None  # scale_workers() or the autoscaler's count

    # -- the loader's side ------------------------------------------------------------

    def hold(self, iterator: Any, iterator_rng: torch.Tensor, *, strong: bool,
             dpex: bool) -> None:
        """``iterator`` is the current one now; ``strong``: keep it alive; ``dpex``:
        one of dpex's (``close()`` stops it; ``stats()`` reaches it)."""
        self._ref, self._id = weakref.ref(iterator), id(iterator)
        self._held = iterator if strong else None
        self.iterator_rng, self.kept = iterator_rng, None
        if dpex:
            self._live.add(iterator)
            self._newest = weakref.ref(iterator)

    @property
    def current(self) -> Any:
        """The current iterator, while it lives (None after :meth:`empty`)."""
        return self._ref() if self._ref is not None else None

    @property
    def newest(self) -> Any:
        """The newest dpex iterator, while it lives, current or not."""
        return self._newest() if self._newest is not None else None

    def empty(self) -> None:
        """No current iterator (``load_state_dict()``: the state is the loaded one)."""
        self._ref = self._id = self._held = self.iterator_rng = self.kept = None

    def position(self) -> IteratorPosition | None:
        current = self.current
        return None if current is None else position_of(current, self.iterator_rng)

    def unstarted(self) -> ResumeState | None:
        """The loaded state the current iterator was made with and never drew from (its
        first ``next()`` was refused): the next iterator resumes in its place."""
        position = self.position()
        drawing = position.drawing if position is not None else None
        return drawing.resume if drawing is not None else None

    def keep(self, iterator: Any, ask_workers: bool, limit: float | None = None) -> None:
        """Keep where ``iterator`` stood if it is the current one and ends in the middle
        of an epoch (closed, or dropped: a loop left with ``break``), for a
        ``state_dict()`` taken after it (see :func:`~dpex.client.resume.mid_epoch_state`)."""
        view = self._view()
        if view is None or not self._is_current(iterator):
            return  # an older one, or the one running when a state was loaded
        state = mid_epoch_state(view(), position_of(iterator, self.iterator_rng),
                                ask_workers, limit)
        if state is not None:
            self.kept = state

    def take_live(self) -> list[Any]:
        """Every live dpex iterator, forgotten here (``close()`` stops them)."""
        iterators = list(self._live)
        self._live.clear()
        return iterators

    def is_live(self, iterator: Any) -> bool:
        return iterator in self._live

    def _is_current(self, iterator: Any) -> bool:
        return self._id is not None and id(iterator) == self._id

    # -- what an iterator reports ------------------------------------------------------

    def scaled(self, n: int) -> None:
        """An iterator now runs ``n`` workers: the next one starts with as many."""
        self.scaled_to = n

    def ended(self, stats: dict) -> None:
        """An iterator shut down, having counted ``stats`` (``loader.stats()`` after)."""
        self.final_stats = stats

    def dropped(self, iterator: Any, ask_workers: bool, limit: float,
                stats: Callable[[], dict]) -> None:
        """``iterator`` was dropped before it shut down (a loop left with ``break``):
        where it stood (asking its workers for their states where ``ask_workers``,
        within ``limit`` s) and its counters are kept."""
        try:  # (never raises: called from __del__)
            self.keep(iterator, ask_workers, limit)
        except Exception:  # the state is then an epoch boundary
            logger.debug("dpex: could not keep a dropped iterator's position", exc_info=True)
        try:
            self.final_stats = stats()
        except Exception:  # (a counter changed while it was read)
            logger.debug("dpex: could not keep a dropped iterator's stats", exc_info=True)

