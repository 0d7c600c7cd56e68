"""The worker actor: an asyncio streaming server for one session at a time.

It receives tasks on a DEALER socket connected to the trainer's ROUTER, runs
fetch / collate / encode on one executor thread (so the loop stays responsive
to control messages and shutdown), and pushes each result as one multipart
message to the trainer's PULL socket.
"""

from __future__ import annotations

import asyncio
import collections
import os
from concurrent.futures import ThreadPoolExecutor

import zmq
import zmq.asyncio

from dpex._protocol import Kind, ProtocolError, worker_identity
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
        self.placement = _placement()

    def where(self) -> dict:
        return self.placement

    async def stop(self) -> None:
        self._stop.set()

    async def serve(self, spec: WorkerSpec, shipped: bytes) -> dict:
        """Serve one session until STOP; returns counters. Raises if set-up fails."""
        loop = asyncio.get_running_loop()
        _set_thread_niceness(spec.niceness)  # this loop thread, and zmq's I/O thread below
        executor = ThreadPoolExecutor(1, thread_name_prefix="dpex-fetch",
                                      initializer=_set_thread_niceness,
                                      initargs=(spec.niceness,))
        ctx = zmq.asyncio.Context()
        ctrl = ctx.socket(zmq.DEALER)
        data = ctx.socket(zmq.PUSH)
        sent = 0
        try:
            for sock in (ctrl, data):
                sock.setsockopt(zmq.LINGER, 0)
            ctrl.setsockopt(zmq.IDENTITY, worker_identity(spec.worker_id, spec.incarnation))
            ctrl.connect(spec.control_address)
            data.connect(spec.data_address)
            hello = {"versions": local_versions(), **self.placement,
                     "niceness": os.getpriority(os.PRIO_PROCESS, 0)}
            # HELLO as soon as the actor is up: start-up time is placement and process start.
            # Loading the dataset and worker_init_fn count, as in torch, towards the
            # first batch (and torch's ``timeout``).
            await ctrl.send_multipart(
                spec.wire.encode(Kind.HELLO, worker_id=spec.worker_id, payload=hello)
            )
            node = f"{self.placement['node_ip']} ({self.placement['node_id'][:8]})"
            state = await loop.run_in_executor(executor, WorkerState, spec, shipped, node)
            pending: collections.deque = collections.deque()
            wake = asyncio.Event()
            reader = asyncio.ensure_future(self._read_control(ctrl, spec, pending, wake))
            stopper = asyncio.ensure_future(self._stop.wait())
            try:
                while not self._stop.is_set():
                    if not pending:
                        wake.clear()
                        waiter = asyncio.ensure_future(wake.wait())
                        await asyncio.wait({waiter, reader, stopper},
                                           return_when=asyncio.FIRST_COMPLETED)
                        waiter.cancel()
                        if reader.done():
                            reader.result()  # re-raise what ended the reader
                            break
                        continue
                    item = pending.popleft()
                    if item[0] is _RESUME:
                        await loop.run_in_executor(executor, state.resume, item[1])
                        continue
                    if item[0] is _SKIP:
                        await loop.run_in_executor(executor, state.skip, *item[1])
                        continue
                    epoch, seq, indices = item
                    frames = await loop.run_in_executor(executor, state.run_task, epoch, seq, indices)
                    await data.send_multipart(frames, copy=False)
                    sent += 1
            finally:
                reader.cancel()
                stopper.cancel()
        finally:
            ctrl.close(0)
            data.close(0)
            ctx.term()
            executor.shutdown(wait=False, cancel_futures=True)
        return {"sent": sent}

    async def _read_control(self, ctrl: zmq.asyncio.Socket, spec: WorkerSpec,
                            pending: collections.deque, wake: asyncio.Event) -> None:
        while True:
            frames = await ctrl.recv_multipart()
            try:
                msg = spec.wire.decode(frames)
            except ProtocolError:
                continue
            if msg.kind is Kind.TASKS:
                pending.extend((msg.epoch, seq, indices) for seq, indices in msg.payload)
            elif msg.kind is Kind.RESUME:
                # Tasks of the epoch being abandoned are not worth computing.
                pending.clear()
                pending.append((_RESUME, msg.payload))
            elif msg.kind is Kind.SKIP:
                pending.append((_SKIP, msg.payload))
            elif msg.kind is Kind.STOP:
                self._stop.set()
            wake.set()
