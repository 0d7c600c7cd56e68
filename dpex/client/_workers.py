"""Starting, watching and stopping the worker actors of one iterator."""

from __future__ import annotations

import queue
from collections.abc import Mapping
from typing import Any

import ray

from dpex.client._events import WorkerExit
from dpex.errors import WorkerStartupError
from dpex.server._actor import DpexWorker
from dpex.server._worker_state import WorkerSpec

__all__ = ["WorkerGroup", "FleetGroup", "actor_options", "check_placeable"]

_DEFAULT_OPTIONS = {"num_cpus": 1, "scheduling_strategy": "SPREAD"}


def actor_options(ray_remote_args: Mapping[str, Any] | None) -> dict:
    """Actor options: 1 CPU, spread across nodes, unless ``ray_remote_args`` says otherwise."""
    return {**_DEFAULT_OPTIONS, **(ray_remote_args or {})}


def check_placeable(options: Mapping[str, Any], num_workers: int) -> None:
    """Raise at once when the cluster as a whole cannot hold ``num_workers`` actors."""
    total = ray.cluster_resources()
    asked = {"CPU": float(options.get("num_cpus", 0) or 0) * num_workers}
    if options.get("num_gpus"):
        asked["GPU"] = float(options["num_gpus"]) * num_workers
    if options.get("memory"):
        asked["memory"] = float(options["memory"]) * num_workers
    for name, amount in (options.get("resources") or {}).items():
        asked[name] = float(amount) * num_workers
    short = {k: (v, total.get(k, 0.0)) for k, v in asked.items() if v > total.get(k, 0.0) + 1e-9}
    if short:
        detail = ", ".join(f"{k}: {need:g} asked, {have:g} in the cluster" for k, (need, have) in short.items())
        raise WorkerStartupError(
            f"the Ray cluster cannot place {num_workers} dpex workers ({detail}); "
            "use fewer workers or lower ray_remote_args['num_cpus']"
        )


def _report_exit(events: queue.SimpleQueue, worker_id: int, incarnation: int) -> Any:
    """A done-callback for a ``serve`` call: its end (clean or not) as a WorkerExit."""
    def report(fut: Any) -> None:
        try:
            fut.result()
        except BaseException as exc:
            events.put(WorkerExit(worker_id, exc, incarnation))
        else:
            events.put(WorkerExit(worker_id, None, incarnation))
    return report


class WorkerGroup:
    """The actors of one iterator. ``stop()`` is idempotent and kills them all."""

    def __init__(self, options: Mapping[str, Any], events: queue.SimpleQueue) -> None:
        self.options = dict(options)
        self.events = events
        self.actors: dict[int, Any] = {}
        self._stopped = False

    def start(self, specs: list[WorkerSpec], shipped: ray.ObjectRef) -> None:
        check_placeable(self.options, len(specs))
        self._actor_class = ray.remote(DpexWorker).options(**self.options)
        for spec in specs:
            self._start_one(spec, shipped)

    def _start_one(self, spec: WorkerSpec, shipped: ray.ObjectRef) -> None:
        actor = self._actor_class.remote()
        self.actors[spec.worker_id] = actor
        ref = actor.serve.remote(spec, shipped)
        # Ray fails this reference as soon as the actor dies (process killed, node
        # lost): liveness without polling.
        ref.future().add_done_callback(_report_exit(self.events, spec.worker_id,
                                                    spec.incarnation))

    def restart(self, spec: WorkerSpec, shipped: ray.ObjectRef) -> None:
        """Replace the actor of ``spec.worker_id`` (killing the old one if it lingers)."""
        if self._stopped:
            return
        old = self.actors.get(spec.worker_id)
        if old is not None:
            try:
                ray.kill(old, no_restart=True)
            except Exception:
                pass  # already gone
        self._start_one(spec, shipped)


    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if not ray.is_initialized():
            return
        for actor in self.actors.values():
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass  # already gone


class FleetGroup:
    """This iterator's sessions on the workers of a fleet (``worker_pool=NAME``).

    Same interface as :class:`WorkerGroup`, but the actors belong to the fleet:
    ``stop()`` cancels this iterator's ``serve`` calls and leaves the workers
    running. A replacement session goes to the least busy worker that answers,
    so a dead worker's share moves to the survivors while Ray restarts it.
    """

    def __init__(self, fleet: str, events: queue.SimpleQueue) -> None:
        self.fleet = fleet
        self.options = {"worker_pool": fleet}
        self.events = events
        self.actors: dict[int, Any] = {}
        self._calls: dict[int, Any] = {}
        self._stopped = False

    def start(self, specs: list[WorkerSpec], shipped: ray.ObjectRef) -> None:
        from dpex._fleet import choose_workers

        for spec, actor in zip(specs, choose_workers(self.fleet, len(specs)), strict=True):
            self._start_one(spec, shipped, actor)

    def _start_one(self, spec: WorkerSpec, shipped: ray.ObjectRef, actor: Any) -> None:
        self.actors[spec.worker_id] = actor
        ref = actor.serve.remote(spec, shipped)
        self._calls[spec.worker_id] = ref
        ref.future().add_done_callback(_report_exit(self.events, spec.worker_id,
                                                    spec.incarnation))

    def restart(self, spec: WorkerSpec, shipped: ray.ObjectRef) -> None:
        from dpex._fleet import choose_workers

        if self._stopped:
            return
        self._cancel(spec.worker_id)
        self._start_one(spec, shipped, choose_workers(self.fleet, 1)[0])

    def _cancel(self, worker_id: int) -> None:
        ref = self._calls.pop(worker_id, None)
        if ref is not None:
            try:
                ray.cancel(ref)  # an async actor's task: its serve() ends and cleans up
            except Exception:
                pass  # already finished, or its worker is gone

    def stop(self) -> None:
        if self._stopped:
            return
        self._stopped = True
        if ray.is_initialized():
            for worker_id in list(self._calls):
                self._cancel(worker_id)
