"""One session (one trainer iterator, one worker id) served in this process: the
control reader, the compute thread, the RNG answers.

The worker actor serves its own sessions with it (:mod:`dpex.server._actor`), and so
does a session's own process (:mod:`dpex.server._session_process`): the asyncio
thread owns the control socket and feeds tasks to one compute thread, which owns
the data socket and does fetch → collate → encode → send with no thread hop per
batch.

The control socket is a plain ZeroMQ socket read by a callback on its descriptor
(:class:`ControlChannel`), as the trainer's are: pyzmq's asyncio sockets, awaited
under ``wait_for``, cost this thread about 200 µs of CPU per TASKS message on a
busy 2-core node (a future, a task and a timer per message), more than the rest of
the worker's own per-batch path (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import dataclasses
import itertools
import os
import queue
import threading
import time
import weakref
from collections.abc import Callable

import zmq
import zmq.asyncio

from dpex._epoch_marks import AppliedMarks
from dpex._multipart import send_frames
from dpex._protocol import (
    IDLE,
    LOADING,
    PROGRESS_INTERVAL_S,
    Kind,
    ProtocolError,
    worker_identity,
)
from dpex._security import ControlFreshness, connect_promptly
from dpex._shm import RingUnavailable, WorkerRing
from dpex._spec import Parcel, WorkerSpec
from dpex._start_trace import mark
from dpex._version import local_versions
from dpex.server._control import ConnectionLog, ControlChannel
from dpex.server._task_runner import TaskRunner
from dpex.server._trainer_state import leave_trainer_state

__all__ = ["Session", "SessionServer"]

_RNG_WAIT_S = 5.0  # how long an RNG_QUERY answer waits for the compute thread to get there
_RESUME = object()
_SKIP = object()


def _set_thread_niceness(niceness: int) -> None:
    """Run the calling thread (and the threads it starts) at ``niceness``.

    Ray starts its workers at niceness 15, so on a node shared with the trainer they
    lose every contest for a CPU; torch's workers run at the trainer's priority and
    so do dpex's where the OS allows it (lowering niceness may need CAP_SYS_NICE).
    On Linux niceness is per thread, hence one call in each thread that computes.
    """
    try:
        os.setpriority(os.PRIO_PROCESS, 0, niceness)
    except OSError:
        pass  # not permitted: stay at Ray's niceness


class Session:
    """What one ``serve`` call (one trainer iterator, one worker id) shares between
    its asyncio side and its compute thread."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.epoch_floor = 0  # tasks of earlier epochs (abandoned) are skipped
        self.marks = AppliedMarks()  # RESUME / SKIP applied (once each, however they came)
        self.runner: TaskRunner | None = None  # set by the compute thread once loaded
        self.answers: set[asyncio.Task] = set()  # RNG_QUERY answers being prepared
        # What the compute thread works on, and since when (monotonic): (epoch, seq,
        # started); seq LOADING while it loads the dataset, IDLE between tasks. Written
        # by the compute thread as one tuple, read by the PROGRESS sender.
        self.working: tuple[int, int, float] = (0, LOADING, time.monotonic())

    def progress(self, now: float, queued: int) -> tuple[int, int, tuple[float, int]]:
        """(epoch, seq, (seconds on it, items queued for the compute thread)): what a
        PROGRESS message says."""
        epoch, seq, since = self.working
        return epoch, seq, (0.0 if seq == IDLE else now - since, queued)


class SessionServer:
    """Serves sessions in this process for a host (the actor, or a session's process):
    ``placement`` (its node and pid, sent in HELLO), ``session_timeout`` (how long a
    session may hear nothing from its trainer), ``count(nbytes)`` per batch sent and
    ``count_rejected()`` per control message refused; ``sessions`` and ``computes`` are
    the host's, which it reads (busy or not) and stops."""

    def __init__(self, placement: dict, session_timeout: float,
                 count: Callable[[int], None], count_rejected: Callable[[], None],
                 sessions: set[Session] | None = None,
                 computes: weakref.WeakSet[threading.Thread] | None = None) -> None:
        self.placement, self.session_timeout = placement, session_timeout
        self.count, self.count_rejected = count, count_rejected
        self.sessions: set[Session] = set() if sessions is None else sessions
        self.computes: weakref.WeakSet[threading.Thread] = (
            weakref.WeakSet() if computes is None else computes)

    async def serve(self, spec: WorkerSpec, shipped: Parcel) -> None:
        """Serve one session in this process.

        This (asyncio) thread owns the control socket and feeds tasks to one compute
        thread, which owns the data socket and does fetch → collate → encode → send
        with no thread hop per batch.
        """
        loop = asyncio.get_running_loop()
        spec = _with_incarnation(spec)
        _set_thread_niceness(spec.niceness)  # this loop thread, and zmq's I/O thread below
        ctx = zmq.asyncio.Context()
        # A plain socket on the asyncio context (its monitor is an asyncio socket).
        ctrl = zmq.Socket(ctx, zmq.DEALER)
        channel = ControlChannel(ctrl, loop)
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        halt = threading.Event()
        done: asyncio.Future = loop.create_future()
        session = Session()
        ring, transport = _attach_ring(spec, self.placement["node_id"])
        compute = threading.Thread(target=self._compute, name="dpex-compute", daemon=True,
                                   args=(spec, shipped, ring, inbox, halt, loop, done, session))
        self.sessions.add(session)
        self.computes.add(compute)
        log: ConnectionLog | None = None
        watcher: asyncio.Future | None = None
        try:
            _configure_control(ctrl, spec)
            hello = self._hello(spec, transport)
            log = ConnectionLog(channel, hello)
            watcher = asyncio.ensure_future(log.run())
            ctrl.connect(spec.control_address)
            # HELLO as soon as the actor is up: start-up time is placement and process start.
            # Loading the dataset and worker_init_fn count, as in torch, towards the
            # first batch (and torch's ``timeout``).
            channel.send(hello)
            compute.start()
            await self._until_ended(channel, spec, inbox, session, log, done)
        finally:
            self.sessions.discard(session)
            await _stop_compute(compute, halt, inbox)
            leave_trainer_state()  # the node's own directory and env again
            await _close_control(ctx, ctrl, channel, log, watcher)
            # (a compute thread that outlived its wait may still be writing into the ring)
            if ring is not None and not compute.is_alive():
                ring.close()

    def _hello(self, spec: WorkerSpec, transport: str) -> list:
        """The HELLO frames: the versions (dpex, protocol, Python), this host's placement,
        the niceness this thread got, and how batches travel (see :func:`_attach_ring`)."""
        hello = {"versions": local_versions(), **self.placement,
                 "niceness": os.getpriority(os.PRIO_PROCESS, 0), "transport": transport}
        return spec.wire.encode(Kind.HELLO, worker_id=spec.worker_id, payload=hello)

    async def _until_ended(self, channel: ControlChannel, spec: WorkerSpec,
                           inbox: queue.SimpleQueue, session: Session, log: ConnectionLog,
                           done: asyncio.Future) -> None:
        """Serve the control side until the session ends: the trainer sends STOP or falls
        silent, or the control reader, the compute thread (``done``) or the PROGRESS
        sender ends; what ended one of those with an error is raised here. The tasks
        started here (and the RNG_QUERY answers in flight) are cancelled on the way out."""
        reader = asyncio.ensure_future(self.read_control(channel, spec, inbox, session, log))
        stopper = asyncio.ensure_future(session.stop.wait())
        beat = asyncio.ensure_future(_send_progress(channel, spec, session, inbox))
        try:
            await asyncio.wait({reader, stopper, done, beat},
                               return_when=asyncio.FIRST_COMPLETED)
            if reader.done():
                reader.result()  # re-raise what ended the reader
            if done.done():
                done.result()  # re-raise what ended the compute thread
            if beat.done():
                beat.result()
        finally:
            reader.cancel()
            stopper.cancel()
            beat.cancel()
            for answer in session.answers:
                answer.cancel()

    def _compute(self, spec: WorkerSpec, shipped: Parcel, ring: WorkerRing | None,
                 inbox: queue.SimpleQueue, halt: threading.Event,
                 loop: asyncio.AbstractEventLoop, done: asyncio.Future,
                 session: Session) -> None:
        _set_thread_niceness(spec.niceness)
        ctx = zmq.Context()
        data = ctx.socket(zmq.PUSH)
        data.setsockopt(zmq.LINGER, 0)
        data.setsockopt(zmq.SNDTIMEO, 500)  # so a send never outlives ``halt`` for long
        spec.keys.apply(data)
        connect_promptly(data)
        data.connect(spec.data_address)
        try:
            node = f"{self.placement['node_ip']} ({self.placement['node_id'][:8]})"
            state = TaskRunner(spec, shipped, node, ring)
            session.runner = state
            mark("session ready", worker=spec.worker_id)
            session.working = (0, IDLE, time.monotonic())
            while not halt.is_set():
                try:
                    item = inbox.get(timeout=0.5)
                except queue.Empty:
                    continue
                if item is None:
                    break
                if item[0] is _RESUME or item[0] is _SKIP:
                    # (passing over a shard's delivered batches is work towards the
                    # next task, as loading is)
                    session.working = (item[2], LOADING, time.monotonic())
                    if item[0] is _RESUME:
                        state.resume(item[1], epoch=item[2])
                    else:
                        state.skip(item[1], epoch=item[2])
                    session.working = (item[2], IDLE, time.monotonic())
                    continue
                epoch, seq, indices = item
                if epoch < session.epoch_floor:
                    continue  # a task of an abandoned epoch: not worth computing
                session.working = (epoch, seq, time.monotonic())
                frames = state.run_task(epoch, seq, indices)
                while not halt.is_set():
                    try:
                        send_frames(data, frames, copy=False)
                        self.count(sum(memoryview(f).nbytes for f in frames))
                        if seq == 0:
                            mark("batch 0 sent", worker=spec.worker_id)
                        break
                    except zmq.Again:
                        continue
                session.working = (epoch, IDLE, time.monotonic())
            outcome: tuple = (done.set_result, None)
        except BaseException as exc:
            outcome = (done.set_exception, exc)
        finally:
            data.close(0)
            ctx.term()
        loop.call_soon_threadsafe(_settle, done, *outcome)

    async def read_control(self, channel: ControlChannel, spec: WorkerSpec,
                           inbox: queue.SimpleQueue, session: Session,
                           log: ConnectionLog | None = None) -> None:
        """Read the session's control messages as they come until the trainer has been
        silent for ``session_timeout`` (it pings every second while it lives): then the
        session ends, or, if it was never heard from, fails saying why."""
        loop = asyncio.get_running_loop()
        fresh = ControlFreshness()
        started = loop.time()
        heard: list[float] = []  # when the last message came (none yet)

        def on_message(frames: list[bytes]) -> None:
            heard[:] = [loop.time()]
            self._on_control(frames, channel, spec, inbox, session, fresh)

        channel.start(on_message)
        try:
            while True:
                left = (heard[0] if heard else started) + self.session_timeout - loop.time()
                if left <= 0:
                    if heard or log is None:
                        return  # the trainer stopped pinging: it is gone, the session ends
                    node = f"{self.placement['node_ip']} ({self.placement['node_id'][:8]})"
                    raise log.unreachable(spec, node, self.session_timeout)
                await asyncio.wait({channel.failed}, timeout=min(left, 1.0))
                if channel.failed.done():
                    channel.failed.result()  # re-raise what broke the reading
        finally:
            channel.stop()

    def _on_control(self, frames: list[bytes], channel: ControlChannel, spec: WorkerSpec,
                    inbox: queue.SimpleQueue, session: Session,
                    fresh: ControlFreshness) -> None:
        """One control message from the trainer, checked, applied in order."""
        try:
            msg = spec.wire.decode(frames)
        except ProtocolError:
            return
        if not fresh.accept(msg.seq):  # delivered before (a replay) or out of order
            self.count_rejected()
            return
        if msg.kind is Kind.TASKS:
            tasks, marks = msg.payload
            # A RESUME or SKIP lost with a connection comes with the tasks that need it.
            for mark, payload, epoch in session.marks.repair(marks):
                if mark == "resume":
                    session.epoch_floor = epoch
                inbox.put((_RESUME if mark == "resume" else _SKIP, payload, epoch))
            for seq, indices in tasks:
                inbox.put((msg.epoch, seq, indices))
        elif msg.kind is Kind.RESUME:
            if session.marks.resume(msg.epoch):
                session.epoch_floor = msg.epoch  # tasks of earlier epochs are skipped
                inbox.put((_RESUME, msg.payload, msg.epoch))
        elif msg.kind is Kind.SKIP:
            if session.marks.skip(msg.epoch, msg.payload):
                inbox.put((_SKIP, msg.payload, msg.epoch))
        elif msg.kind is Kind.RNG_QUERY:
            answer = asyncio.ensure_future(
                self._answer_rng(channel, spec, session, msg.epoch, msg.payload))
            session.answers.add(answer)
            answer.add_done_callback(session.answers.discard)
        elif msg.kind is Kind.STOP:
            session.stop.set()

    @staticmethod
    async def _answer_rng(channel: ControlChannel, spec: WorkerSpec, session: Session,
                          epoch: int, seq: int) -> None:
        """Answer RNG_QUERY: the RNG states right after task ``seq`` of ``epoch`` (-1:
        when the epoch began). The compute thread may not be there yet (its runner still
        loading, a RESUME still queued): wait for it a little, then answer None."""
        loop = asyncio.get_running_loop()
        deadline = loop.time() + _RNG_WAIT_S
        while True:
            runner = session.runner
            rng = runner.rng_after(epoch, seq) if runner is not None else None
            if rng is not None or loop.time() > deadline:
                break
            await asyncio.sleep(0.01)
        try:
            frames = spec.wire.encode(Kind.RNG_STATE, epoch, seq, spec.worker_id, rng)
        except Exception:  # a dataset state that cannot be pickled: the RNG states alone
            rng = {k: v for k, v in (rng or {}).items() if k != "dataset"} or None
            frames = spec.wire.encode(Kind.RNG_STATE, epoch, seq, spec.worker_id, rng)
        size = len(frames[2])
        if size > spec.wire.max_message_bytes:  # the trainer's socket would cut it unseen
            frames = spec.wire.encode(Kind.RNG_STATE, epoch, seq, spec.worker_id, {
                "error": f"worker {spec.worker_id}'s RNG and dataset state is {size:,} "
                         f"bytes, over max_message_bytes={spec.wire.max_message_bytes:,}: "
                         "raise DpexDataLoader(max_message_bytes=...) or keep less in the "
                         "dataset's state_dict()"})
        channel.send(frames)


async def _send_progress(channel: ControlChannel, spec: WorkerSpec, session: Session,
                         inbox: queue.SimpleQueue) -> None:
    """Every PROGRESS_INTERVAL_S: what the compute thread works on, and for how long.
    Sent from this (control) thread, so a worker whose compute thread sleeps in
    ``__getitem__`` still shows it computes; a process that is stopped, or wedged
    holding the GIL, falls silent (see :mod:`dpex.client._lost`). Each report is
    numbered (0, 1, 2, ... per session, in its MAC'd payload): the trainer takes each
    number once, in increasing order, so a report read off the wire and sent again
    cannot make a worker look busy or idle (``_security.ProgressFreshness``)."""
    for number in itertools.count():
        await asyncio.sleep(PROGRESS_INTERVAL_S)
        epoch, seq, working = session.progress(time.monotonic(), inbox.qsize())
        channel.send(spec.wire.encode(Kind.PROGRESS, epoch, seq, spec.worker_id,
                                      (*working, number)))


def _with_incarnation(spec: WorkerSpec) -> WorkerSpec:
    """``spec`` with its wire stamped with its incarnation: every message this
    incarnation sends says which it is (a late one is known)."""
    return dataclasses.replace(spec, wire=dataclasses.replace(
        spec.wire, incarnation=spec.incarnation))


def _configure_control(ctrl: zmq.Socket, spec: WorkerSpec) -> None:
    """Set up the control socket before it connects: no linger, the route the trainer
    knows this incarnation by (:func:`~dpex._protocol.worker_identity`), the iterator's
    credentials, and a connection attempt that gives up and retries promptly."""
    ctrl.setsockopt(zmq.LINGER, 0)
    ctrl.setsockopt(zmq.IDENTITY, worker_identity(spec.worker_id, spec.incarnation,
                                                  spec.wire.key))
    spec.keys.apply(ctrl)
    connect_promptly(ctrl)


async def _stop_compute(compute: threading.Thread, halt: threading.Event,
                        inbox: queue.SimpleQueue) -> None:
    """Stop the compute thread: ``halt`` (seen between tasks and while a send is retried),
    ``None`` in its inbox (wakes it from waiting for a task); then wait, off this thread,
    up to 10 s for the task it may be in the middle of."""
    halt.set()
    inbox.put(None)
    if compute.is_alive():
        await asyncio.get_running_loop().run_in_executor(None, compute.join, 10.0)


async def _close_control(ctx: zmq.asyncio.Context, ctrl: zmq.Socket,
                         channel: ControlChannel, log: ConnectionLog | None,
                         watcher: asyncio.Future | None) -> None:
    """Close the control side, whichever of its parts ``serve`` got to open: the
    connection log's watcher and monitor, the channel's reading, the socket, the
    context."""
    if watcher is not None:
        watcher.cancel()
        await asyncio.gather(watcher, return_exceptions=True)
    if log is not None:
        log.close()
    channel.stop()
    ctrl.close(0)
    ctx.term()


def _attach_ring(spec: WorkerSpec, node_id: str) -> tuple[WorkerRing | None, str]:
    """The trainer's ring when this worker shares its node, and how batches travel
    (``"ring"``, or ``"socket"`` with the reason)."""
    if spec.ring is None:
        return None, "socket (no ring offered)"
    try:
        return WorkerRing(spec.ring, node_id), "ring"
    except (RingUnavailable, OSError) as exc:  # OSError: mmap refused (memory limits)
        return None, f"socket ({exc})"


def _settle(fut: asyncio.Future, setter: object, value: object) -> None:
    if not fut.done():
        setter(value)
