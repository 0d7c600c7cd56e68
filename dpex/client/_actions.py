"""The actions :class:`~dpex.client._scheduler.EpochScheduler` returns, which the
iterator's driver carries out in the order returned (the scheduler's docstring says
which event returns which). ``KillWorker`` is :mod:`dpex.client._kills`'s."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from dpex._protocol import Kind

__all__ = ["SendTasks", "Control", "StartReplacement", "StartWorker", "StopWorker", "Fatal"]


@dataclass(frozen=True)
class SendTasks:
    worker_id: int
    epoch: int
    tasks: list[tuple[int, Any]]  # (seq, indices), in the order the worker runs them
    kind = Kind.TASKS


@dataclass(frozen=True)
class Control:
    worker_id: int
    kind: Kind  # RESUME (payload: the epoch's IterDataPipe seed) or SKIP (payload: n)
    epoch: int
    payload: Any = None


@dataclass(frozen=True)
class StartReplacement:
    worker_id: int
    incarnation: int


@dataclass(frozen=True)
class StartWorker:
    """Start a new worker with this (new) id; it says HELLO when ready."""
    worker_id: int


@dataclass(frozen=True)
class StopWorker:
    """A retired worker holds no task any more: end its session (its exit is expected)."""
    worker_id: int


@dataclass(frozen=True)
class Fatal:
    worker_id: int
    startup: bool  # it never started (or cannot): WorkerStartupError, else WorkerDiedError
    hung: str = ""  # dpex's own kills are spent: why (WorkerHungError)
