"""What one iterator starts: its loop thread, its trainer session, its workers.

:class:`Runtime` holds them and closes them together (idempotent); :class:`Workers` is
what a driver asks of a worker group, whoever runs the workers (each start takes the
iterator's :class:`~dpex.client._shipment.Shipment`). :class:`Runtimes` is what an
iterator asks of the world its workers run in (connect, ship the loader, make its
runtime); :class:`~dpex.client._ray_runtimes.RayRuntimes`, Ray's, is the default, and a test's in-process one
(tests/inprocess.py) runs the real task runner without Ray.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Set
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

__all__ = ["Runtime", "Runtimes", "Seeds", "Workers"]


class Workers(Protocol):
    """What an iterator's driver asks of its workers, whoever runs them: actors of its
    own (:class:`WorkerGroup`), sessions on a fleet (:class:`FleetGroup`), or an
    in-memory stand-in (tests/fake_runtime.py, tests/inprocess.py). Every method
    returns at once; a worker's HELLO, batches and end come as events on the queue the
    group was given (:class:`~dpex.client._events.WorkerHello`, ``WorkerExit``, whose
    ``moved`` and ``unplaced`` say what the group knows of an end that is not a death
    of the worker's own). tests/test_driver.py checks that the driver asks nothing
    else of a group."""

    options: dict  # the actor options, as errors report them
    actors: dict[int, Any]  # each worker id's current actor (handle)
    warm: Set[int]  # the worker ids served on a host taken from the warm pool (stats())

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


class Runtimes(Protocol):
    """What a dpex iterator asks of the world its workers run in (the loader's
    constructor asks :meth:`prestart`)."""

    def prestart(self, worker_class: type, num_workers: Any, remote_args: Any,
                 keep_s: float, head_address: str) -> None:
        """A loader was built: start what its first iterator will take, in the
        background (never blocks, never raises)."""

    def handed_off(self) -> None:
        """A loader was pickled into a process this one spawns (``mp.spawn``,
        ``ddp_spawn``): what :meth:`prestart` began for an iterator here may stop."""

    def connect(self, head_address: str) -> None:
        """Join (or start) the cluster the workers run on."""

    def node_id(self) -> str:
        """This process's node."""

    def ship(self, loader: Any, contents: Any, fleet: bool) -> Shipment:
        """The iterator's shipped loader (pickled once, delivered to each start)."""

    def make(self, name: str, handoff: Handoff, config: DpexConfig, label: str,
             worker_class: type) -> Any:
        """The iterator's :class:`Runtime` (loop thread, session, workers)."""

    def free_resources(self) -> dict:
        """The cluster's free resources (for an error message)."""


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
