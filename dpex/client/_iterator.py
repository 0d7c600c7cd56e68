"""The synchronous iterator a training loop sees, over the asyncio core.

The sampler stays here, on the training thread, drawn lazily as credits allow
(exactly where torch draws it). Tasks go to the loop thread with one
``call_soon``; results come back on one thread-safe queue, are placed in the
ordering buffer and released in sequence order.
"""

from __future__ import annotations

import dataclasses
import functools
import hashlib
import itertools
import logging
import os
import queue
import threading
import time
import traceback
import warnings
import weakref
from typing import Any

import ray
from torch.utils.data import IterDataPipe, MapDataPipe, _DatasetKind, _utils
from torch.utils.data.dataloader import _BaseDataLoaderIter, _sharding_worker_init_fn

from dpex._addresses import node_address
from dpex._config import DpexConfig
from dpex._event_loop import LoopThread
from dpex._protocol import Kind, Wire
from dpex._ray_connect import connect_ray
from dpex._reaper import finalizer_for
from dpex._security import wire_security
from dpex._shm import RingRef
from dpex._spec import ShippedLoader, WorkerSpec, stateful_dataset
from dpex._stats import Latencies, LoaderStats
from dpex._version import local_versions
from dpex.client._autoscaler import Autoscaler
from dpex.client._deadlines import Deadlines, Due
from dpex.client._elastic import ElasticWorkers, mean
from dpex.client._events import LoopFailure, RngReply, WorkerExit, WorkerHello
from dpex.client._launch import plan_launch
from dpex.client._resume import Drawing
from dpex.client._scheduler import (
    EPOCH_END,
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
from dpex.client._shipping import ship_loader
from dpex.client._taken import TakenRecord
from dpex.client._workers import FleetGroup, WorkerGroup, WorkerProcess
from dpex.errors import (
    DpexError,
    DpexTimeoutError,
    EventLoopError,
    IteratorClosedError,
    PlacementWarning,
    ResumeStateError,
    WorkerDiedError,
    WorkerStartupError,
)

__all__ = ["RayDataLoaderIter"]

# How often a wait with no timeout wakes up to check that the loop thread lives.
_POLL_S = 5.0
# How long workers may take to start before dpex checks whether they wait for resources.
_PLACEMENT_GRACE_S = 2.0
# A worker silent this long (and at least lost.FACTOR x its usual time per batch) while
# it holds tasks has lost them, unless DpexDataLoader(lost_batch_timeout=...) says otherwise.
_LOST_FLOOR_S = 10.0
_LOST_FLOOR_ITERABLE_S = 60.0  # its worker is replaced, not just asked again: be patient
_LOST_CHECK_S = 1.0  # how often the training thread looks for lost batches while it waits
_RNG_QUERY_S = 30.0  # how long state_dict() waits for the workers' RNG states
logger = logging.getLogger("dpex")
_iterator_ids = itertools.count()


class _Runtime:
    """Everything one iterator started: loop thread, sockets, actors. Idempotent close."""

    def __init__(self, name: str, handoff: queue.SimpleQueue, config: DpexConfig,
                 label: str, worker_class: type) -> None:
        host = node_address()  # may raise: before anything that needs closing exists
        self.loop = LoopThread(name, on_error=lambda exc: handoff.put(LoopFailure(exc)))
        self.session = TrainerSession(Wire.new(config.max_message_bytes), host, handoff,
                                      wire_security(config.encryption))
        self.workers: WorkerGroup | FleetGroup = (
            FleetGroup(config.worker_pool, handoff, config.startup_timeout) if config.worker_pool
            else WorkerGroup(worker_class, config.ray_remote_args, handoff, label,
                             keep_s=config.warm_worker_timeout))
        self.closed = False

    def open(self) -> None:
        # Generous: the garbage collector may run other objects' finalizers on the new
        # thread before its loop starts; a torch iterator kept by a reference cycle (an
        # exception's traceback) joins its worker processes there, 5 s each.
        self.loop.start(timeout=60.0)
        self.loop.run(self.session.open(), timeout=60.0)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.workers.stop()
        self.loop.stop(cleanup=self.session.close)


def _ship(loader: Any, shipped: bytes) -> tuple[Any, bool]:
    """The object store's copy of ``shipped`` (kept: replacements load the same object),
    and whether it is the loader's previous iterator's (the same bytes: its workers'
    nodes hold it already, nothing is put or moved again)."""
    digest = hashlib.blake2b(shipped, digest_size=16).digest()
    previous = getattr(loader, "_shipped", None)
    if previous is not None and previous[0] == digest:
        return previous[1], True
    ref = ray.put(shipped)
    loader._shipped = (digest, ref)
    return ref, False


class RayDataLoaderIter(ElasticWorkers, _BaseDataLoaderIter):
    """Iterator of a ``DpexDataLoader`` with ``distribute_mode=True, num_workers > 0``;
    ``worker_class`` is the Ray actor class its own workers run (``DpexWorker``)."""

    def __init__(self, loader: Any, config: DpexConfig, worker_class: type) -> None:
        super().__init__(loader)
        self._loader_ref = weakref.ref(loader)
        # How many workers, which one takes the first batch, what each starts from and
        # how batches are seeded: decided in one pure function (_launch.py).
        plan = plan_launch(
            num_workers=loader.num_workers, scaled_to=loader.__dict__.get("_autoscale_workers"),
            prefetch_factor=loader.prefetch_factor,
            iterable=self._dataset_kind == _DatasetKind.Iterable,
            worker_seeding=config.worker_seeding, resume=loader.__dict__.get("_resume_plan"))
        self._launch = plan
        self._num_workers = plan.num_workers
        self._prefetch_factor = loader.prefetch_factor
        self._in_order = loader.in_order
        self._startup_timeout = config.startup_timeout
        connect_ray(config.head_address)
        worker_init_fn = loader.worker_init_fn
        if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):
            # As torch: DataPipes are sharded across ranks and workers before worker_init_fn.
            worker_init_fn = functools.partial(
                _sharding_worker_init_fn, worker_init_fn, self._world_size, self._rank)
        shipped = ship_loader(ShippedLoader(
            dataset=self._dataset, dataset_kind=self._dataset_kind,
            auto_collation=self._auto_collation, collate_fn=self._collate_fn,
            drop_last=self._drop_last, worker_init_fn=worker_init_fn,
        ))
        self._handoff: queue.SimpleQueue = queue.SimpleQueue()
        number = next(_iterator_ids)
        label = f"iterator {number} of a DpexDataLoader over {type(self._dataset).__name__}"
        self._runtime = _Runtime(f"dpex-loop-{number}", self._handoff, config, label,
                                 worker_class)
        # Dropped without being closed: torn down on dpex's reaper thread (see _reaper).
        self._finalizer = weakref.finalize(self, finalizer_for(self._runtime.close))
        self._session = self._runtime.session
        self._loop = self._runtime.loop
        self._ring_bytes = config.shm_ring_bytes
        self._node_id = ray.get_runtime_context().get_node_id()
        # Resuming: an IterableDataset's workers also pass over what they delivered
        # before (or load their dataset's own state), and those whose shards ended stay
        # ended.
        self._resume_first_worker = plan.first_worker
        iterable = self._dataset_kind == _DatasetKind.Iterable
        self._taken = TakenRecord(self._num_workers, iterable,
                                  iterable and stateful_dataset(self._dataset), plan.shards)
        self._rng_replies: dict[tuple[int, int, int], RngReply] = {}  # (worker, epoch, seq)
        try:
            self._runtime.open()
            self._specs = [
                WorkerSpec(
                    wire=self._session.wire, worker_id=w,
                    num_workers=self._num_workers, base_seed=self._base_seed,
                    data_address=self._session.data_address,
                    control_address=self._session.control_address,
                    keys=self._session.keys.client,
                    niceness=os.getpriority(os.PRIO_PROCESS, 0),
                    shared_seed=self._shared_seed, ring=self._new_ring(w),
                    pooled=config.worker_pool is not None,
                    rng_state=plan.rng_state(w), rng_keep=plan.rng_keep,
                    batch_seeds=plan.batch_seeds,
                )
                for w in range(self._num_workers)
            ]
            self._deadlines = Deadlines(
                time.monotonic(), timeout=self._timeout, startup_timeout=self._startup_timeout,
                lost_every=_LOST_CHECK_S, placement_grace=_PLACEMENT_GRACE_S, poll=_POLL_S)
            self._shipped, self._shipped_reused = _ship(loader, shipped)
            self._shipped_bytes = len(shipped)
            self._runtime.workers.start(self._specs, self._shipped)
        except BaseException:
            self._runtime.close()
            raise
        self._worker_shared_seed = self._shared_seed  # what a replacement starts with
        self._sched = EpochScheduler(
            self._num_workers, self._prefetch_factor, in_order=self._in_order,
            iterable=self._dataset_kind == _DatasetKind.Iterable,
            max_restarts=config.max_worker_restarts, lost_timeout=config.lost_batch_timeout,
            lost_floor=_LOST_FLOOR_ITERABLE_S if self._dataset_kind == _DatasetKind.Iterable
            else _LOST_FLOOR_S,
            first_batch_timeout=config.startup_timeout)  # (its loading counts)
        self._added_at: dict[int, float] = {}
        self._waited_total, self._taken_total = 0.0, 0  # over the iterator's life
        self._autoscaler: Autoscaler | None = None
        self._training_thread, self._scale_request = threading.get_ident(), None
        if plan.autoscale is not None:
            policy = plan.autoscale
            most = policy.max or max(1, int(ray.cluster_resources().get("CPU", 1)))
            self._autoscaler = Autoscaler(policy, most, time.monotonic())
        self._reset(loader, first_iter=True)

    # -- epochs and dispatch -------------------------------------------------

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        if not first_iter:
            if self._runtime.closed:
                raise IteratorClosedError("this dpex iterator was closed; iterate the loader again")
            self._worker_shared_seed = self._shared_seed
        self._epoch_t0, self._epoch_end, self._wait_s = time.monotonic(), None, 0.0
        self._latencies = Latencies()  # this epoch's, as the wait
        if self._autoscaler is not None:  # (the time between epochs is not the loop's)
            self._autoscaler.begin(self._epoch_t0, self._waited_total, self._taken_total)
        # The RESUME payload is the IterDataPipe seed of the new epoch (None otherwise).
        first_worker, self._resume_first_worker = self._resume_first_worker, 0
        self._taken.new_epoch()
        # A worker passes over what it delivered, unless it resumes its dataset's own state.
        skips = {w: n for w, n in self._taken.count.items()
                 if "dataset" not in (self._specs[w].rng_state or {})}
        self._apply(self._sched.start_epoch(
            self._next_index, resume=self._shared_seed, first_worker=first_worker,
            ended=frozenset(self._taken.ended), skips=skips))

    def _apply(self, actions: list[Any]) -> None:
        """Carry out the scheduler's actions, in its order; the messages among them go
        to the loop thread together (one wake-up)."""
        messages: list[SendTasks | Control] = []
        for action in actions:
            if isinstance(action, (SendTasks, Control)):
                messages.append(action)
                continue
            if messages:
                self._loop.call_soon(self._session.send_all, messages)
                messages = []
            if isinstance(action, StartReplacement):
                self._start_replacement(action.worker_id, action.incarnation)
            elif isinstance(action, StartWorker):
                self._start_worker(action.worker_id)
            elif isinstance(action, StopWorker):
                self._stop_worker(action.worker_id)
            elif isinstance(action, KillWorker):
                self._runtime.workers.kill(action.worker_id)
            else:
                raise AssertionError(f"unknown scheduler action {action!r}")
        if messages:
            self._loop.call_soon(self._session.send_all, messages)

    @property
    def _epoch(self) -> int:
        return self._sched.epoch

    @property
    def _ready(self) -> dict[int, dict]:
        """The HELLO of each worker whose current incarnation is ready."""
        return self._sched.workers.ready_infos()

    @property
    def _known(self) -> dict[int, dict]:
        """The last HELLO of each worker id (any incarnation)."""
        return self._sched.workers.known_infos()

    # -- consuming -------------------------------------------------------------

    def __next__(self) -> Any:
        try:
            data = super().__next__()
            drawing = self._sampler_iter
            if isinstance(drawing, Drawing):  # (what state_dict() may still ask for)
                drawing.yielded(self._num_yielded + drawing.skipped)
            return data
        except StopIteration:
            raise
        except BaseException as exc:
            # The traceback holds every frame below this one and each of them holds this
            # iterator, so it would live (with its workers) as long as the exception is
            # kept. Clearing their locals releases an iterator that nothing else refers
            # to (a `for` loop's, once the error has left the loop) at once, as a dropped
            # iterator is; one the caller still holds goes on, as torch's does.
            traceback.clear_frames(exc.__traceback__)
            del self
            raise

    def _next_data(self) -> Any:
        if self._runtime.closed and self._epoch_end is None:  # an ended epoch stays ended
            raise IteratorClosedError("this dpex iterator was closed; iterate the loader again")
        self._training_thread = threading.get_ident()
        while True:
            if self._scale_request is not None:
                self._scale_as_requested()
            if self._autoscaler is not None:
                self._autoscale()
            msg, actions = self._sched.take(self._next_index)
            self._apply(actions)
            if msg is EPOCH_END:
                self._epoch_end = time.monotonic()
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration
            if msg is None:
                waited = time.monotonic()
                try:
                    self._receive_one()
                finally:
                    waited = time.monotonic() - waited
                    self._wait_s += waited
                    self._waited_total += waited
                continue
            self._taken.took(msg)
            if msg.kind is Kind.END:
                continue
            if msg.kind is Kind.ERROR:
                msg.payload.reraise()
            data = msg.payload
            self._taken_total += 1
            if self._pin_memory:
                data = _utils.pin_memory.pin_memory(data, self._pin_memory_device)
            self._latencies.add(msg.ready_ns, time.time_ns())
            return data

    def _receive_one(self, until: float | None = None) -> None:
        """Wait for one event from the loop thread or Ray and apply it (or, with
        ``until``, for none past that monotonic time)."""
        if self._runtime.closed:
            raise IteratorClosedError("this dpex iterator was closed; iterate the loader again")
        if self._deadlines.lost_due(time.monotonic()):
            self._check_lost()
        event = self._wait_event(until)
        if event is None:
            return
        if isinstance(event, list):  # data messages that arrived together
            self._apply(self._sched.results(event))
        elif isinstance(event, WorkerHello):
            self._on_hello(event)
        elif isinstance(event, WorkerExit):
            self._on_exit(event)
        elif isinstance(event, RngReply):
            self._rng_replies[(event.worker_id, event.epoch, event.seq)] = event
        elif isinstance(event, LoopFailure):
            self._shutdown_workers()
            if isinstance(event.error, DpexError):  # one of dpex's own: it says what
                raise event.error
            raise EventLoopError(f"the dpex event loop failed: {event.error!r}") from event.error

    def _wait_event(self, until: float | None = None) -> Any:
        """The next event, within torch's ``timeout`` (or ``startup_timeout`` while
        workers start); with no timeout, wake every few seconds to check the loop lives.
        None once ``until`` (a monotonic time) has passed without one."""
        starting = not self._sched.workers.all_ready()
        deadline = self._deadlines.wait_deadline(time.monotonic(), starting)
        while True:
            try:  # what already arrived counts, however late this thread came to look
                return self._handoff.get_nowait()
            except queue.Empty:
                pass
            due, wait = self._deadlines.next(time.monotonic(), deadline, starting, until)
            if due is Due.STARTUP_TIMED_OUT:
                raise self._startup_failure()
            if due is Due.TIMED_OUT:
                raise RuntimeError(f"DataLoader timed out after {self._timeout} seconds")
            if due is Due.UNTIL:
                return None
            if due is Due.LOST_CHECK:
                self._check_lost()
                continue
            if due is Due.PLACEMENT_CHECK:
                self._check_placement()
                continue
            try:
                return self._handoff.get(timeout=wait)
            except queue.Empty:
                pass
            if not self._loop.running:
                raise EventLoopError("the dpex event-loop thread stopped unexpectedly")

    def _check_lost(self) -> None:
        self._deadlines.lost_checked(time.monotonic())
        self._apply(self._sched.check_lost())
        self._give_up_unstarted()

    def _on_hello(self, hello: WorkerHello) -> None:
        theirs, ours = hello.info.get("versions"), local_versions()
        if theirs != ours:
            self._shutdown_workers()
            raise WorkerStartupError(
                f"dpex worker {hello.worker_id} on node {hello.info.get('node_ip')} runs "
                f"{theirs}, but this trainer runs {ours}: install the same Python and dpex "
                "versions on every node"
            )
        self._apply(self._sched.ready(hello.worker_id, hello.info))

    def _on_exit(self, exit_: WorkerExit) -> None:
        if self._runtime.closed:
            return
        w = exit_.worker_id
        cause = getattr(exit_.error, "cause", None) or exit_.error  # a RayTaskError's own
        actions = self._sched.exited(
            w, exit_.incarnation, startup_error=isinstance(cause, WorkerStartupError),
            # A worker never placed because its node went away is placed again, like a death.
            unplaced=isinstance(cause, ray.exceptions.ActorUnschedulableError) or (
                exit_.error is None and isinstance(self._runtime.workers, FleetGroup)),
            cause=type(cause).__name__ if exit_.error is not None else "session ended",
            at=exit_.at,
            # A fleet worker ended the session cleanly (removed by `dpex fleet scale`).
            moved=exit_.error is None and isinstance(self._runtime.workers, FleetGroup))
        fatal = next((a for a in actions if isinstance(a, Fatal)), None)
        if fatal is None:
            try:
                self._apply(actions)
            except BaseException:  # e.g. the fleet is gone: nowhere to restart
                self._shutdown_workers()
                raise
            return
        self._shutdown_workers()
        where = self._known.get(w, {}).get("node_ip", "unknown node")
        if fatal.startup:
            what = str(cause) if isinstance(cause, WorkerStartupError) else (
                f"{type(cause).__name__}: {cause}")
            raise WorkerStartupError(
                f"dpex worker {exit_.worker_id} (node {where}) failed to start: {what}"
            ) from exit_.error
        pid = self._known.get(w, {}).get("pid", "?")
        restarts = self._sched.workers[w].incarnation - self._sched.workers[w].moves
        raise WorkerDiedError(
            f"dpex worker {w} (pid {pid}, node {where}) died after {restarts} "
            f"restart(s), the most max_worker_restarts={self._sched.max_restarts} allows: "
            + (f"{type(cause).__name__}: {cause}" if exit_.error is not None
               else "its session ended without an error")
        ) from exit_.error

    def resume_points(self, mid_epoch: bool) -> dict[int, tuple[int, int]]:
        """See :meth:`TakenRecord.resume_points` (none with per-batch seeding of a
        map-style dataset: its workers' RNG states say nothing about later batches)."""
        if self._launch.per_batch and self._dataset_kind != _DatasetKind.Iterable:
            return {}
        points = self._taken.resume_points(self._sched.epoch, mid_epoch)
        # a retired worker's session is gone: nobody to ask (its id resumes from its seed)
        return {w: at for w, at in points.items() if not self._sched.workers[w].gone}

    @property
    def rng_worker_count(self) -> int:
        """The worker count the workers' RNG states belong to; 0 once workers were added
        or retired (their ids no longer say which batches they make)."""
        changed = self._sched.counters["added"] or self._sched.counters["retired"]
        return 0 if changed else self._num_workers

    @property
    def epochs_served(self) -> int:
        """Epochs begun with this iterator's base seed, a resumed run's before it included."""
        return self._launch.epochs_before + self._sched.epoch

    def shard_positions(self) -> dict:
        """See :meth:`TakenRecord.shard_positions` (for ``state_dict()``)."""
        return self._taken.shard_positions(
            self._sched.ledger.worker_of(self._sched.buffer.next_seq))

    @property
    def epoch_ended(self) -> bool:
        return self._epoch_end is not None

    def worker_rng_states(self, asked: dict[int, tuple[int, int]]
                          ) -> dict[int, dict | None] | None:
        """Each worker's RNG states right after the batch ``asked`` names (for
        ``state_dict()``). A worker not asked (none of its batches was taken) has the
        states it started with: those it was resumed with, or its seeded ones (left
        out: a resumed worker gets them anyway). None for a worker that no longer has
        them (it died, or was replaced: its replacement starts from its seed)."""
        if self._runtime.closed:
            return None  # its workers are gone: nobody to ask
        self._rng_replies = {}
        incarnations = {w: self._sched.workers[w].incarnation for w in asked}
        for w, (epoch, seq) in asked.items():
            self._loop.call_soon(self._session.send, w, Kind.RNG_QUERY, epoch, seq)

        def answered(w: int) -> bool:
            return (w, *asked[w]) in self._rng_replies

        deadline = time.monotonic() + _RNG_QUERY_S
        while waiting := [w for w in asked if not answered(w)
                          and self._sched.workers[w].incarnation == incarnations[w]]:
            if time.monotonic() > deadline:
                raise DpexTimeoutError(f"state_dict(): workers {waiting} did not report their "
                                       f"RNG states within {_RNG_QUERY_S:g} s")
            self._receive_one(until=deadline)
        for w in asked:
            state = self._rng_replies[(w, *asked[w])].state if answered(w) else None
            if isinstance(state, dict) and "error" in state:  # too large to send
                raise ResumeStateError(f"state_dict(): {state['error']}")
        started = {w: spec.rng_state for w, spec in enumerate(self._specs)
                   if spec.rng_state is not None}
        return {**started, **{w: self._rng_replies[(w, *asked[w])].state if answered(w) else None
                              for w in asked}}

    def _start_replacement(self, w: int, incarnation: int) -> None:
        """Start a replacement with the same worker id (same seed, worker_init_fn run
        again); the scheduler sends it its tasks."""
        self._deadlines.starting(time.monotonic())
        old = self._specs[w].ring
        if old is not None:
            self._loop.call_soon(self._session.retire_ring, old.ring_id)
        if w in self._added_at:  # (an added worker's replacement: its own start time)
            self._added_at[w] = time.monotonic()
        self._specs[w] = spec = dataclasses.replace(
            self._specs[w], incarnation=incarnation,
            shared_seed=self._worker_shared_seed, ring=self._new_ring(w),
            # The saved states belong to the resumed epoch; later a worker starts anew.
            rng_state=self._specs[w].rng_state if self._sched.epoch == 1 else None)
        self._loop.call_soon(self._session.expect, w, spec.incarnation)
        self._runtime.workers.restart(spec, self._shipped)

    def _new_ring(self, worker_id: int) -> RingRef | None:
        """A shared-memory ring for one worker (used only if it lands on this node)."""
        if not self._ring_bytes:
            return None
        try:
            return self._session.new_ring(self._ring_bytes, self._node_id, worker_id)
        except OSError:  # no memfd here (or out of memory): that worker uses the socket
            return None

    def _check_placement(self) -> None:
        """Once per start-up: warn if the workers still missing wait for resources
        that the cluster does not have free (they reserve some; by default none)."""
        self._deadlines.placement_checked()
        missing = sorted(set(range(self._num_workers)) - set(self._ready))
        message = self._runtime.workers.placement_warning(missing)
        if message:
            logger.warning(message)
            warnings.warn(message, PlacementWarning, stacklevel=2)

    def _startup_failure(self) -> WorkerStartupError:
        missing = sorted(set(range(self._num_workers)) - set(self._ready))
        resources = ray.available_resources()
        self._shutdown_workers()
        return WorkerStartupError(
            f"dpex workers {missing} did not start within startup_timeout="
            f"{self._startup_timeout:g} s (actor options {self._runtime.workers.options}; "
            f"resources free now: {resources}). Is the cluster busy or too small?"
        )

    # -- lifecycle and introspection -------------------------------------------

    def _shutdown_workers(self) -> None:
        """Stop the actors, close the sockets and join the loop thread (idempotent);
        leave the final counters with the loader, for ``loader.stats()``. Here, on the
        training thread: an explicit end, not garbage collection."""
        self._finalizer.detach()
        self._runtime.close()
        loader = self._loader_ref()
        if loader is not None:
            loader._final_stats = self.stats()

    @property
    def _workers(self) -> list[WorkerProcess]:
        """The current worker of each id, as torch's ``_workers`` (process-like handles)."""
        workers = self._runtime.workers
        # pid: the process running the worker's dataset code, as torch's (a session's own
        # process on a warm worker or a fleet; else the actor's).
        return [WorkerProcess(workers, w, actor, self._known.get(w, {}).get(
                    "session_pid", self._known.get(w, {}).get("pid")))
                for w, actor in sorted(workers.actors.items())]

    @property
    def closed(self) -> bool:
        """True once this iterator's workers, sockets and thread are stopped."""
        return self._runtime.closed

    def stats(self, wait: bool = True) -> LoaderStats:
        """This iterator's counters and data-stall figures (docs/STATS.md). With
        ``wait=False`` (``__del__``) the session's counters are read from this thread,
        not copied on the loop thread."""
        if wait and self._loop.running:
            session = self._loop.run(self._session.snapshot(), timeout=5.0)
        else:  # the loop thread is gone (nothing changes them), or not to be waited for
            session = self._session.counters()
        now = time.monotonic()
        epoch_s = (self._epoch_end or now) - self._epoch_t0
        workers = self._sched.workers.stats(now, getattr(self._runtime.workers, "warm", ()))
        return {
            "epoch": self._epoch,
            "epoch_s": epoch_s,
            "data_wait_s": self._wait_s,
            "data_wait_share": self._wait_s / epoch_s if epoch_s > 0 else 0.0,
            "workers_ready": len(self._ready),
            "workers": workers,
            "credits_in_flight": self._sched.in_flight,
            "worker_batch_s": mean(self._sched.batch_times.copy()),
            "batch_latency": self._latencies.summary(),
            "dataset_bytes": self._shipped_bytes,
            "dataset_reused": self._shipped_reused,
            **session,
            "dropped": dict(self._sched.counters),
            "recoveries": [dict(r) for r in self._sched.recoveries.copy()],
            **({"autoscale": self._autoscaler.report(self._sched.num_workers)}
               if self._autoscaler is not None else {}),
        }

    def __del__(self) -> None:
        # Dropped in the middle of an epoch (a loop left with `break`): the loader keeps
        # where it stood, for a state_dict() after the loop.
        started = hasattr(self, "_loader_ref") and hasattr(self, "_runtime")
        loader = self._loader_ref() if started else None
        if loader is not None and not self._runtime.closed:
            try:
                loader._keep_position(self, ask_workers=False)
            except Exception:  # never from __del__; the state is then an epoch boundary
                logger.debug("dpex: could not keep a dropped iterator's position",
                             exc_info=True)
            try:  # loader.stats() after a loop left with `break`: this iterator's
                loader._final_stats = self.stats(wait=False)
            except Exception:  # (a counter changed while it was read: never from __del__)
                logger.debug("dpex: could not keep a dropped iterator's stats", exc_info=True)
        # The finalizer is the safety net; this only makes the common case prompt.
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
