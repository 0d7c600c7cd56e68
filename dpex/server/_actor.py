"""The worker actor: an asyncio server for its sessions, each served in this process
(:class:`~dpex.server._session.SessionServer`) or in a process of its own
(:mod:`dpex.server._session_process`, whose child runs :class:`SessionWorker`).

The host wing's processes, what each holds and when it ends: NOTE [ The worker
host's processes ] in :mod:`dpex.server._fork_base`.
"""

from __future__ import annotations

import asyncio
import logging
import os
import threading
import weakref
from typing import TYPE_CHECKING

from dpex._spec import Parcel, WorkerSpec
from dpex._start_trace import mark, process_started
from dpex._version import local_versions
from dpex.errors import WorkerStartupError
from dpex.server._base_cache import BaseCache, BaseStarter
from dpex.server._fork_base import BaseUnsafe, ForkBase
from dpex.server._node_bases import NodeBases
from dpex.server._session_process import SessionProcess, SessionWorker, prestart

if TYPE_CHECKING:
    from dpex._ray_connect import JobView
    from dpex.server._session import Session, SessionServer

__all__ = ["DpexWorker"]

logger = logging.getLogger("dpex")


_FORK_TRIES = 3  # forks of one session's child, each from a base found alive
# What a fork through a base that ended raises (its socket refused or unlinked, its end
# of the pipe closed mid-fork, its pid gone); any other error is the session's own.
_BASE_GONE = (ConnectionError, FileNotFoundError, EOFError, BaseUnsafe)

SHARE_BASES = "DPEX_FLEET_SHARE_BASES"  # 0: each fleet worker keeps bases of its own


def _fleet_node_bases() -> NodeBases | None:
    """A fleet worker's registry of the bases its fleet shares on this node; None where
    the fleet was started with ``DPEX_FLEET_SHARE_BASES=0`` (docs/FLEET.md), or where
    it has no name (a test's actor)."""
    import ray

    if os.environ.get(SHARE_BASES, "1") == "0":
        return None
    ctx = ray.get_runtime_context()
    name = ctx.get_actor_name() if ctx.get_actor_id() is not None else None
    if not name or "/" not in name:
        return None
    return NodeBases.for_fleet(ctx.gcs_address, name.rsplit("/", 1)[0])


def _take_niceness(niceness: int | None) -> None:
    """Run every thread of this process at the trainer's ``niceness``, as torch's forked
    workers do: Ray starts its workers at niceness 15 (``worker_niceness``) and any
    other work of the node then starves them (a session's loop thread took the
    trainer's before, but not this actor's threads, which dispatch its calls, nor the
    forkserver and fork bases they start). On Linux niceness is per thread; a thread
    started later takes its creator's. Where this process may not raise its priority
    (no ``CAP_SYS_NICE``), it says how to start the cluster instead."""
    if niceness is None:
        return
    try:
        for tid in os.listdir("/proc/self/task"):
            if os.getpriority(os.PRIO_PROCESS, int(tid)) != niceness:
                os.setpriority(os.PRIO_PROCESS, int(tid), niceness)
    except ProcessLookupError:
        pass  # (a thread that ended meanwhile)
    except OSError as exc:
        logger.warning(
            "dpex: this worker runs at Ray's niceness %s, below the trainer's %s, and may "
            "not raise it (%s): other work on node %s takes its CPU first. Start the "
            "cluster with RAY_worker_niceness=0 in the environment of `ray start` (the "
            "embedded default does)", os.getpriority(os.PRIO_PROCESS, 0), niceness, exc,
            os.uname().nodename)


def _placement() -> dict:
    import ray

    ctx = ray.get_runtime_context()
    return {
        "node_id": ctx.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
    }


def _ray_view(own_job: bool) -> JobView | None:
    """What Ray calls in its sessions' processes join (None: not in a Ray worker)."""
    from dpex._ray_connect import worker_job_view

    return worker_job_view(own_job)


class DpexWorker:
    """Ray actor class (wrapped with ``ray.remote`` by the trainer side, or started
    detached by ``dpex fleet start``). It serves any number of sessions at once,
    one ``serve`` call each; ``session_timeout`` is how long a session may hear
    nothing from its trainer (which pings every second) before it is freed."""

    def __init__(self, session_timeout: float = 30.0, fleet: bool = False,
                 warm: bool = False, fleet_setting: dict | None = None,
                 host: bool = False, niceness: int | None = None) -> None:
        """``fleet``: a fleet worker (every session in a process of its own); ``warm``:
        a trainer's worker that may serve its later iterators (each in a process of its
        own). A fleet worker starts the forkserver those processes fork from now, in
        the background, so that no session waits for it; a warm worker's first
        session runs here and may be its only one (``persistent_workers``, a single
        iterator): its forkserver (~170 MiB PSS beside the actor's ~200) starts once
        the warm pool keeps it idle (:meth:`keep`), or when a session first forks
        (docs/WARM_WORKERS.md). ``host``: a trainer's worker host, whose sessions all
        run in processes of their own: its forkserver starts at once, as a fleet
        worker's. ``fleet_setting``: how its fleet was started (``dpex fleet scale``
        starts more workers the same way). ``niceness``: the trainer's, which this
        process and its sessions take (:func:`_take_niceness`).

        Each shipped loader its sessions serve is unpickled once, in a fork base
        (:mod:`dpex.server._fork_base`) those sessions are forked from."""
        mark("host init", started=process_started())
        _take_niceness(niceness)  # (first: the forkserver and the sessions inherit it)
        self._forkserver: threading.Thread | None = None
        if fleet or host:  # first: the forkserver imports torch while this sets up
            self._start_forkserver()
        self.session_timeout = session_timeout
        self.fleet_setting = fleet_setting
        self.draining = False
        self.placement = _placement()
        # Ray calls in its sessions' processes join its cluster; a trainer's worker's
        # also its job's namespace and runtime_env (a fleet's serve other jobs).
        self._ray_view = _ray_view(own_job=not fleet)
        self._sessions: set[Session] = set()
        self._computes: weakref.WeakSet[threading.Thread] = weakref.WeakSet()
        self._children: set[SessionProcess] = set()  # sessions' own processes
        self._lock = threading.Lock()
        self._counters = {"sessions_served": 0, "batches_sent": 0, "bytes_sent": 0,
                          "control_rejected": 0}
        self._in_process: SessionServer | None = None  # (made when first serving here)
        # (A fleet's workers serve other trainers: none forks from libraries that
        # another trainer's dataset imported.)
        # A fleet's workers of one node share one base per dataset (_node_bases).
        self._node = _fleet_node_bases() if fleet else None
        self._starter = BaseStarter(self._ray_view, share_libraries=not fleet,
                                    node=self._node)
        self._bases = BaseCache(self._starter.start)  # fork bases by shipment digest

    def _start_forkserver(self) -> None:
        """Start the forkserver in the background (imports torch and Ray: seconds), once."""
        if self._forkserver is None:
            self._forkserver = threading.Thread(target=prestart, name="dpex-forkserver",
                                                daemon=True)
            self._forkserver.start()

    def reusable(self) -> bool:
        """Whether this worker may serve a later iterator of its trainer (the warm
        pool asks when an iterator ends): no session is served and nothing of an ended
        one still runs (a hung ``__getitem__`` would run on beside the next session).
        Each later session gets a fresh process, forked from the forkserver, as a
        torch worker does: nothing of this process's module state reaches it."""
        return (not self._sessions and not any(t.is_alive() for t in self._computes)
                and not self._children)

    def keep(self) -> bool:
        """:meth:`reusable`, asked by the warm pool before it keeps this worker idle;
        if so, the forkserver its next session forks from starts now, while it idles
        (a session that had to wait for it would wait seconds)."""
        reusable = self.reusable()
        if reusable:
            self._start_forkserver()
        return reusable

    def fleet_stats(self) -> dict:
        """Placement, versions and traffic so far (``dpex fleet status``)."""
        with self._lock:
            counters = dict(self._counters)
            for child in self._children:
                for name, n in child.counters().items():
                    counters[name] += n
        return {**self.placement, "versions": local_versions(),
                "sessions_active": len(self._sessions), "fleet_setting": self.fleet_setting,
                "draining": self.draining,
                **counters}

    async def stop(self, end_sessions: bool = True) -> None:
        """Drain this worker (it is being removed: ``dpex fleet scale`` or ``stop``):
        take no new session (trainers choose by ``fleet_stats``; one that chose it
        before has its session ended at once, and moves it), and with ``end_sessions``
        end every session it serves (without, they run until their trainers end them)."""
        self.draining = True
        if end_sessions:
            for session in list(self._sessions):
                session.stop.set()

    def kill_session(self, worker_id: int, session_id: bytes | None = None) -> int:
        """Kill the process of worker ``worker_id``'s session (of iterator session
        ``session_id``: its trainer presumes it hung); its ``serve`` call then fails.
        How many were killed."""
        with self._lock:
            children = [c for c in self._children if c.worker_id == worker_id
                        and session_id in (None, c.session_id)]
        for child in children:
            child.kill()
        return len(children)

    def undrain(self) -> None:
        """Undo :meth:`stop`'s drain (an interrupted ``dpex fleet stop``): take new sessions."""
        self.draining = False

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self._counters["batches_sent"] += 1
            self._counters["bytes_sent"] += nbytes

    def _count_rejected(self) -> None:
        with self._lock:
            self._counters["control_rejected"] += 1

    async def serve(self, spec: WorkerSpec, stored: Parcel | None) -> None:
        """Serve one session until STOP, cancellation or silence. Raises if set-up fails
        (the worker's traffic is counted in ``fleet_stats``). A fleet's session
        (``spec.own_process``) runs in a process of its own, see
        :mod:`dpex.server._session_process`. ``stored``: the object store's copy of the
        pickled loader, or None where the trainer's memfd serves (``spec.local``)."""
        mark("serve", worker=spec.worker_id)
        if self.draining:
            return  # a clean end: the trainer moves the session to a worker that stays
        with self._lock:
            self._counters["sessions_served"] += 1
        shipped = Parcel.delivered(stored, spec.local, self.placement["node_id"])
        if spec.own_process:
            await self._serve_in_child(spec, shipped)
        else:
            await self._server().serve(spec, shipped)

    def _server(self) -> SessionServer:
        """The server of the sessions this actor runs itself (a worker that is no host:
        torch is imported here, not at the actor's start)."""
        if self._in_process is None:
            from dpex.server._session import SessionServer

            self._in_process = SessionServer(
                self.placement, self.session_timeout, self._count, self._count_rejected,
                self._sessions, self._computes)
        return self._in_process

    async def _serve_in_child(self, spec: WorkerSpec, shipped: Parcel) -> None:
        from dpex.server._session import Session

        loop = asyncio.get_running_loop()
        session = Session()
        self._sessions.add(session)
        base: ForkBase | None = None
        child: SessionProcess | None = None
        use: int | None = None  # (a fleet's: the node's base is not stopped under it)
        try:
            if self._node is not None and spec.shipment is not None:
                use = await loop.run_in_executor(None, self._node.use, spec.shipment)
            self._bases.forget(spec.replaces)  # a changed dataset's: not kept idle
            self._starter.learn(spec.libraries)  # (its base forks from them, imported)
            base, child = await self._fork_child(spec, shipped)
            await child.wait(session.stop)
        finally:  # also when cancelled: the trainer ended the session
            self._sessions.discard(session)
            # One shielded clean-up: a cancel that lands while the child stops (its
            # trainer ended the session as the fleet drained it) must not skip the rest,
            # or the child stays listed and this worker is never idle again.
            await asyncio.shield(self._end_child(child, base, use))
        child.raise_outcome()

    async def _fork_child(self, spec: WorkerSpec, shipped: Parcel
                          ) -> tuple[ForkBase | None, SessionProcess]:
        """The session's started child and the base it was forked from (counted as used).
        A base that is gone when the child forks (another fleet worker's, whose owner
        was stopped as the fleet shrank; one killed) is marked so and another started
        from ``shipped``, which is kept until the child is forked."""
        loop = asyncio.get_running_loop()
        view = self._ray_view  # (a fleet's session: its trainer's namespace)
        if view is not None and view.namespace is None and spec.namespace is not None:
            view = view._replace(namespace=spec.namespace)
        for attempt in range(_FORK_TRIES):
            try:
                base = await self._bases.base_for(spec.shipment, shipped)
            except LookupError as exc:
                raise WorkerStartupError(str(exc)) from None
            child = SessionProcess(SessionWorker, spec, shipped, self.placement,
                                   self.session_timeout, view, base)
            with self._lock:
                self._children.add(child)
            try:
                await loop.run_in_executor(None, child.start)
                break
            except BaseException as exc:
                # (shielded: a cancel lands while start runs on its thread; stop waits)
                await asyncio.shield(self._end_child(child, base, None))
                gone = isinstance(exc, _BASE_GONE)
                if not gone or base is None or attempt == _FORK_TRIES - 1:
                    raise
                base.mark_gone()
                logger.info("dpex: the fork base (pid %s) of worker %s's session is gone "
                            "(%s: %s); starting another", base.pid, spec.worker_id,
                            type(exc).__name__, exc)
        if base is not None:
            shipped.drop()  # the base holds it: this call keeps no view of it
        return base, child

    async def _end_child(self, child: SessionProcess | None, base: ForkBase | None,
                         use: int | None) -> None:
        if child is not None:
            await asyncio.get_running_loop().run_in_executor(None, child.stop)
            with self._lock:
                self._children.discard(child)
                for name, n in child.counters().items():
                    self._counters[name] += n
        self._bases.release(base)
        if use is not None:
            self._node.unuse(use)
