"""The runtime under one iterator: its loop thread, session and workers, driven by its
scheduler.

:class:`EpochDriver` owns what an iterator started (:class:`Runtime`: the loop thread,
the trainer's session, the worker group) and the :class:`EpochScheduler` that decides
what happens to them. It carries out every action the scheduler returns, runs the
event pump of the training thread (batches read from the session's data socket,
events from the loop thread and Ray on the handoff, deadlines) and, on a fatal
event, stops everything in one place before it raises (:meth:`EpochDriver._fail`).
Batches and tasks never cross to the loop thread: the training thread reads the one
and sends the other on the session's sockets itself (one hop, :mod:`._session`).
The iterator (``_iterator.py``) keeps torch's face. Elastic workers are composed in
(:class:`~dpex.client._elastic.Elastic`), as is ``state_dict()``'s RNG query
(:class:`~dpex.client._rng_query.RngQuery`).

Every method runs on the training thread (the scheduler is that thread's alone),
except :meth:`Elastic.scale_to` called from another thread, which only leaves a
request for the training thread.
"""

from __future__ import annotations

import dataclasses
import logging
import os
import queue
import time
import warnings
import weakref
from collections.abc import Callable
from typing import Any, NoReturn

from dpex._config import DpexConfig
from dpex._event_loop import LoopThread
from dpex._shm import RingRef
from dpex._spec import WorkerSpec
from dpex._start_trace import mark
from dpex._version import local_versions
from dpex.client._deadlines import Deadlines, Due
from dpex.client._elastic import Elastic
from dpex.client._events import (
    Handoff,
    LoopFailure,
    RngReply,
    WorkerExit,
    WorkerHello,
    WorkerProgress,
)
from dpex.client._interrupts import held, interruptible
from dpex.client._launch import LaunchPlan
from dpex.client._rng_query import RngQuery
from dpex.client._runtime import Runtime, Seeds
from dpex.client._scheduler import (
    Control,
    EpochScheduler,
    Fatal,
    KillWorker,
    SendTasks,
    StartReplacement,
    StartWorker,
    StopWorker,
)
from dpex.client._session import TrainerSession
from dpex.client._shipment import Shipment
from dpex.client._worker_table import exit_error
from dpex.errors import (
    DpexError,
    EventLoopError,
    IteratorClosedError,
    PlacementWarning,
    WorkerHungError,
    WorkerStartupError,
)

__all__ = ["EpochDriver"]

# How often a wait with no timeout wakes up to check that the loop thread lives.
_POLL_S = 5.0
# How long workers may take to start before dpex checks whether they wait for resources.
_PLACEMENT_GRACE_S = 2.0
# A worker silent this long (and at least lost.FACTOR x its usual time per batch) while
# it holds tasks has lost them, unless DpexDataLoader(lost_batch_timeout=...) says otherwise.
_LOST_FLOOR_S = 10.0
_LOST_FLOOR_ITERABLE_S = 60.0  # its worker is replaced, not just asked again: be patient
_LOST_CHECK_S = 1.0  # how often the training thread looks for lost batches while it waits
logger = logging.getLogger("dpex")


class EpochDriver:
    """One iterator's runtime and scheduler (see the module's docstring).

    ``runtime`` is started by the driver, which owns it from then on (it closes it when
    its own start fails); ``ship()`` gives the iterator's ``Shipment``. No Ray call of
    its own but ``free_resources`` for an error message: tests drive it in memory.
    ``on_stop`` is called (weakly: the iterator's bound method) whenever the driver
    stops everything itself before it raises: the iterator keeps its final counters."""

    def __init__(self, runtime: Runtime, handoff: Handoff, config: DpexConfig,
                 plan: LaunchPlan, seeds: Seeds, *, ship: Callable[[], Shipment],
                 node_id: str, prefetch_factor: int, in_order: bool,
                 iterable: bool, timeout: float, on_stop: Callable[[], None],
                 on_scaled: Callable[[int], None],
                 free_resources: Callable[[], dict]) -> None:
        self.runtime, self.handoff = runtime, handoff
        self.timeout, self.startup_timeout = timeout, config.startup_timeout
        self.start_count = plan.num_workers
        self._on_stop = weakref.WeakMethod(on_stop)
        self._ring_bytes, self._node_id = config.shm_ring_bytes, node_id
        self._free_resources = free_resources
        self.rng_query = RngQuery()  # (state_dict()'s: the replies come through here)
        self._wait_from: float | None = None  # when the wait for the next event began
        # (first: each worker's record, made there, holds the spec the driver starts it with)
        self.sched = EpochScheduler(
            plan.num_workers, prefetch_factor, in_order=in_order, iterable=iterable,
            max_restarts=config.max_worker_restarts, lost_timeout=config.lost_batch_timeout,
            lost_floor=_LOST_FLOOR_ITERABLE_S if iterable else _LOST_FLOOR_S,
            first_batch_timeout=config.startup_timeout,  # (its loading counts)
            hung_timeout=config.hung_batch_timeout, straggler_timeout=config.straggler_timeout)
        try:
            mark("ship")
            self.shipment = ship()  # (kept: replacements load the same bytes)
            mark("shipped", bytes=self.shipment.size)
            runtime.open()
            for rec in self.sched.workers.records:
                rec.spec = WorkerSpec(
                    wire=self.session.wire, worker_id=rec.id,
                    num_workers=plan.num_workers, base_seed=seeds.base,
                    data_address=self.session.data_address,
                    control_address=self.session.control_address,
                    keys=self.session.keys.client,
                    niceness=os.getpriority(os.PRIO_PROCESS, 0),
                    shared_seed=seeds.shared, ring=self.new_ring(rec.id),
                    own_process=config.worker_pool is not None,
                    rng_state=plan.rng_state(rec.id), rng_keep=plan.rng_keep,
                    batch_seeds=plan.batch_seeds, sample_seed=plan.sample_seed,
                    replaces=self.shipment.replaced, shipment=self.shipment.digest,
                    libraries=self.shipment.libraries)
            self.deadlines = Deadlines(  # (from here: pickling is no worker's start-up)
                time.monotonic(), timeout=timeout, startup_timeout=config.startup_timeout,
                lost_every=_LOST_CHECK_S, placement_grace=_PLACEMENT_GRACE_S, poll=_POLL_S)
            runtime.start(self.specs, self.shipment)
            mark("workers asked")
        except BaseException:
            runtime.close()
            raise
        self.shared_seed = seeds.shared  # what a replacement starts with (this epoch's)
        # The training loop's waits: this epoch's, and over the driver's life (the
        # autoscaler's measure).
        self.wait_s, self.waited_total, self.taken_total = 0.0, 0.0, 0
        self.elastic = Elastic(self, plan.autoscale, iterable, on_scaled)

    @property
    def closed(self) -> bool:
        return self.runtime.closed

    @property
    def session(self) -> TrainerSession:
        return self.runtime.session

    @property
    def loop(self) -> LoopThread:
        return self.runtime.loop

    @property
    def specs(self) -> list[WorkerSpec]:
        """Each worker id's spec, its current incarnation's (on its record)."""
        return [rec.spec for rec in self.sched.workers.records]

    # -- epochs and batches ----------------------------------------------------

    def start_epoch(self, draw: Callable[[], Any], *, shared_seed: Any, first_worker: int,
                    ended: frozenset, skips: dict[int, int]) -> None:
        """Begin an epoch: ``shared_seed`` (torch's, drawn for it) is also what a
        replacement starts with; the RESUME payload is the IterDataPipe seed."""
        self.shared_seed = shared_seed
        self.wait_s = 0.0
        self.elastic.begin()
        self.apply(self.sched.start_epoch(draw, resume=shared_seed, first_worker=first_worker,
                                          ended=ended, skips=skips))

    def next_message(self, draw: Callable[[], Any]) -> Any:
        """The next message of the epoch in order (EPOCH_END at its end), drawing
        index batches with ``draw`` as credits allow; waits (and recovers) as needed."""
        with held(keep_on_return=True):  # (Ctrl-C: raised in the waits only)
            self.elastic.on_training_thread()
            while True:
                self.elastic.tick(draw)
                msg, actions = self.sched.take(draw)
                self.apply(actions)
                if msg is not None:
                    return msg
                waited = time.monotonic()
                try:
                    self.receive_one()
                finally:
                    waited = time.monotonic() - waited
                    self.wait_s, self.waited_total = self.wait_s + waited, self.waited_total + waited

    def apply(self, actions: list[Any]) -> None:
        """Carry out the scheduler's actions, in its order; the messages among them are
        sent together, from this thread."""
        messages: list[SendTasks | Control] = []
        for action in actions:
            if isinstance(action, (SendTasks, Control)):
                messages.append(action)
                continue
            if messages:
                self._send(messages)
                messages = []
            if isinstance(action, StartReplacement):
                self._start_replacement(action.worker_id, action.incarnation)
            elif isinstance(action, StartWorker):
                self.elastic.start_worker(action.worker_id)
            elif isinstance(action, StopWorker):
                self.elastic.stop_worker(action.worker_id)
            elif isinstance(action, KillWorker):
                self._kill(action)
            elif isinstance(action, Fatal):
                self._fail(WorkerHungError(self.sched.workers[action.worker_id].describe()
                                           + " was " + action.hung))
            else:
                raise AssertionError(f"unknown scheduler action {action!r}")
        if messages:
            self._send(messages)

    def _send(self, messages: list[Any]) -> None:
        """Send them on the control socket; a failure stops everything (a loop's would)."""
        try:
            self.session.send_all(messages)
        except DpexError as exc:  # e.g. a task over max_message_bytes: it says what
            self._fail(exc)
        except Exception as exc:
            self._fail(EventLoopError(f"sending tasks failed: {exc!r}"), exc)

    def _fail(self, error: BaseException, cause: BaseException | None = None) -> NoReturn:
        """Stop everything (the iterator keeps its counters), then raise ``error``."""
        self.stop()
        if cause is not None:
            raise error from cause
        raise error

    def stop(self) -> None:
        """Stop workers, sockets and thread through the iterator (it keeps its final
        counters), or directly if the iterator is gone."""
        on_stop = self._on_stop()
        (on_stop if on_stop is not None else self.runtime.close)()

    # -- the event pump ---------------------------------------------------------

    @property
    def ready(self) -> dict[int, dict]:
        """The HELLO of each worker whose current incarnation is ready."""
        return self.sched.workers.ready_infos()

    @property
    def known(self) -> dict[int, dict]:
        """The last HELLO of each worker id (any incarnation)."""
        return self.sched.workers.known_infos()

    def receive_one(self, until: float | None = None) -> None:
        """Wait for one event from the loop thread or Ray and apply it (or, with
        ``until``, for none past that monotonic time)."""
        if self.runtime.closed:
            raise IteratorClosedError("this dpex iterator was closed; iterate the loader again")
        if self.deadlines.lost_due(time.monotonic()):
            # What arrived while this thread was away (a long step) first: no worker is
            # judged on input not drained; then no wait (the batch may be among it).
            drained = False
            while (arrived := self._arrived()) is not None:
                drained = True
                if not isinstance(arrived, WorkerProgress):  # (as _wait_event counts)
                    self._wait_from = None
                self._apply_event(arrived)
            self._check_lost()
            if drained:
                return
        event = self._wait_event(until)
        if event is not None:
            self._apply_event(event)

    def _arrived(self) -> Any:
        """The next event here (the handoff's, then the data socket's), or None."""
        try:
            return self.handoff.get_nowait()
        except queue.Empty:
            return self.session.receive() or None

    def _apply_event(self, event: Any) -> None:
        if isinstance(event, list):  # data messages that arrived together
            self.apply(self.sched.results(event))
        elif isinstance(event, WorkerHello):
            self._on_hello(event)
        elif isinstance(event, WorkerExit):
            self._on_exit(event)
        elif isinstance(event, WorkerProgress):
            self.apply(self.sched.progress(event.worker_id, event.incarnation, event.epoch,
                                           event.seq, event.working_s, event.queued, event.at))
        elif isinstance(event, RngReply):
            self.rng_query.reply(event)
        elif isinstance(event, LoopFailure):
            if isinstance(event.error, DpexError):  # one of dpex's own: it says what
                self._fail(event.error)
            self._fail(EventLoopError(f"the dpex event loop failed: {event.error!r}"),
                       event.error)

    def _wait_event(self, until: float | None = None) -> Any:
        """The next event, within torch's ``timeout`` (``startup_timeout`` while workers
        start); None once ``until`` (a monotonic time) has passed without one."""
        starting = not self.sched.workers.all_ready()
        if self._wait_from is None:
            self._wait_from = time.monotonic()
        deadline = self.deadlines.wait_deadline(self._wait_from, starting)
        event = self._next_event(deadline, starting, until)
        if not isinstance(event, WorkerProgress):  # (a report every second is no batch)
            self._wait_from = None
        return event

    def _next_event(self, deadline: float | None, starting: bool,
                    until: float | None) -> Any:
        """The next event: the handoff's first (a HELLO precedes its worker's batches
        there), then the batches that have arrived; else wait for either."""
        while True:
            arrived = self._arrived()  # what already arrived counts, however late
            if arrived is not None:  # this thread came to look
                return arrived
            due, wait = self.deadlines.next(time.monotonic(), deadline, starting, until)
            if due is Due.STARTUP_TIMED_OUT:
                self._fail(self._startup_failure())
            if due is Due.TIMED_OUT:
                raise RuntimeError(f"DataLoader timed out after {self.timeout} seconds")
            if due is Due.UNTIL:
                return None
            if due is Due.LOST_CHECK:
                self._check_lost()
                continue
            if due is Due.PLACEMENT_CHECK:
                self._check_placement()
                continue
            with interruptible():  # (nothing is half done here)
                self.session.wait(wait)
            if self.runtime.closed:
                raise IteratorClosedError("this dpex iterator was closed; iterate the loader again")
            if not self.loop.running:
                raise EventLoopError("the dpex event-loop thread stopped unexpectedly")

    def _check_lost(self) -> None:
        self.deadlines.lost_checked(time.monotonic())
        self.apply(self.sched.check_lost())
        self.elastic.give_up_unstarted()

    def _on_hello(self, hello: WorkerHello) -> None:
        theirs, ours = hello.info.get("versions"), local_versions()
        if theirs != ours:
            self._fail(WorkerStartupError(
                f"dpex worker {hello.worker_id} on node {hello.info.get('node_ip')} runs "
                f"{theirs}, but this trainer runs {ours}: install the same Python and dpex "
                "versions on every node"
            ))
        self.apply(self.sched.ready(hello.worker_id, hello.info))
        started = sum(rec.known is not None for rec in self.sched.workers.records)
        if started >= self.start_count:  # each read the dataset: let it go
            self.shipment.release_local()

    def _on_exit(self, exit_: WorkerExit) -> None:
        if self.runtime.closed:
            return
        w = exit_.worker_id
        cause = getattr(exit_.error, "cause", None) or exit_.error  # a RayTaskError's own
        # Its host could not use the trainer's memfd: it starts again from the store.
        undelivered = self.shipment.undelivered(cause)
        actions = self.sched.exited(
            w, exit_.incarnation, startup_error=isinstance(cause, WorkerStartupError),
            unplaced=exit_.unplaced or undelivered,  # (the group's report: placed again)
            cause=type(cause).__name__ if exit_.error is not None else "session ended",
            at=exit_.at, moved=exit_.moved or undelivered)  # (not a death of its own)
        fatal = next((a for a in actions if isinstance(a, Fatal)), None)
        if fatal is None:
            try:
                self.apply(actions)
            except BaseException:  # e.g. the fleet is gone: nowhere to restart
                self.stop()
                raise
            return
        self._fail(exit_error(self.sched.workers[w], startup=fatal.startup, cause=cause,
                              max_restarts=self.sched.max_restarts), exit_.error)

    def _kill(self, kill: KillWorker) -> None:
        """Kill a worker dpex presumes broken (it is replaced), and say so."""
        logger.warning("%s: %s; it is replaced", self.sched.workers[kill.worker_id].describe(),
                       kill.reason())
        self.runtime.workers.kill(kill.worker_id)

    def _check_placement(self) -> None:
        """Once per start-up: warn if the workers still missing wait for resources
        that the cluster does not have free (they reserve some; by default none)."""
        self.deadlines.placement_checked()
        missing = sorted(set(range(self.start_count)) - set(self.ready))
        message = self.runtime.workers.placement_warning(missing)
        if message:
            logger.warning(message)
            warnings.warn(message, PlacementWarning, stacklevel=2)

    def _startup_failure(self) -> WorkerStartupError:
        missing = sorted(set(range(self.start_count)) - set(self.ready))
        resources = self._free_resources()
        return WorkerStartupError(
            f"dpex workers {missing} did not start within startup_timeout="
            f"{self.startup_timeout:g} s (actor options {self.runtime.workers.options}; "
            f"resources free now: {resources}). Is the cluster busy or too small?"
        )

    # -- starting and stopping workers -------------------------------------------

    def new_ring(self, worker_id: int) -> RingRef | None:
        """A shared-memory ring for one worker (used only if it lands on this node)."""
        if not self._ring_bytes:
            return None
        try:
            return self.session.new_ring(self._ring_bytes, self._node_id, worker_id)
        except OSError:  # no memfd here (or out of memory): that worker uses the socket
            return None

    def _start_replacement(self, w: int, incarnation: int) -> None:
        """A replacement, same worker id (its seed; worker_init_fn run again)."""
        self.deadlines.starting(time.monotonic())
        rec = self.sched.workers[w]
        if rec.spec.ring is not None:
            self.session.retire_ring(rec.spec.ring.ring_id)
        if rec.added:  # (an added worker's replacement: its own start time)
            rec.started_at = time.monotonic()
        rec.spec = dataclasses.replace(
            rec.spec, incarnation=incarnation,
            shared_seed=self.shared_seed, ring=self.new_ring(w),
            # The saved states belong to the resumed epoch; later a worker starts anew.
            rng_state=rec.spec.rng_state if self.sched.epoch == 1 else None)
        self.session.expect(w, rec.spec.incarnation)
        self.runtime.workers.restart(rec.spec, self.shipment)

    # -- state_dict() --------------------------------------------------------------

    def worker_rng_states(self, asked: dict[int, tuple[int, int]], limit: float | None = None
                          ) -> dict[int, dict | None] | None:
        """Each worker's RNG states right after the batch ``asked`` names, for
        ``state_dict()`` (see :meth:`RngQuery.ask`)."""
        return self.rng_query.ask(self, asked, limit)
