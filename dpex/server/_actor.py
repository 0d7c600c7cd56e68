"""The worker actor: an asyncio streaming server for one session at a time.

It receives tasks on a DEALER socket connected to the trainer's ROUTER (on its
asyncio loop, which stays responsive to control messages and shutdown) and
hands them to one compute thread that runs fetch / collate / encode and pushes
each result as one multipart message to the trainer's PULL socket.
"""

from __future__ import annotations

import asyncio
import os
import queue
import threading

import zmq
import zmq.asyncio

from dpex._protocol import Kind, ProtocolError, worker_identity
from dpex._shm import RingUnavailable, WorkerRing
from dpex._version import local_versions
from dpex.server._worker_state import WorkerSpec, WorkerState

__all__ = ["DpexWorker"]

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


def _placement() -> dict:
    import ray

    ctx = ray.get_runtime_context()
    return {
        "node_id": ctx.get_node_id(),
        "node_ip": ray.util.get_node_ip_address(),
        "pid": os.getpid(),
    }


class _Session:
    """What one ``serve`` call (one trainer iterator, one worker id) shares between
    its asyncio side and its compute thread."""

    def __init__(self) -> None:
        self.stop = asyncio.Event()
        self.epoch_floor = 0  # tasks of earlier epochs (abandoned) are skipped


class DpexWorker:
    """Ray actor class (wrapped with ``ray.remote`` by the trainer side, or started
    detached by ``dpex fleet start``). It serves any number of sessions at once,
    one ``serve`` call each; ``session_timeout`` is how long a session may hear
    nothing from its trainer (which pings every second) before it is freed."""

    def __init__(self, session_timeout: float = 30.0) -> None:
        self.session_timeout = session_timeout
        self.placement = _placement()
        self._sessions: set[_Session] = set()
        self._lock = threading.Lock()
        self._counters = {"sessions_served": 0, "batches_sent": 0, "bytes_sent": 0}

    def where(self) -> dict:
        return self.placement

    def fleet_stats(self) -> dict:
        """Placement, versions and traffic so far (``dpex fleet status``)."""
        with self._lock:
            counters = dict(self._counters)
        return {**self.placement, "versions": local_versions(),
                "sessions_active": len(self._sessions), **counters}

    async def stop(self) -> None:
        """End every session this worker serves."""
        for session in list(self._sessions):
            session.stop.set()

    def _count(self, nbytes: int) -> None:
        with self._lock:
            self._counters["batches_sent"] += 1
            self._counters["bytes_sent"] += nbytes

    async def serve(self, spec: WorkerSpec, shipped: bytes) -> None:
        """Serve one session until STOP, cancellation or silence. Raises if set-up fails
        (the worker's traffic is counted in ``fleet_stats``).

        This (asyncio) thread owns the control socket and feeds tasks to one compute
        thread, which owns the data socket and does fetch → collate → encode → send
        with no thread hop per batch.
        """
        loop = asyncio.get_running_loop()
        _set_thread_niceness(spec.niceness)  # this loop thread, and zmq's I/O thread below
        ctx = zmq.asyncio.Context()
        ctrl = ctx.socket(zmq.DEALER)
        inbox: queue.SimpleQueue = queue.SimpleQueue()
        halt = threading.Event()
        done: asyncio.Future = loop.create_future()
        session = _Session()
        ring, transport = _attach_ring(spec, self.placement["node_id"])
        compute = threading.Thread(target=self._compute, name="dpex-compute", daemon=True,
                                   args=(spec, shipped, ring, inbox, halt, loop, done, session))
        self._sessions.add(session)
        with self._lock:
            self._counters["sessions_served"] += 1
        try:
            ctrl.setsockopt(zmq.LINGER, 0)
            ctrl.setsockopt(zmq.IDENTITY, worker_identity(spec.worker_id, spec.incarnation))
            ctrl.connect(spec.control_address)
            hello = {"versions": local_versions(), **self.placement,
                     "niceness": os.getpriority(os.PRIO_PROCESS, 0), "transport": transport}
            # HELLO as soon as the actor is up: start-up time is placement and process start.
            # Loading the dataset and worker_init_fn count, as in torch, towards the
            # first batch (and torch's ``timeout``).
            await ctrl.send_multipart(
                spec.wire.encode(Kind.HELLO, worker_id=spec.worker_id, payload=hello)
            )
            compute.start()
            reader = asyncio.ensure_future(self._read_control(ctrl, spec, inbox, session))
            stopper = asyncio.ensure_future(session.stop.wait())
            try:
                await asyncio.wait({reader, stopper, done}, return_when=asyncio.FIRST_COMPLETED)
                if reader.done():
                    reader.result()  # re-raise what ended the reader
                if done.done():
                    done.result()  # re-raise what ended the compute thread
            finally:
                reader.cancel()
                stopper.cancel()
        finally:
            self._sessions.discard(session)
            halt.set()
            inbox.put(None)
            if compute.is_alive():
                await loop.run_in_executor(None, compute.join, 10.0)
            ctrl.close(0)
            ctx.term()
            if ring is not None and not compute.is_alive():
                ring.close()

    def _compute(self, spec: WorkerSpec, shipped: bytes, ring: WorkerRing | None,
                 inbox: queue.SimpleQueue, halt: threading.Event,
                 loop: asyncio.AbstractEventLoop, done: asyncio.Future,
                 session: _Session) -> None:
        _set_thread_niceness(spec.niceness)
        ctx = zmq.Context()
        data = ctx.socket(zmq.PUSH)
        data.setsockopt(zmq.LINGER, 0)
        data.setsockopt(zmq.SNDTIMEO, 500)  # so a send never outlives ``halt`` for long
        data.connect(spec.data_address)
        try:
            node = f"{self.placement['node_ip']} ({self.placement['node_id'][:8]})"
            state = WorkerState(spec, shipped, node, ring)
            while not halt.is_set():
                try:
                    item = inbox.get(timeout=0.5)
                except queue.Empty:
                    continue
                if item is None:
                    break
                if item[0] is _RESUME:
                    state.resume(item[1])
                    continue
                if item[0] is _SKIP:
                    state.skip(item[1])
                    continue
                epoch, seq, indices = item
                if epoch < session.epoch_floor:
                    continue  # a task of an abandoned epoch: not worth computing
                frames = state.run_task(epoch, seq, indices)
                while not halt.is_set():
                    try:
                        data.send_multipart(frames, copy=False)
                        self._count(sum(memoryview(f).nbytes for f in frames))
                        break
                    except zmq.Again:
                        continue
            outcome: tuple = (done.set_result, None)
        except BaseException as exc:
            outcome = (done.set_exception, exc)
        finally:
            data.close(0)
            ctx.term()
        loop.call_soon_threadsafe(_settle, done, *outcome)

    async def _read_control(self, ctrl: zmq.asyncio.Socket, spec: WorkerSpec,
                            inbox: queue.SimpleQueue, session: _Session) -> None:
        while True:
            try:
                frames = await asyncio.wait_for(ctrl.recv_multipart(), self.session_timeout)
            except asyncio.TimeoutError:
                return  # the trainer stopped pinging: it is gone, the session ends
            try:
                msg = spec.wire.decode(frames)
            except ProtocolError:
                continue
            if msg.kind is Kind.TASKS:
                for seq, indices in msg.payload:
                    inbox.put((msg.epoch, seq, indices))
            elif msg.kind is Kind.RESUME:
                session.epoch_floor = msg.epoch  # tasks of earlier epochs are skipped
                inbox.put((_RESUME, msg.payload))
            elif msg.kind is Kind.SKIP:
                inbox.put((_SKIP, msg.payload))
            elif msg.kind is Kind.STOP:
                session.stop.set()


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
