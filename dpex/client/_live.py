"""A loader's live dpex iterators: the ones ``close()`` stops, and the newest, which
``stats()`` and ``scale_workers()`` reach whether or not it is the current one (an
iterator still running after ``load_state_dict()`` is not current, but runs)."""

from __future__ import annotations

import weakref
from typing import Any

__all__ = ["LiveIterators"]


class LiveIterators:
    def __init__(self) -> None:
        self._all: weakref.WeakSet = weakref.WeakSet()  # (a dropped one goes with it)
        self._newest: weakref.ref | None = None

    def add(self, iterator: Any) -> None:
        self._all.add(iterator)
        self._newest = weakref.ref(iterator)

    @property
    def newest(self) -> Any:
        return self._newest() if self._newest is not None else None

    def __contains__(self, iterator: Any) -> bool:
        return iterator in self._all

    def take_all(self) -> list[Any]:
        """Every live one, forgotten here (``close()`` stops them)."""
        iterators = list(self._all)
        self._all.clear()
        return iterators
