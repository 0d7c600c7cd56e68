"""The loader's one slot for its current iterator.

The slot holds the loader's newest iterator (dpex's or torch's), the RNG state its base
seed came from, and, once it ended in the middle of an epoch (closed, or dropped by a
loop left with ``break``), the state it stood at, so ``state_dict()`` still says where
it stood. Only the current iterator's end is kept: an older one dropped later, or the
one running when ``load_state_dict()`` emptied the slot, stands elsewhere. (Which dpex
iterators live, for ``close()`` and ``stats()``, is ``client._live``'s job.)
"""

from __future__ import annotations

import weakref
from typing import Any

import torch

from dpex.client.resume._position import IteratorPosition, position_of
from dpex.client.resume._state import ResumeState

__all__ = ["IteratorSlot"]


class IteratorSlot:
    def __init__(self) -> None:
        self._ref: weakref.ref | None = None
        self._id: int | None = None  # (a dropped iterator's weakref is dead in its __del__)
        # num_workers=0: held, not only referred to (it holds no process; torchdata's
        # loader holds it too), so that state_dict() after a `break` says where it stood.
        self._held: Any = None
        self.iterator_rng: torch.Tensor | None = None
        self.kept: ResumeState | None = None

    def hold(self, iterator: Any, iterator_rng: torch.Tensor, *, strong: bool) -> None:
        """``iterator`` is the current one now; ``strong``: keep it alive."""
        self._ref, self._id = weakref.ref(iterator), id(iterator)
        self._held = iterator if strong else None
        self.iterator_rng, self.kept = iterator_rng, None

    @property
    def current(self) -> Any:
        """The current iterator, while it lives (None after :meth:`empty`)."""
        return self._ref() if self._ref is not None else None

    def is_current(self, iterator: Any) -> bool:
        return self._id is not None and id(iterator) == self._id

    def empty(self) -> None:
        """No current iterator (``load_state_dict()``: the state is the loaded one)."""
        self._ref = self._id = self._held = self.iterator_rng = self.kept = None

    def keep(self, iterator: Any, state: ResumeState | None) -> None:
        """``iterator`` ends at ``state`` (None: at an epoch boundary), if it is current."""
        if self.is_current(iterator) and state is not None:
            self.kept = state

    def position(self) -> IteratorPosition | None:
        current = self.current
        return None if current is None else position_of(current, self.iterator_rng)

    def unstarted(self) -> ResumeState | None:
        """The loaded state the current iterator was made with and never drew from (its
        first ``next()`` was refused): the next iterator resumes in its place."""
        position = self.position()
        drawing = position.drawing if position is not None else None
        return drawing.resume if drawing is not None else None
