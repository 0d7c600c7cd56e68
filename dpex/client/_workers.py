"""Starting, watching and stopping the worker actors of one iterator.

Placement follows :mod:`dpex._placement`: by default a worker reserves
nothing and dpex picks its node; what the user asks Ray to reserve is honoured
exactly. Every group of this process is known to :func:`live_groups`, which spreads
the next group's workers and names who holds what when a request waits.

The host wing's processes, what each holds and when it ends: NOTE [ The worker
host's processes ] in :mod:`dpex.server._fork_base`.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import logging
import os
import queue
import threading
import time
import weakref
from collections import Counter
from collections.abc import Mapping
from typing import Any

import ray

from dpex import _cluster, _placement, _ray_guard
from dpex._spec import WorkerSpec
from dpex.client import _hosts
from dpex.client._events import WorkerExit
from dpex.client._hosts import host_options, new_host, options_key
from dpex.client._shipment import Shipment
from dpex.client._warm import POOL

__all__ = ["WorkerGroup", "WorkerProcess", "deliver", "live_groups", "report_exit",
           "start_hosts", "start_hosts_early"]

# Every WorkerGroup of this process (weak: a dropped iterator's group goes with it).
# Only creation adds to it and nothing else changes it: a group's stop() may run in a
# garbage-collector finalizer, on any thread and inside any code, even one that holds
# this lock or iterates this set. Readers take a snapshot under the lock and skip the
# stopped groups.
_GROUPS: weakref.WeakSet[WorkerGroup] = weakref.WeakSet()
_groups_lock = threading.RLock()
_group_ids = itertools.count()
logger = logging.getLogger("dpex")
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


def report_exit(events: queue.SimpleQueue, worker_id: int, incarnation: int,
                on_host_lost: Any = None, *, fleet: bool = False) -> Any:
    """A done-callback for a ``serve`` call: its end (clean or not) as a WorkerExit. A
    hosted worker's session runs in a process of its own, whose death fails the call
    with the host's error; the host's own death (``RayActorError``) loses all its
    sessions (moved: not by a fault of their own), and ``on_host_lost()`` is told so
    that no replacement goes to it. A worker never placed (its node went away) is
    unplaced; a ``fleet`` worker's clean end (removed by `dpex fleet scale`) is moved."""
    def report(fut: Any) -> None:
        try:
            fut.result()
        except BaseException as exc:
            lost = on_host_lost is not None and isinstance(exc, ray.exceptions.RayActorError)
            if lost:
                on_host_lost()
            cause = getattr(exc, "cause", None) or exc  # (a RayTaskError's own)
            events.put(WorkerExit(worker_id, exc, incarnation, moved=lost, unplaced=isinstance(
                cause, ray.exceptions.ActorUnschedulableError)))
        else:
            events.put(WorkerExit(worker_id, None, incarnation, moved=fleet, unplaced=fleet))
    return report


def deliver(spec: WorkerSpec, shipment: Shipment, node: str | None, hosted: bool,
            starting: bool) -> tuple[WorkerSpec, ray.ObjectRef | None]:
    """What a worker's ``serve`` call gets: its spec, naming the shipment (its digest: a
    host's sessions of one loader fork from one copy of it), and the object store's
    copy, or None where the spec names the memfd instead (``local``). A worker on a host
    (``hosted``) on the trainer's node (``node``) reads the memfd while it is open: one
    of the iterator's first workers (``starting``) before it says HELLO (once every
    first worker did, the trainer closes it), any later one too where the delivery
    keeps it (:attr:`~dpex._shipfile.Delivery.kept`); any other worker (one on another
    node or of its own actor, a later one where it is closed or a host could not use
    it) gets the object store's copy (:class:`~dpex._shipfile.Delivery`)."""
    delivery = shipment.delivery
    spec = dataclasses.replace(spec, shipment=shipment.digest)
    # (``None``: the cluster has one node, which the trainer runs on)
    if hosted and (starting or delivery.kept) and node in (None, delivery.node_id):
        local = delivery.lend()
        if local is not None:
            return dataclasses.replace(spec, local=local), None
    return spec, delivery.object_ref()


class WorkerGroup:
    """The workers of one iterator. ``stop()`` is idempotent and ends them all.

    ``worker_class`` is the actor class (dpex's ``DpexWorker``, handed in by the loader:
    the trainer side does not import the worker side). Workers that reserve nothing
    run on a **host** per node: one actor that holds the interpreter and, in a fork
    base, the dataset once, each worker a session in a process forked from it
    (milliseconds; :mod:`dpex.server._fork_base`). Workers that reserve resources
    (``num_cpus``, ``num_gpus``, ...) are an actor each, since Ray reserves per actor.
    With ``keep_s > 0`` a host comes from this trainer's warm pool when one is idle
    there, and ``stop()`` ends the sessions and hands the hosts back to it
    (:mod:`dpex.client._warm`) instead of killing them."""

    def __init__(self, worker_class: type, ray_remote_args: Mapping[str, Any],
                 events: queue.SimpleQueue, label: str = "dpex loader",
                 keep_s: float = 0.0) -> None:
        self.worker_class = worker_class
        self.user_args = dict(ray_remote_args)
        self.reserving = _placement.reserves(self.user_args)
        self.demand = _placement.per_worker_demand(self.user_args)
        self.options = host_options(self.user_args)  # as reported in errors
        self.events = events
        self.group_id = next(_group_ids)
        self.label = label
        self.actors: dict[int, Any] = {}  # each worker's actor (its host, when hosted)
        self.nodes: dict[int, str | None] = {}  # the node dpex chose for each worker
        # Reuse only what reserves nothing: an idle worker holding CPUs would starve others.
        self.keep_s = keep_s if not self.reserving else 0.0
        self._key = options_key(self.options)
        self._calls: dict[int, Any] = {}  # each worker's serve call
        self._session_ids: dict[int, bytes | None] = {}  # the iterator's, per worker
        self._hosts: dict[str | None, Any] = {}  # node -> this group's host there
        self._lost: set[str] = set()  # ids of hosts that died (told by their sessions)
        self._reused: set[str] = set()  # ids of hosts taken from the warm pool
        self.warm: set[int] = set()  # worker ids served on a host from the warm pool
        self._stopped = False
        self._starting = False
        with _groups_lock:
            _GROUPS.add(self)

    @property
    def hosted(self) -> bool:
        """Whether this group's workers are sessions on hosts (they reserve nothing)."""
        return not self.reserving

    def start(self, specs: list[WorkerSpec], shipment: Shipment) -> None:
        if self.reserving:
            _cluster.check_placeable(self.user_args, len(specs))
        self._actor_class = ray.remote(self.worker_class)
        nodes = _nodes_for(len(specs)) if self.hosted else [None] * len(specs)
        self._starting = True  # (these read the trainer's memfd before they say HELLO)
        try:
            for spec, node in zip(specs, nodes, strict=True):
                self._start_one(spec, shipment, node, wait=True)
        finally:
            self._starting = False

    def _start_one(self, spec: WorkerSpec, shipment: Shipment, node: str | None,
                   wait: bool = False) -> None:
        """A session on the host of ``node`` (a worker that reserves: an actor of its
        own). ``wait``: for a host still returning from the last iterator (only at the
        iterator's start); a replacement or an added worker never waits (the training
        thread carries it out)."""
        if self.hosted:
            host = self._host(node, wait)
            self._serve(host, dataclasses.replace(spec, own_process=True), shipment, node, host)
            return
        actor = self._actor_class.options(**self.options).remote(
            niceness=os.getpriority(os.PRIO_PROCESS, 0))
        self._serve(actor, spec, shipment, node)

    def _host(self, node: str | None, wait: bool) -> Any:
        """This group's live host on ``node``: its own, one from the warm pool, or new."""
        host = self._hosts.get(node)
        if host is not None and _ray_guard.actor_id(host) not in self._lost:
            return host
        host = _hosts.SHARED.take(self._key, node, self.group_id)
        if host is not None:  # another live loader's: shared
            self._hosts[node] = host
            return host
        host = POOL.take(self._key, node, wait=wait)
        if host is None:
            host = new_host(self._actor_class, self.options, node, self.keep_s)
        elif _ray_guard.actor_id(host) in _hosts.EARLY:  # started early (fresh), not reused
            _hosts.EARLY.discard(_ray_guard.actor_id(host))
        else:
            self._reused.add(_ray_guard.actor_id(host))
        self._hosts[node] = host
        _hosts.SHARED.add(self._key, node, self.group_id, host)
        return host

    def _host_lost(self, host_id: str) -> None:
        self._lost.add(host_id)
        _hosts.SHARED.lost(host_id)

    def _serve(self, actor: Any, spec: WorkerSpec, shipment: Shipment,
               node: str | None, host: Any = None) -> None:
        spec, stored = deliver(spec, shipment, node, host is not None, self._starting)
        self.actors[spec.worker_id] = actor
        self.nodes[spec.worker_id] = node
        self._session_ids[spec.worker_id] = getattr(spec.wire, "session_id", None)
        if host is not None and _ray_guard.actor_id(host) in self._reused:
            self.warm.add(spec.worker_id)
        else:
            self.warm.discard(spec.worker_id)
        ref = actor.serve.remote(spec, stored)
        self._calls[spec.worker_id] = ref
        lost = None if host is None else functools.partial(
            self._host_lost, _ray_guard.actor_id(host))
        # Ray fails this reference as soon as the actor dies (process killed, node
        # lost): liveness without polling.
        ref.future().add_done_callback(report_exit(self.events, spec.worker_id,
                                                    spec.incarnation, lost))

    def add(self, spec: WorkerSpec, shipment: Shipment) -> None:
        """Start one more worker (a new id) on the node spreading picks: a session
        forked on the host there (milliseconds plus the dataset's own work; a new host
        where there is none), or an actor of its own for a worker that reserves."""
        if self._stopped:
            return
        self._start_one(spec, shipment, _nodes_for(1)[0] if self.hosted else None)

    def _end_session(self, worker_id: int) -> None:
        """End a worker's session (its host serves on)."""
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
        """End one worker's session (a retired worker): a hosted worker's on its host;
        an actor of its own is killed."""
        if self.hosted:
            self._end_session(worker_id)
            return
        actor = self.actors.pop(worker_id, None)
        self._calls.pop(worker_id, None)
        self.nodes.pop(worker_id, None)
        if actor is not None and not self._stopped and ray.is_initialized():
            _kill(actor)

    def restart(self, spec: WorkerSpec, shipment: Shipment) -> None:
        """Replace worker ``spec.worker_id``: as an added worker starts (:meth:`add`), a
        session forked on the host of the node spreading picks (a new host where the
        old one died), or a new actor for a worker that reserves (its old one killed
        if it lingers)."""
        if self._stopped:
            return
        if self.hosted:
            self._end_session(spec.worker_id)
        else:
            old = self.actors.pop(spec.worker_id, None)
            self.nodes.pop(spec.worker_id, None)
            self._calls.pop(spec.worker_id, None)
            if old is not None:
                _kill(old)
        self.add(spec, shipment)

    def kill(self, worker_id: int) -> None:
        """End a worker presumed broken (its session process at once, on a host); Ray
        reports its exit and the iterator replaces it."""
        actor = self.actors.get(worker_id)
        if actor is None or self._stopped:
            return
        if self.hosted:
            try:  # (its session's id: a host may serve other loaders' worker ids too)
                actor.kill_session.remote(worker_id, self._session_ids.get(worker_id))
            except Exception:
                pass  # its host is gone: its exit comes from that
            return
        _kill(actor)

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
        """End every worker's session; hand each host to the warm pool (which keeps it
        only once it proves idle) or, without reuse, kill it and every own actor."""
        if self._stopped:
            return
        self._stopped = True
        last = {node: _hosts.SHARED.leave(self._key, node, self.group_id, host)
                for node, host in self._hosts.items()}
        # It may run on the reaper thread (a dropped iterator) while the user shuts Ray
        # down: its calls never start Ray (dpex._ray_guard).
        if not _ray_guard.ray_up():
            return
        if not self.hosted:
            for actor in self.actors.values():
                _kill(actor)
            return
        calls = {w: (self.actors.get(w), ref) for w, ref in self._calls.items()}
        for ref in self._calls.values():  # (actors, nodes and warm stay: its final stats)
            try:  # (maybe on the reaper thread: never starts Ray)
                _ray_guard.cancel(ref)  # an async actor's task: its session process ends
            except Exception:
                pass  # already finished, or Ray shut down
        self._calls.clear()
        for node, host in self._hosts.items():
            if _ray_guard.actor_id(host) in self._lost or not last[node]:
                continue  # (another live loader's still: it hands it on when it stops)
            refs = [ref for actor, ref in calls.values() if actor is host]
            if self.keep_s > 0:
                POOL.give_back(host, refs, self._key, node, self.keep_s)
            else:
                _kill(host)


def start_hosts_early(worker_class: type, num_workers: Any,
                      ray_remote_args: Mapping[str, Any], keep_s: float) -> None:
    """A loader was built (and Ray joined, client/_early.py): start the hosts its first
    iterator will take now, while the trainer sets up its model (an actor and its
    forkserver take seconds); they wait in the warm pool. Never fails the loader's
    construction."""
    try:
        if not ray.is_initialized():
            return
        from dpex._autoscale import Autoscale

        count = num_workers.min if isinstance(num_workers, Autoscale) else int(num_workers)
        start_hosts(worker_class, ray_remote_args, count, keep_s)
    except Exception:  # only an early start: the iterator starts its hosts itself
        logger.debug("dpex: could not start worker hosts early", exc_info=True)


def start_hosts(worker_class: type, ray_remote_args: Mapping[str, Any], num_workers: int,
                keep_s: float) -> int:
    """Start the hosts a loader's first iterator will take, now (when the loader is
    built, Ray running): one per node its workers would spread to, each kept idle in
    the warm pool for ``keep_s`` s, unless one is there (idle, or serving a live loader
    of this process, whose host it will share). How many started."""
    options = host_options(ray_remote_args)
    if _placement.reserves(options) or keep_s <= 0 or num_workers <= 0:
        return 0
    key = options_key(options)
    actor_class = ray.remote(worker_class)
    started = 0
    for node in dict.fromkeys(_nodes_for(num_workers)):
        if not POOL.has_idle(key, node) and not _hosts.SHARED.has(key, node):
            host = new_host(actor_class, options, node, keep_s)
            _hosts.EARLY.add(_ray_guard.actor_id(host))
            POOL.keep_idle(host, key, node, keep_s)
            started += 1
    return started


def _kill(actor: Any) -> None:
    try:
        _ray_guard.kill(actor)
    except Exception:
        pass  # already gone


class WorkerProcess:
    """One worker as torch's iterator shows its worker processes (``iterator._workers``):
    ``pid``, ``is_alive()``, ``join(timeout)``, ``exitcode`` and ``terminate()``, for code
    that checks that workers end (PyTorch's own DataLoader tests do). A fleet session,
    or a session on a host, is alive until its iterator ends it (the host lives on for
    other sessions)."""

    def __init__(self, group: Any, worker_id: int, actor: Any,
                 pid: int | None) -> None:
        self._group, self.worker_id, self._actor, self.pid = group, worker_id, actor, pid

    def is_alive(self) -> bool:
        fleet = not isinstance(self._group, WorkerGroup)  # (a FleetGroup)
        if (fleet or self._group.hosted) and self._group.stopped:
            return False
        if fleet:
            return True
        if not ray.is_initialized():
            return False
        info = ray._private.state.state.actor_table(_ray_guard.actor_id(self._actor))
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
            self._group.kill(self.worker_id)
