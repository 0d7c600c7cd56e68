"""What crosses from the loop thread (and Ray callbacks) to the training thread."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

__all__ = ["WorkerHello", "WorkerExit", "LoopFailure", "RngReply", "WorkerProgress"]


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
    host_lost: bool = False  # a guest session whose host actor died (not its own fault)


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
