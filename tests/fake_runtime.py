"""An iterator's runtime in memory (dpex.client._runtime.Runtime): no Ray, no sockets,
no threads, for driving an :class:`~dpex.client._driver.EpochDriver` in milliseconds.

The loop thread runs what it is given at once, the session records what it sends, the
worker group records what it starts. That is all a test gets with ``driver()``: it
plays the workers itself, putting their events on the driver's queue (``hello``,
``batch``, ``WorkerExit``, ``RngReply``).

``driver(live=True)`` also has the group play the workers, as dpex's do, on that queue
(batches too: the session's data socket, which the training thread reads itself, is
empty here):

- a worker says HELLO once started (``restart``, ``add`` too), unless its id is in
  ``Workers.never_start`` (a worker that never starts: ``say_hello(w)`` later, if ever);
- the tasks sent to it are computed at once (``compute(indices)`` is the batch), in
  the order sent, unless it is ``pause``-d (they wait for ``resume(w)``); tasks for a
  worker not ready yet wait for its HELLO, as the session holds them; tasks sent to a
  dead incarnation are lost with it;
- ``die(w)`` ends its current incarnation (its tasks with it), and the group reports
  the exit as Ray would; ``kill(w)`` (the driver's) does the same;
- a data message in ``drop`` (``(worker, seq)``) never arrives; one in ``late`` is held
  until ``release_late()``;
- it answers an RNG_QUERY with the states it had right after that batch
  (``rng_state(w, incarnation, epoch, seq)``), None for a batch it never computed,
  and nothing at all if its id is in ``mute`` or it is dead.

Only map-style work: a RESUME or SKIP is recorded, not acted on.
"""

from __future__ import annotations

import collections
import dataclasses
import queue
import time
from collections.abc import Callable
from types import SimpleNamespace
from typing import Any

from dpex._config import DpexConfig
from dpex._protocol import Kind, Message
from dpex._version import local_versions
from dpex.client._driver import EpochDriver
from dpex.client._events import RngReply, WorkerExit, WorkerHello
from dpex.client._launch import plan_launch
from dpex.client._runtime import Seeds
from dpex.client._scheduler import EPOCH_END, SendTasks

__all__ = ["Session", "Loop", "Workers", "Runtime", "Owner", "driver", "draws", "hello",
           "batch", "rng_state", "start", "take", "rest", "indices", "wait_for"]


def hello(w: int, pid: int = 7, node_ip: str = "127.0.0.1") -> WorkerHello:
    return WorkerHello(w, {"versions": local_versions(), "node_ip": node_ip, "pid": pid})


def batch(w: int, seq: int, epoch: int = 1, payload: Any = None, incarnation: int = 0
          ) -> Message:
    return Message(Kind.BATCH, b"s", epoch, seq, w, payload if payload is not None else seq,
                   incarnation=incarnation)


def rng_state(w: int, incarnation: int, epoch: int, seq: int) -> dict:
    """What a live fake worker says its RNG states were right after batch ``seq``."""
    return {"worker": w, "incarnation": incarnation, "after": (epoch, seq)}


class Session:
    """The trainer session's face to the driver: what was sent, in order (and, with a
    live worker group, delivered to it)."""

    wire, data_address, control_address = "wire", "tcp://127.0.0.1:1", "tcp://127.0.0.1:2"
    keys = SimpleNamespace(client="keys")

    def __init__(self, workers: Workers | None = None) -> None:
        self.sent: list[tuple] = []
        self.fail_with: Exception | None = None
        self.workers = workers  # (live: the messages reach it)

    def send_all(self, messages) -> None:
        if self.fail_with is not None:
            raise self.fail_with
        self.sent.append(("send_all", [(type(m).__name__, m.worker_id) for m in messages]))
        if self.workers is not None:
            for m in messages:
                self.workers.deliver(m)

    def receive(self) -> list:
        return []  # (batches come on the driver's queue here)

    def wait(self, timeout: float) -> None:
        time.sleep(min(timeout, 0.005))

    def send(self, w, kind, *payload) -> None:
        self.sent.append(("send", w, kind, *payload))
        if self.workers is not None and kind is Kind.RNG_QUERY:
            self.workers.query(w, *payload)

    def expect(self, w, incarnation) -> None:
        self.sent.append(("expect", w, incarnation))

    def forget(self, w) -> None:
        self.sent.append(("forget", w))

    def retire_ring(self, ring_id) -> None:
        self.sent.append(("retire_ring", ring_id))

    def new_ring(self, size, node, w):
        raise OSError("no rings in memory")

    def counters(self) -> dict:
        return {}


class Loop:
    """The loop thread: runs what it is given at once, and counts the crossings."""

    running = True

    def __init__(self) -> None:
        self.crossings = 0

    def call_soon(self, fn, *args) -> None:
        self.crossings += 1
        fn(*args)


@dataclasses.dataclass
class FakeWorker:
    """One incarnation of a worker id, as the live group plays it."""

    id: int
    incarnation: int
    alive: bool = True
    ready: bool = False
    paused: bool = False
    tasks: collections.deque = dataclasses.field(default_factory=collections.deque)
    computed: set = dataclasses.field(default_factory=set)  # (epoch, seq)

    @property
    def pid(self) -> int:
        return 1000 + 10 * self.id + self.incarnation


class Workers:  # dpex.client._runtime.Workers, in memory
    options: dict = {}

    def __init__(self, handoff: Any = None, compute: Callable[[Any], Any] = lambda i: i
                 ) -> None:
        """``handoff``: the driver's queue, where a live group's workers answer (None:
        it only records the calls)."""
        self.calls: list[tuple] = []
        self.actors: dict[int, FakeWorker] = {}  # each id's current incarnation
        self.handoff, self.compute = handoff, compute
        self.never_start: set[int] = set()  # ids whose next start never says HELLO
        self.mute: set[int] = set()  # ids that do not answer an RNG_QUERY
        self.drop: set[tuple[int, int]] = set()  # (worker, seq): data messages lost
        self.late: set[tuple[int, int]] = set()  # (worker, seq): held until release_late()
        self._held: list[Message] = []
        self.computed: list[tuple[int, int, int]] = []  # (worker, incarnation, seq), in order

    # -- what the driver asks (dpex.client._runtime.Workers) ------------------------

    def start(self, specs, shipped) -> None:
        self.calls.append(("start", [s.worker_id for s in specs], shipped))
        for spec in specs:
            self._launch(spec.worker_id, spec.incarnation)

    def restart(self, spec, shipped) -> None:
        self.calls.append(("restart", spec.worker_id, spec.incarnation))
        self._launch(spec.worker_id, spec.incarnation)

    def add(self, spec, shipped) -> None:
        self.calls.append(("add", spec.worker_id, spec.num_workers))
        self._launch(spec.worker_id, spec.incarnation)

    def retire(self, w) -> None:
        self.calls.append(("retire", w))
        if self.handoff is not None:
            self._end(w, None)  # (its exit is expected)

    def kill(self, w) -> None:
        self.calls.append(("kill", w))
        if self.handoff is not None:
            self._end(w, RuntimeError("killed by dpex"))

    def stop(self) -> None:
        self.calls.append(("stop",))
        for worker in self.actors.values():
            worker.alive = False

    def placement_warning(self, missing):
        return None

    # -- the workers, played (live) ----------------------------------------------------

    def _launch(self, w: int, incarnation: int) -> None:
        if self.handoff is None:
            return
        self.actors[w] = FakeWorker(w, incarnation)
        if w in self.never_start:
            self.never_start.discard(w)
        else:
            self.say_hello(w)

    def say_hello(self, w: int) -> None:
        """Worker ``w``'s current incarnation is ready: its HELLO, then its held tasks."""
        worker = self.actors[w]
        worker.ready = True
        self.handoff.put(hello(w, pid=worker.pid))
        self._compute(worker)

    def deliver(self, message: Any) -> None:
        """A message the session sent: tasks are computed (or lost with a dead worker)."""
        worker = self.actors.get(message.worker_id)
        if not isinstance(message, SendTasks) or worker is None or not worker.alive:
            return
        worker.tasks.extend((message.epoch, seq, indices) for seq, indices in message.tasks)
        self._compute(worker)

    def pause(self, w: int) -> None:
        """Worker ``w`` computes nothing until ``resume(w)``: its tasks wait."""
        self.actors[w].paused = True

    def resume(self, w: int) -> None:
        self.actors[w].paused = False
        self._compute(self.actors[w])

    def holds(self, w: int) -> int:
        """How many tasks worker ``w``'s current incarnation has and has not computed."""
        return len(self.actors[w].tasks)

    def die(self, w: int, error: BaseException | None = None) -> None:
        """Worker ``w``'s current incarnation dies (its tasks with it); Ray reports it."""
        self._end(w, error if error is not None else RuntimeError("killed"))

    def release_late(self) -> None:
        """The data messages held back (``late``) arrive now."""
        held, self._held = self._held, []
        if held:
            self.handoff.put(held)

    def query(self, w: int, epoch: int, seq: int) -> None:
        worker = self.actors.get(w)
        if worker is None or not worker.alive or w in self.mute:
            return
        state = (rng_state(w, worker.incarnation, epoch, seq)
                 if (epoch, seq) in worker.computed else None)
        self.handoff.put(RngReply(w, epoch, seq, state))

    def _end(self, w: int, error: BaseException | None) -> None:
        worker = self.actors.get(w)
        if worker is None or not worker.alive:
            return
        worker.alive = False
        worker.tasks.clear()
        self.handoff.put(WorkerExit(w, error, incarnation=worker.incarnation))

    def _compute(self, worker: FakeWorker) -> None:
        if not (worker.alive and worker.ready) or worker.paused:
            return
        out = []
        while worker.tasks:
            epoch, seq, indices = worker.tasks.popleft()
            worker.computed.add((epoch, seq))
            self.computed.append((worker.id, worker.incarnation, seq))
            msg = batch(worker.id, seq, epoch, self.compute(indices), worker.incarnation)
            if (worker.id, seq) in self.drop:
                self.drop.discard((worker.id, seq))
            elif (worker.id, seq) in self.late:
                self.late.discard((worker.id, seq))
                self._held.append(msg)
            else:
                out.append(msg)
        if out:
            self.handoff.put(out)  # (data messages that arrived together)


class Runtime:
    def __init__(self, handoff: Any = None, compute: Callable[[Any], Any] = lambda i: i
                 ) -> None:
        """``handoff``: the driver's queue, for a live worker group (see the module's
        docstring); None: one that only records."""
        self.workers = Workers(handoff, compute)
        self.session = Session(self.workers if handoff is not None else None)
        self.loop = Loop()
        self.closed = self.opened = False

    def open(self) -> None:
        self.opened = True

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.workers.stop()


class Owner:
    """The iterator's part: it owns the driver and is told when the driver stops it."""

    def __init__(self) -> None:
        self.stops = 0
        self.scaled: list[int] = []

    def stop(self) -> None:
        self.stops += 1
        self.driver.runtime.close()


def driver(num_workers=2, startup_timeout=120.0, max_restarts=3, *, live=False,
           compute: Callable[[Any], Any] = lambda i: i, before_start=None, **config):
    """An EpochDriver on an in-memory runtime: (driver, runtime, handoff, owner).
    ``live``: the worker group plays the workers (see the module's docstring);
    ``before_start(workers)`` sets them up before the driver starts them."""
    handoff, owner = queue.SimpleQueue(), Owner()
    runtime = Runtime(handoff if live else None, compute)
    if before_start is not None:
        before_start(runtime.workers)
    plan = plan_launch(num_workers=num_workers, scaled_to=None, prefetch_factor=2,
                       iterable=False, worker_seeding="torch", resume=None)
    owner.driver = d = EpochDriver(
        runtime, handoff, DpexConfig(startup_timeout=startup_timeout,
                                     max_worker_restarts=max_restarts, **config),
        plan, Seeds(base=100, shared=None), ship=lambda: ("ref", False), shipped_bytes=10,
        node_id="node", prefetch_factor=2, in_order=True, iterable=False, timeout=0,
        on_stop=owner.stop, on_scaled=owner.scaled.append,
        free_resources=lambda: {"CPU": 0.0})
    return d, runtime, handoff, owner


def draws(n=8):
    it = iter([[i] for i in range(n)])
    return lambda: next(it)


def indices(n: int) -> list[list[int]]:
    """The epoch ``draws(n)`` gives, batch by batch (what a lossless epoch yields)."""
    return [[i] for i in range(n)]


def start(d: EpochDriver, n: int) -> Callable[[], Any]:
    """Begin an epoch of ``n`` index batches (``draws(n)``); returns its draw."""
    draw = draws(n)
    d.start_epoch(draw, shared_seed=None, first_worker=0, ended=frozenset(), skips={})
    return draw


def take(d: EpochDriver, draw: Callable[[], Any], k: int) -> list[Any]:
    """The next ``k`` batches' payloads."""
    return [d.next_message(draw).payload for _ in range(k)]


def wait_for(d: EpochDriver, condition: Callable[[], bool], limit: float = 5.0) -> None:
    """Take in the driver's events (no batch) until ``condition()`` holds."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true"
        d.receive_one(until=min(deadline, time.monotonic() + 0.05))


def rest(d: EpochDriver, draw: Callable[[], Any]) -> list[Any]:
    """The rest of the epoch's payloads."""
    out = []
    while (msg := d.next_message(draw)) is not EPOCH_END:
        out.append(msg.payload)
    return out
