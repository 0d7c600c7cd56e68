"""What one iterator starts: its loop thread, its trainer session, its workers.

:class:`Runtime` holds them and closes them together (idempotent); :class:`Workers` is
what a driver asks of a worker group, whoever runs the workers (each start takes the
iterator's :class:`~dpex.client._shipment.Shipment`).
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

from dpex._addresses import node_address
from dpex._config import DpexConfig
from dpex._event_loop import LoopThread
from dpex._protocol import Wire
from dpex._security import wire_security
from dpex._spec import WorkerSpec
from dpex.client._events import Handoff, LoopFailure
from dpex.client._fleet_group import FleetGroup
from dpex.client._session import TrainerSession
from dpex.client._shipment import Shipment
from dpex.client._workers import WorkerGroup

__all__ = ["Runtime", "Seeds", "Workers"]


class Workers(Protocol):
    """What an iterator's driver asks of its workers, whoever runs them: actors of its
    own (:class:`WorkerGroup`), sessions on a fleet (:class:`FleetGroup`), or an
    in-memory stand-in (tests/fake_runtime.py). Every method returns at once; a
    worker's HELLO, batches and end come as events on the queue the group was given
    (:class:`~dpex.client._events.WorkerHello`, ``WorkerExit``)."""

    options: dict  # the actor options, as errors report them
    actors: dict[int, Any]  # each worker id's current actor (handle)

    def start(self, specs: list[WorkerSpec], shipment: Shipment) -> None:
        """Start one worker per spec, each serving the shipped loader."""

    def restart(self, spec: WorkerSpec, shipment: Shipment) -> None:
        """Start the next incarnation of ``spec.worker_id`` (its last one is dead)."""

    def add(self, spec: WorkerSpec, shipment: Shipment) -> None:
        """Start one more worker (a new id) while the iterator runs."""

    def retire(self, worker_id: int) -> None:
        """End a worker's session; its exit is expected."""

    def kill(self, worker_id: int) -> None:
        """End a worker that hangs, now; its replacement follows its exit event."""

    def placement_warning(self, waiting: list[int]) -> str | None:
        """Why the workers ``waiting`` may not start soon (None if nothing says so)."""

    def stop(self) -> None:
        """End every worker's session (idempotent)."""


class Runtime:
    """Everything one iterator started: loop thread, sockets, actors. Idempotent close."""

    def __init__(self, name: str, handoff: Handoff, config: DpexConfig,
                 label: str, worker_class: type) -> None:
        host = node_address()  # may raise: before anything that needs closing exists
        self.loop = LoopThread(name, on_error=lambda exc: handoff.put(LoopFailure(exc)))
        self.session = TrainerSession(Wire.new(config.max_message_bytes), host, handoff,
                                      wire_security(config.encryption))
        self.workers: Workers = (
            FleetGroup(config.worker_pool, handoff, config.startup_timeout) if config.worker_pool
            else WorkerGroup(worker_class, config.ray_remote_args, handoff, label,
                             keep_s=config.warm_worker_timeout))
        self._close_shipment: Callable[[], None] = lambda: None  # (the memfd's)
        self.closed = False

    def open(self) -> None:
        # Generous: the garbage collector may run other objects' finalizers on the new
        # thread before its loop starts; a torch iterator kept by a reference cycle (an
        # exception's traceback) joins its worker processes there, 5 s each.
        self.loop.start(timeout=60.0)
        self.loop.run(self.session.open(), timeout=60.0)

    def start(self, specs: list[WorkerSpec], shipment: Shipment) -> None:
        """Start the workers of ``specs`` with ``shipment`` (its memfd is closed with
        this runtime)."""
        self._close_shipment = shipment.delivery.closer()
        self.workers.start(specs, shipment)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.workers.stop()
        self.loop.stop(cleanup=self.session.close)
        self._close_shipment()  # no worker will read the memfd any more


@dataclasses.dataclass(frozen=True)
class Seeds:
    """What the iterator's workers are seeded with (torch's ``_base_seed`` and
    ``_shared_seed``)."""

    base: int
    shared: Any
