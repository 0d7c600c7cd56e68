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


class DpexWorker:
    """Ray actor class (wrapped with ``ray.remote`` by the trainer side)."""

    def __init__(self) -> None:
        self._stop = asyncio.Event()
        self._epoch_floor = 0
        self.placement = _placement()

    def where(self) -> dict:
        return self.placement

    async def stop(self) -> None:
        self._stop.set()

    async def serve(self, spec: WorkerSpec, shipped: bytes) -> dict:
        """Serve one session until STOP; returns counters. Raises if set-up fails.

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
        ring, transport = _attach_ring(spec, self.placement["node_id"])
        compute = threading.Thread(target=self._compute, name="dpex-compute", daemon=True,
                                   args=(spec, shipped, ring, inbox, halt, loop, done))
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
            reader = asyncio.ensure_future(self._read_control(ctrl, spec, inbox))
            stopper = asyncio.ensure_future(self._stop.wait())
            try:
                await asyncio.wait({reader, stopper, done}, return_when=asyncio.FIRST_COMPLETED)
                if reader.done():
                    reader.result()  # re-raise what ended the reader
                if done.done():
                    return done.result()  # re-raise what ended the compute thread
            finally:
                reader.cancel()
                stopper.cancel()
        finally:
            halt.set()
            inbox.put(None)
            if compute.is_alive():
                await loop.run_in_executor(None, compute.join, 10.0)
            ctrl.close(0)
            ctx.term()
            if ring is not None and not compute.is_alive():
                ring.close()
        await asyncio.sleep(0)  # let the compute thread's outcome land
        if done.done() and done.exception() is None:
            return done.result()
        return {"sent": None}

    def _compute(self, spec: WorkerSpec, shipped: bytes, ring: WorkerRing | None,
                 inbox: queue.SimpleQueue, halt: threading.Event,
                 loop: asyncio.AbstractEventLoop, done: asyncio.Future) -> None:
        _set_thread_niceness(spec.niceness)
        ctx = zmq.Context()
        data = ctx.socket(zmq.PUSH)
        data.setsockopt(zmq.LINGER, 0)
        data.setsockopt(zmq.SNDTIMEO, 500)  # so a send never outlives ``halt`` for long
        data.connect(spec.data_address)
        sent = 0
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
                if epoch < self._epoch_floor:
                    continue  # a task of an abandoned epoch: not worth computing
                frames = state.run_task(epoch, seq, indices)
                while not halt.is_set():
                    try:
                        data.send_multipart(frames, copy=False)
                        sent += 1
                        break
                    except zmq.Again:
                        continue
            outcome: tuple = (done.set_result, {"sent": sent})
        except BaseException as exc:
            outcome = (done.set_exception, exc)
        finally:
            data.close(0)
            ctx.term()
        loop.call_soon_threadsafe(_settle, done, *outcome)

    async def _read_control(self, ctrl: zmq.asyncio.Socket, spec: WorkerSpec,
                            inbox: queue.SimpleQueue) -> None:
        while True:
            frames = await ctrl.recv_multipart()
            try:
                msg = spec.wire.decode(frames)
            except ProtocolError:
                continue
            if msg.kind is Kind.TASKS:
                for seq, indices in msg.payload:
                    inbox.put((msg.epoch, seq, indices))
            elif msg.kind is Kind.RESUME:
                self._epoch_floor = msg.epoch  # tasks of earlier epochs are skipped
                inbox.put((_RESUME, msg.payload))
            elif msg.kind is Kind.SKIP:
                inbox.put((_SKIP, msg.payload))
            elif msg.kind is Kind.STOP:
                self._stop.set()


def _attach_ring(spec: WorkerSpec, node_id: str) -> tuple[WorkerRing | None, str]:
    """The trainer's ring when this worker shares its node, and how batches travel
    (``"ring"``, or ``"socket"`` with the reason)."""
    if spec.ring is None:
        return None, "socket (no ring offered)"
    try:
        return WorkerRing(spec.ring, node_id), "ring"
    except RingUnavailable as exc:
        return None, f"socket ({exc})"


def _settle(fut: asyncio.Future, setter: object, value: object) -> None:
    if not fut.done():
        setter(value)
