"""dpex's workers in this process: the real task runner over the shipped loader, without
Ray, sockets or threads (``DpexDataLoader._runtimes``, see dpex/client/_runtime.py).

The loader is pickled as dpex ships it (``ship_loader``: cloudpickle, out-of-band
buffers, the trainer's state in front) and each worker unpickles its own copy from
those bytes, as a worker does under spawn. Each worker is a real
:class:`~dpex.server._task_runner.TaskRunner`: its seeds, ``worker_init_fn``,
``get_worker_info()``, collation, RESUME, SKIP, RNG records and a stateful dataset's
own states are dpex's. Its batches are encoded as a worker sends them and decoded as
the trainer's session does (the same :class:`~dpex._protocol.Wire`), and come to the
driver on its queue at once: a task is computed when the trainer sends it.

A worker here runs in the trainer's interpreter, so each one keeps the global state a
process of its own would have to itself (torch's, Python's and NumPy's RNGs, torch's
thread count, ``get_worker_info()``, the environment): it is swapped in around each of
its steps and the trainer's put back after. A worker that blocks blocks the trainer:
such tests run on Ray. What this does not show, the Ray tier does: processes,
placement, sockets and rings, deaths, the warm hosts.

Use: the ``inprocess`` fixture (tests/conftest.py), or ``with workers_in_process():``.
"""

from __future__ import annotations

import contextlib
import os
import random
from collections.abc import Callable, Iterator
from typing import Any

import numpy as np
import torch
from fake_runtime import Delivery, Loop, Session, hello
from torch.utils.data._utils import worker as torch_worker

from dpex import DpexDataLoader
from dpex._protocol import Kind, Wire
from dpex._security import SessionKeys
from dpex._spec import Parcel
from dpex._transport import Receiver
from dpex.client._events import RngReply, WorkerExit
from dpex.client._scheduler import Control, SendTasks
from dpex.client._shipment import Shipment
from dpex.client._shipping import ship_loader
from dpex.errors import WorkerStartupError
from dpex.server._task_runner import TaskRunner

__all__ = ["InProcess", "workers_in_process"]


def _global_state() -> tuple:
    return (torch.initial_seed(), torch.get_rng_state(), random.getstate(),
            np.random.get_state(), torch.get_num_threads(), torch_worker._worker_info,
            dict(os.environ))


def _set_global_state(state: tuple) -> None:
    seed, rng, py, numpy_state, threads, info, environ = state
    if environ != os.environ:
        os.environ.clear()
        os.environ.update(environ)
    torch.manual_seed(seed)  # (initial_seed() too)
    torch.set_rng_state(rng)
    random.setstate(py)
    np.random.set_state(numpy_state)
    torch.set_num_threads(threads)
    torch_worker._worker_info = info


class _Worker:
    """One incarnation of a worker id: a task runner with its own global state."""

    def __init__(self, spec: Any, data: bytes) -> None:
        self.id, self.incarnation, self.pid = spec.worker_id, spec.incarnation, 4000 + spec.worker_id
        self.alive = True
        self.state: tuple | None = None
        self.runner = self.step(lambda: TaskRunner(spec, Parcel(data), node="in-process"))

    def step(self, fn: Callable[[], Any]) -> Any:
        """``fn()`` with this worker's global state in place of the trainer's."""
        trainer = _global_state()
        if self.state is not None:
            _set_global_state(self.state)
        try:
            return fn()
        finally:
            self.state = _global_state()
            _set_global_state(trainer)


class _Delivery(Delivery):
    """The shipped loader's bytes, as dpex._shipfile.Delivery shows them to the driver."""

    node_id = "in-process"

    def __init__(self, data: bytes, digest: bytes) -> None:
        self.data, self.digest, self.fallbacks = data, digest, 0

    def object_ref(self) -> bytes:
        return self.data


class _Workers:  # dpex.client._runtime.Workers, running task runners here
    options: dict = {"in-process": True}
    warm: frozenset = frozenset()

    def __init__(self, handoff: Any, wire: Wire) -> None:
        self.handoff, self.receiver = handoff, Receiver(wire)
        self.actors: dict[int, _Worker] = {}
        self.calls: list[tuple] = []
        self.received = 0  # data messages the workers sent (the session's "received")

    def start(self, specs: list, shipment: Shipment) -> None:
        for spec in specs:
            self._launch(spec, shipment)

    def restart(self, spec: Any, shipment: Shipment) -> None:
        self.calls.append(("restart", spec.worker_id, spec.incarnation))
        self._launch(spec, shipment)

    def add(self, spec: Any, shipment: Shipment) -> None:
        self.calls.append(("add", spec.worker_id))
        self._launch(spec, shipment)

    def retire(self, w: int) -> None:
        self._end(w, None)

    def kill(self, w: int) -> None:
        self.calls.append(("kill", w))
        self._end(w, RuntimeError("killed by dpex"))

    def stop(self) -> None:
        for worker in self.actors.values():
            worker.alive = False

    def placement_warning(self, waiting: list[int]) -> None:
        return None

    def _launch(self, spec: Any, shipment: Shipment) -> None:
        try:
            worker = _Worker(spec, shipment.delivery.data)
        except WorkerStartupError as exc:
            self.handoff.put(WorkerExit(spec.worker_id, exc, incarnation=spec.incarnation))
            return
        self.actors[spec.worker_id] = worker
        self.handoff.put(hello(spec.worker_id, pid=worker.pid))

    def _end(self, w: int, error: BaseException | None) -> None:
        worker = self.actors.get(w)
        if worker is not None and worker.alive:
            worker.alive = False
            self.handoff.put(WorkerExit(w, error, incarnation=worker.incarnation))

    # -- what the trainer's session sends ----------------------------------------------

    def deliver(self, message: Any) -> None:
        worker = self.actors.get(message.worker_id)
        if worker is None or not worker.alive:
            return
        runner = worker.runner
        if isinstance(message, SendTasks):
            out = [self.receiver.decode(worker.step(
                       lambda s=seq, i=indices: runner.run_task(message.epoch, s, i)))
                   for seq, indices in message.tasks]
            self.received += len(out)
            self.handoff.put(out)
        elif isinstance(message, Control) and message.kind is Kind.RESUME:
            worker.step(lambda: runner.resume(message.payload, epoch=message.epoch))
        elif isinstance(message, Control) and message.kind is Kind.SKIP:
            worker.step(lambda: runner.skip(message.payload, epoch=message.epoch))

    def query(self, w: int, epoch: int, seq: int) -> None:
        worker = self.actors.get(w)
        if worker is not None and worker.alive:
            self.handoff.put(RngReply(w, epoch, seq, worker.runner.rng_after(epoch, seq)))


class _Session(Session):
    """The trainer session's face to the driver, delivering to the workers here."""

    def __init__(self, workers: _Workers, wire: Wire) -> None:
        super().__init__(workers)
        self.wire = wire
        self.keys = SessionKeys.new()

    def counters(self) -> dict:
        return {"received": self.workers.received, "received_in_ring": 0,
                "security": "in-process", "unroutable": 0, "cuts": 0, "rejected": {}}

    async def snapshot(self) -> dict:
        return self.counters()


class _Loop(Loop):
    """The loop thread's face: what it is given runs at once, here."""

    def run(self, coro: Any, timeout: float) -> Any:
        import asyncio

        return asyncio.run(coro)


class _Runtime:
    def __init__(self, handoff: Any, config: Any) -> None:
        wire = Wire.new(config.max_message_bytes)
        self.workers = _Workers(handoff, wire)
        self.session = _Session(self.workers, wire)
        self.loop = _Loop()
        self.closed = False

    def open(self) -> None:
        pass

    def start(self, specs: list, shipment: Shipment) -> None:
        self.workers.start(specs, shipment)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.workers.stop()


class InProcess:
    """dpex.client._runtime.Runtimes with every worker in this process."""

    def __init__(self) -> None:
        self.runtimes: list[_Runtime] = []  # every iterator's, for a test to look into

    def prestart(self, *args: Any) -> None:
        pass

    def handed_off(self) -> None:
        pass

    def connect(self, head_address: str) -> None:
        pass

    def node_id(self) -> str:
        return "in-process"

    def ship(self, loader: Any, contents: Any, fleet: bool) -> Shipment:
        parts = ship_loader(contents, fleet=fleet)
        return Shipment(_Delivery(bytes(parts), parts.digest()), False, len(parts))

    def make(self, name: str, handoff: Any, config: Any, label: str, worker_class: type
             ) -> _Runtime:
        runtime = _Runtime(handoff, config)
        self.runtimes.append(runtime)
        return runtime

    def free_resources(self) -> dict:
        return {}


@contextlib.contextmanager
def workers_in_process() -> Iterator[InProcess]:
    """Every DpexDataLoader made inside runs its dpex workers in this process."""
    world, before = InProcess(), DpexDataLoader._runtimes
    DpexDataLoader._runtimes = world
    try:
        yield world
    finally:
        DpexDataLoader._runtimes = before
