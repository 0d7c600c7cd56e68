"""Starting, watching and stopping the worker actors of one iterator.

Placement follows :mod:`dpex._placement`: by default a worker reserves
nothing and dpex picks its node; what the user asks Ray to reserve is honoured
exactly. Every group of this process is known to :func:`live_groups`, which spreads
the next group's workers and names who holds what when a request waits.
"""

from __future__ import annotations

import dataclasses
import itertools
import queue
import threading
import time
import weakref
from collections import Counter
from collections.abc import Mapping
from typing import Any

import ray

from dpex import _cluster, _placement, _ray_guard
from dpex._fleet_registry import choose_workers
from dpex._spec import WorkerSpec
from dpex.client._events import WorkerExit
from dpex.client._warm import POOL

__all__ = ["WorkerGroup", "FleetGroup", "WorkerProcess", "live_groups"]

# Every WorkerGroup of this process (weak: a dropped iterator's group goes with it).
# Only creation adds to it and nothing else changes it: a group's stop() may run in a
# garbage-collector finalizer, on any thread and inside any code, even one that holds
# this lock or iterates this set. Readers take a snapshot under the lock and skip the
# stopped groups.
_GROUPS: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()
_groups_lock = threading.RLock()
_group_ids = itertools.count()


def live_groups() -> list[WorkerGroup]:
    """The worker groups of this process that have not stopped, oldest first."""
    with _groups_lock:
        groups = list(_GROUPS)
    return sorted((g for g in groups if not g.stopped), key=lambda g: g.group_id)


def _nodes_for(n: int) -> list[str | None]:
    """Nodes for ``n`` new workers that reserve nothing, spread counting the live
    workers of this process's groups."""
    held: Counter[str] = Counter()
    for group in live_groups():
        held.update(node for node in group.nodes.values() if node)
    return _cluster.choose_nodes(n, held)


def holders() -> str:
    """Which live dpex worker groups of this process reserve what, one per line."""
    groups = live_groups()
    lines = [f"  {g.label}: {len(g.actors)} workers, each reserving "
             f"{_placement.describe(g.demand)}" for g in groups if g.actors]
    return "\n".join(lines) or "  (none in this process)"


def _report_exit(events: queue.SimpleQueue, worker_id: int, incarnation: int,
                 guest: bool = False) -> Any:
    """A done-callback for a ``serve`` call: its end (clean or not) as a WorkerExit. A
    guest's session runs in a process of its own, whose death fails the call with the
    actor's error; the actor's own death (``RayActorError``) is its host's: the guest
    was lost with it (``host_lost``), not by a fault of its own."""
    def report(fut: Any) -> None:
        try:
            fut.result()
        except BaseException as exc:
            events.put(WorkerExit(worker_id, exc, incarnation, host_lost=guest and isinstance(
                exc, ray.exceptions.RayActorError)))
        else:
            events.put(WorkerExit(worker_id, None, incarnation))
    return report


class WorkerGroup:
    """The actors of one iterator. ``stop()`` is idempotent and kills them all.

    ``worker_class`` is the actor class (dpex's ``DpexWorker``, handed in by the loader:
    the trainer side does not import the worker side). With ``keep_s > 0`` and workers
    that reserve nothing, a worker starts on an idle process of this trainer's warm
    pool when one is there, and ``stop()`` ends the sessions and hands the processes
    back to it (:mod:`dpex.client._warm`) instead of killing them."""

    def __init__(self, worker_class: type, ray_remote_args: Mapping[str, Any],
                 events: queue.SimpleQueue, label: str = "dpex loader",
                 keep_s: float = 0.0) -> None:
        self.worker_class = worker_class
        self.user_args = dict(ray_remote_args)
        self.reserving = _placement.reserves(self.user_args)
        self.demand = _placement.per_worker_demand(self.user_args)
        self.options = {"num_cpus": 0, **self.user_args}  # as reported in errors
        if self.reserving:
            self.options.setdefault("scheduling_strategy", "SPREAD")
        self.events = events
        self.group_id = next(_group_ids)
        self.label = label
        self.actors: dict[int, Any] = {}
        self.nodes: dict[int, str | None] = {}  # the node dpex chose for each worker
        # Reuse only what reserves nothing: an idle worker holding CPUs would starve others.
        self.keep_s = keep_s if not self.reserving else 0.0
        self._key = _options_key(self.options)
        self._calls: dict[int, Any] = {}  # each worker's serve call
        self.warm: set[int] = set()  # worker ids whose session runs on a warm worker
        # Workers added while the iterator runs (elastic), served as a session of their
        # own (a process forked in ~0.1 s) on an actor of this group: guest -> host id.
        self._guests: dict[int, int] = {}
        self._parked: list[Any] = []  # retired hosts whose actor still serves guests
        self._stopped = False
        with _groups_lock:
            _GROUPS.add(self)

    def start(self, specs: list[WorkerSpec], shipped: ray.ObjectRef) -> None:
        if self.reserving:
            _cluster.check_placeable(self.user_args, len(specs))
        self._actor_class = ray.remote(self.worker_class)
        nodes = _nodes_for(len(specs)) if not self.reserving else [None] * len(specs)
        for spec, node in zip(specs, nodes, strict=True):
            self._start_one(spec, shipped, node, wait=True)

    def _start_one(self, spec: WorkerSpec, shipped: ray.ObjectRef, node: str | None,
                   wait: bool = False) -> None:
        """``wait``: for a warm worker still returning from the last iterator (only at
        the iterator's start). A replacement or an added worker takes an idle one or
        starts a fresh actor at once: the training thread carries it out, and a wait
        there (up to 5 s per worker) held up the survivors' batches too."""
        actor = POOL.take(self._key, node, wait=wait) if self.keep_s > 0 else None
        if actor is not None:  # a fresh process for the session, forked on that worker
            spec = dataclasses.replace(spec, pooled=True)
            self.warm.add(spec.worker_id)
        else:
            self.warm.discard(spec.worker_id)
            options = dict(self.options)
            if node is not None:
                options["scheduling_strategy"] = _cluster.on_node(node)
            actor = self._actor_class.options(**options).remote(warm=self.keep_s > 0)
        self._serve(actor, spec, shipped, node)

    def _serve(self, actor: Any, spec: WorkerSpec, shipped: ray.ObjectRef,
               node: str | None, guest: bool = False) -> None:
        self.actors[spec.worker_id] = actor
        self.nodes[spec.worker_id] = node
        ref = actor.serve.remote(spec, shipped)
        self._calls[spec.worker_id] = ref
        # Ray fails this reference as soon as the actor dies (process killed, node
        # lost): liveness without polling.
        ref.future().add_done_callback(_report_exit(self.events, spec.worker_id,
                                                    spec.incarnation, guest))

    def add(self, spec: WorkerSpec, shipped: ray.ObjectRef) -> None:
        """Start one more worker (a new id) on the node spreading picks: as a session of
        its own on an actor of this group there (forked in ~0.1 s instead of an actor
        start's seconds), or on a new actor where the group has none (or reserves)."""
        if self._stopped:
            return
        node = _nodes_for(1)[0] if not self.reserving else None
        hosts = [w for w in self.actors if w not in self._guests
                 and (node is None or self.nodes.get(w) == node)] if self.keep_s > 0 else []
        if not hosts:
            self._start_one(spec, shipped, node)
            return
        guests = Counter(self._guests.values())
        host = min(hosts, key=lambda w: guests[w])
        self._guests[spec.worker_id] = host
        self.warm.add(spec.worker_id)
        self._serve(self.actors[host], dataclasses.replace(spec, pooled=True), shipped,
                    self.nodes.get(host), guest=True)

    def _end_guest(self, worker_id: int) -> None:
        """End a guest's session (its host actor serves on)."""
        self._guests.pop(worker_id, None)
        self.actors.pop(worker_id, None)
        self.nodes.pop(worker_id, None)
        self.warm.discard(worker_id)
        ref = self._calls.pop(worker_id, None)
        if ref is not None:
            try:  # (from stop(), maybe on the reaper thread: never starts Ray)
                _ray_guard.cancel(ref)  # an async actor's task: its session process ends
            except Exception:
                pass  # already finished, or Ray shut down

    def retire(self, worker_id: int) -> None:
        """End one worker's session (a retired worker): a guest's on its host; else its
        process goes to the warm pool, as at ``stop()``, or is killed."""
        if worker_id in self._guests:
            self._end_guest(worker_id)
            return
        actor = self.actors.pop(worker_id, None)
        ref = self._calls.pop(worker_id, None)
        node = self.nodes.pop(worker_id, None)
        self.warm.discard(worker_id)
        if actor is None or self._stopped or not ray.is_initialized():
            return
        if worker_id in self._guests.values():  # it hosts others: end its session only
            self._parked.append(actor)
            if ref is not None:
                try:
                    ray.cancel(ref)
                except Exception:
                    pass
            return
        if self.keep_s > 0 and ref is not None:
            try:
                ray.cancel(ref)
            except Exception:
                pass  # finished already, or gone (the pool finds out)
            POOL.give_back(actor, ref, self._key, node, self.keep_s)
            return
        try:
            ray.kill(actor, no_restart=True)
        except Exception:
            pass  # already gone

    def restart(self, spec: WorkerSpec, shipped: ray.ObjectRef) -> None:
        """Replace worker ``spec.worker_id`` (killing its old actor if it lingers): as
        an added worker starts (:meth:`add`), a session forked on a live actor of this
        group on the node spreading picks (milliseconds plus the dataset's own work),
        else a new actor (seconds). A dead actor's guests come back through their own
        exits."""
        if self._stopped:
            return
        if spec.worker_id in self._guests:  # a guest: its host (if alive) serves on
            self._end_guest(spec.worker_id)
            self.add(spec, shipped)
            return
        old = self.actors.pop(spec.worker_id, None)
        self.nodes.pop(spec.worker_id, None)
        self._calls.pop(spec.worker_id, None)
        if old is not None:
            try:
                ray.kill(old, no_restart=True)
            except Exception:
                pass  # already gone
        self.add(spec, shipped)

    def kill(self, worker_id: int) -> None:
        """End a worker presumed broken; Ray reports its exit (and the iterator replaces it)."""
        if worker_id in self._guests:
            ref = self._calls.get(worker_id)
            try:
                ray.cancel(ref)  # its session only: the host serves others
            except Exception:
                pass
            return
        actor = self.actors.get(worker_id)
        if actor is not None and not self._stopped:
            try:
                ray.kill(actor, no_restart=True)
            except Exception:
                pass  # already gone

    @property
    def stopped(self) -> bool:
        return self._stopped

    def placement_warning(self, waiting: list[int]) -> str | None:
        """Why workers ``waiting`` cannot be placed right now, or ``None`` if they can
        (or reserve nothing, and so never wait for resources)."""
        if not self.demand or not waiting:
            return None
        pending = _cluster.pending_requests()
        if pending is not None and not any(_placement.matches(self.demand, request)
                                           for request in pending):
            return None  # placed, and still starting: nothing waits for resources
        short = _placement.shortfall(self.demand, ray.available_resources())
        if not short:
            return None
        free = ", ".join(f"{name} {amount:g}" for name, amount in sorted(short.items()))
        return (
            f"dpex workers {waiting} of {self.label} cannot be placed now: each reserves "
            f"{_placement.describe(self.demand)} (ray_remote_args), but the Ray cluster has "
            f"only {free} free. Live dpex loaders of this process hold:\n{holders()}\n"
            "They start when resources are freed, or fail after startup_timeout. To run "
            "without reserving CPUs, as torch's workers do, leave num_cpus out of "
            "ray_remote_args."
        )

    def stop(self) -> None:
        """End every worker's session: hand its process to the warm pool (which keeps
        it only once it proves idle) or, without reuse, kill it."""
        if self._stopped:
            return
        self._stopped = True
        # It may run on the reaper thread (a dropped iterator) while the user shuts Ray
        # down: its calls never start Ray (dpex._ray_guard).
        if not _ray_guard.ray_up():
            return
        for worker_id in list(self._guests):  # first: then their hosts are idle
            self._end_guest(worker_id)
        for actor in self._parked:
            try:
                _ray_guard.kill(actor)  # a retired host (never reused)
            except Exception:
                pass
        for worker_id, actor in self.actors.items():
            ref = self._calls.get(worker_id)
            if self.keep_s > 0 and ref is not None:
                try:
                    _ray_guard.cancel(ref)  # an async actor's task: serve() ends, cleans up
                except Exception:
                    pass  # finished already, or its worker is gone (the pool finds out)
                POOL.give_back(actor, ref, self._key, self.nodes.get(worker_id), self.keep_s)
                continue
            try:
                _ray_guard.kill(actor)
            except Exception:
                pass  # already gone


def _options_key(options: Mapping[str, Any]) -> str:
    """Actor options as a key: warm workers are reused only for the same options."""
    return repr(sorted((k, repr(v)) for k, v in options.items()))


class WorkerProcess:
    """One worker as torch's iterator shows its worker processes (``iterator._workers``):
    ``pid``, ``is_alive()``, ``join(timeout)``, ``exitcode`` and ``terminate()``, for code
    that checks that workers end (PyTorch's own DataLoader tests do). A fleet session,
    or a session on a process the warm pool keeps, is alive until its iterator ends it
    (the process lives on for other sessions)."""

    def __init__(self, group: WorkerGroup | FleetGroup, worker_id: int, actor: Any,
                 pid: int | None) -> None:
        self._group, self.worker_id, self._actor, self.pid = group, worker_id, actor, pid

    def is_alive(self) -> bool:
        if isinstance(self._group, FleetGroup) or self._group.keep_s > 0:
            if self._group.stopped:
                return False
        if isinstance(self._group, FleetGroup):
            return True
        if not ray.is_initialized():
            return False
        info = ray._private.state.state.actor_table(self._actor._actor_id.hex())
        return bool(info) and info.get("State") != "DEAD"

    def join(self, timeout: float | None = None) -> None:
        deadline = None if timeout is None else time.monotonic() + timeout
        while self.is_alive() and (deadline is None or time.monotonic() < deadline):
            time.sleep(0.05)

    @property
    def exitcode(self) -> int | None:
        """``None`` while alive, 0 if its iterator stopped it, 1 if it died otherwise."""
        if self.is_alive():
            return None
        return 0 if self._group.stopped else 1

    def terminate(self) -> None:
        if isinstance(self._group, WorkerGroup) and ray.is_initialized():
            try:
                ray.kill(self._actor, no_restart=True)
            except Exception:
                pass  # gone already


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
        self._calls: dict[int, Any] = {}
        self._stopped = False

    def start(self, specs: list[WorkerSpec], shipped: ray.ObjectRef) -> None:
        for spec, actor in zip(specs, self._choose(len(specs)), strict=True):
            self._start_one(spec, shipped, actor)

    def _start_one(self, spec: WorkerSpec, shipped: ray.ObjectRef, actor: Any) -> None:
        self.actors[spec.worker_id] = actor
        ref = actor.serve.remote(spec, shipped)
        self._calls[spec.worker_id] = ref
        ref.future().add_done_callback(_report_exit(self.events, spec.worker_id,
                                                    spec.incarnation))

    def restart(self, spec: WorkerSpec, shipped: ray.ObjectRef) -> None:
        if self._stopped:
            return
        self._cancel(spec.worker_id)
        self._start_one(spec, shipped, self._choose(1)[0])

    def kill(self, worker_id: int) -> None:
        """End this iterator's session on a worker presumed broken (the fleet's process
        lives on); its exit is reported and the iterator replaces it."""
        self._cancel(worker_id)

    def add(self, spec: WorkerSpec, shipped: ray.ObjectRef) -> None:
        """One more session, on the least busy fleet worker."""
        if not self._stopped:
            self._start_one(spec, shipped, self._choose(1)[0])

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
