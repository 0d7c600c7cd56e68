"""An iterator's sessions on the workers of a standalone fleet (``worker_pool=NAME``):
the worker-group seam of :mod:`dpex.client._workers`, over actors the fleet owns."""

from __future__ import annotations

import dataclasses
import queue
from typing import Any

import ray

from dpex import _ray_guard
from dpex._fleet_registry import choose_workers
from dpex._spec import WorkerSpec
from dpex.client._shipment import Shipment
from dpex.client._workers import deliver, report_exit

__all__ = ["FleetGroup"]


class FleetGroup:
    """This iterator's sessions on the workers of a fleet (``worker_pool=NAME``).

    Same interface as :class:`WorkerGroup`, but the actors belong to the fleet:
    ``stop()`` cancels this iterator's ``serve`` calls and leaves the workers
    running. A replacement session goes to the least busy worker that answers,
    so a dead worker's share moves to the survivors while Ray restarts it; when none
    answers (a fleet of one), the choice waits up to ``startup_timeout`` for Ray to
    restart one.
    """

    def __init__(self, fleet: str, events: queue.SimpleQueue,
                 startup_timeout: float = 120.0) -> None:
        self.fleet = fleet
        self.startup_timeout = startup_timeout
        self.options = {"worker_pool": fleet}
        self.events = events
        self.actors: dict[int, Any] = {}
        self.warm: frozenset[int] = frozenset()  # (a fleet's sessions: no warm pool)
        self._calls: dict[int, Any] = {}
        self._stopped = False
        self._namespace: str | None = None  # this trainer's (WorkerSpec.namespace)

    def start(self, specs: list[WorkerSpec], shipment: Shipment) -> None:
        for spec, actor in zip(specs, self._choose(len(specs)), strict=True):
            self._start_one(spec, shipment, actor)

    def _start_one(self, spec: WorkerSpec, shipment: Shipment, actor: Any) -> None:
        self.actors[spec.worker_id] = actor
        if self._namespace is None:  # (the sessions' Ray calls join it)
            self._namespace = ray.get_runtime_context().namespace
        spec, stored = deliver(dataclasses.replace(spec, namespace=self._namespace),
                               shipment, None, False, False)
        ref = actor.serve.remote(spec, stored)
        self._calls[spec.worker_id] = ref
        ref.future().add_done_callback(report_exit(self.events, spec.worker_id,
                                                    spec.incarnation, fleet=True))

    def restart(self, spec: WorkerSpec, shipment: Shipment) -> None:
        if self._stopped:
            return
        self._cancel(spec.worker_id)
        self._start_one(spec, shipment, self._choose(1)[0])

    def kill(self, worker_id: int) -> None:
        """End this iterator's session on a worker presumed broken (the fleet's process
        lives on); its exit is reported and the iterator replaces it."""
        self._cancel(worker_id)

    def add(self, spec: WorkerSpec, shipment: Shipment) -> None:
        """One more session, on the least busy fleet worker."""
        if not self._stopped:
            self._start_one(spec, shipment, self._choose(1)[0])

    def retire(self, worker_id: int) -> None:
        """End a retired worker's session (the fleet worker lives on)."""
        self._cancel(worker_id)
        self.actors.pop(worker_id, None)

    def _choose(self, n: int) -> list[Any]:
        return choose_workers(self.fleet, n, wait_s=self.startup_timeout)

    @property
    def stopped(self) -> bool:
        return self._stopped

    def placement_warning(self, waiting: list[int]) -> str | None:
        return None  # the fleet's workers were placed by `dpex fleet start`

    def _cancel(self, worker_id: int) -> None:
        ref = self._calls.pop(worker_id, None)
        if ref is not None:
            try:  # (from stop(), maybe on the reaper thread: never starts Ray)
                _ray_guard.cancel(ref)  # an async actor's task: its serve() ends, cleans up
            except Exception:
                pass  # already finished, its worker is gone, or Ray shut down

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if _ray_guard.ray_up():
            for worker_id in list(self._calls):
                self._cancel(worker_id)
