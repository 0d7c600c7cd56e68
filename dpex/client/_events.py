"""What crosses from the loop thread (and Ray callbacks) to the training thread, and
the :class:`Handoff` it crosses by. Batches do not cross: the training thread reads
them from its data socket itself (:meth:`~dpex.client._session.TrainerSession.receive`).
"""

from __future__ import annotations

import os
import queue
import time
import weakref
from dataclasses import dataclass, field
from typing import Any

__all__ = ["Handoff", "WorkerHello", "WorkerExit", "LoopFailure", "RngReply",
           "WorkerProgress"]


class Handoff:
    """The training thread's inbox: a queue that any thread puts events on, and a
    descriptor that is readable once something was put since the last :meth:`clear`,
    so the training thread waits on it and on its data socket in one ``poll``.

    The descriptor (an eventfd; a pipe where there is none) is closed when the
    handoff is garbage, never before: every thread that puts holds a reference, so
    none can write to a closed (or reused) descriptor number."""

    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()
        if hasattr(os, "eventfd"):
            self._r = self._w = os.eventfd(0, os.EFD_NONBLOCK | os.EFD_CLOEXEC)
        else:  # (not Linux)
            self._r, self._w = os.pipe()
            os.set_blocking(self._r, False)
            os.set_blocking(self._w, False)
        weakref.finalize(self, _close, self._r, self._w)

    def put(self, item: Any) -> None:
        self._queue.put(item)
        self.wake()

    def wake(self) -> None:
        """Make the descriptor readable (a waiting training thread returns)."""
        try:
            os.write(self._w, b"\1\0\0\0\0\0\0\0")
        except BlockingIOError:
            pass  # readable already

    def clear(self) -> None:
        """Read the descriptor back to not readable (before the queue is looked at)."""
        try:
            os.read(self._r, 4096)
        except BlockingIOError:
            pass

    def fileno(self) -> int:
        return self._r

    def get_nowait(self) -> Any:
        return self._queue.get_nowait()

    def get(self, timeout: float | None = None) -> Any:
        return self._queue.get(timeout=timeout)

    def empty(self) -> bool:
        return self._queue.empty()


def _close(r: int, w: int) -> None:
    for fd in {r, w}:
        try:
            os.close(fd)
        except OSError:
            pass


@dataclass(frozen=True)
class WorkerHello:
    """A worker connected and is ready for tasks."""

    worker_id: int
    info: dict


@dataclass(frozen=True)
class WorkerExit:
    """A worker's ``serve`` call ended: ``error`` is None for a clean stop."""

    worker_id: int
    error: BaseException | None
    incarnation: int = 0
    at: float = field(default_factory=time.monotonic)  # when Ray reported it
    # Not a death of its own (the group says which): ``moved`` (a guest session whose
    # host actor died; a fleet worker that ended its session cleanly, removed by `dpex
    # fleet scale`) costs no restart, and ``unplaced`` (never placed: its node went
    # away; or moved) is placed again.
    moved: bool = False
    unplaced: bool = False


@dataclass(frozen=True)
class RngReply:
    """A worker's RNG states right after batch ``seq`` of ``epoch`` (None if it has
    none: a replacement, or a batch out of its recent window)."""

    worker_id: int
    epoch: int
    seq: int
    state: dict | None


@dataclass(frozen=True)
class WorkerProgress:
    """A worker's PROGRESS: its compute thread works on batch ``seq`` of ``epoch``
    (``IDLE``, ``LOADING``: see :mod:`dpex._protocol`) and has for ``working_s``;
    ``queued`` items wait for it."""

    worker_id: int
    incarnation: int
    epoch: int
    seq: int
    working_s: float
    queued: int
    at: float = field(default_factory=time.monotonic)  # when the trainer's loop got it


@dataclass(frozen=True)
class LoopFailure:
    """The loop thread hit an error it cannot recover from."""

    error: BaseException
