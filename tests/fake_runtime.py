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

``driver(shards={w: [...]})``: an IterableDataset's worker group (the driver is told
``iterable``). Each worker iterates its own shard (``shards[w]``, one entry per
batch), as dpex's TaskRunner does: each task is its shard's next batch, whatever the
task's (placeholder) indices; once the shard is exhausted it answers END, and every
later task too, until a RESUME (a new epoch: its shard anew). A SKIP of ``n`` passes
over ``n`` batches before its epoch's next task (a task of another epoch, or a RESUME,
drops it). A new incarnation starts its shard anew, or where its spec's
``rng_state["dataset"]["pos"]`` says (a stateful dataset's own state, resumed).
Controls and tasks are applied in the order sent (``controls`` records them).
Without ``shards`` the work is map-style (``compute(indices)``): a RESUME or SKIP is
recorded, not acted on.
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
from dpex.client._scheduler import EPOCH_END, Control, SendTasks
from dpex.client._shipment import Shipment

__all__ = ["Session", "Loop", "Workers", "Runtime", "Owner", "driver", "draws", "hello",
           "batch", "rng_state", "start", "start_shards", "take", "rest", "indices",
           "round_robin", "wait_for"]


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
    # ("task", epoch, seq, indices), or ("resume" | "skip", epoch, payload): in order sent
    tasks: collections.deque = dataclasses.field(default_factory=collections.deque)
    computed: set = dataclasses.field(default_factory=set)  # (epoch, seq)
    # An IterableDataset's worker: where it stands in its shard, whether it found the
    # end, and the SKIP (epoch, n) it has yet to apply.
    pos: int = 0
    exhausted: bool = False
    skip: tuple[int, int] | None = None

    @property
    def pid(self) -> int:
        return 1000 + 10 * self.id + self.incarnation


class Workers:  # dpex.client._runtime.Workers, in memory
    options: dict = {}
    warm: frozenset = frozenset()

    def __init__(self, handoff: Any = None, compute: Callable[[Any], Any] = lambda i: i,
                 shards: dict[int, list] | None = None) -> None:
        """``handoff``: the driver's queue, where a live group's workers answer (None:
        it only records the calls); ``shards``: an IterableDataset's, per worker id
        (see the module's docstring)."""
        self.calls: list[tuple] = []
        self.actors: dict[int, FakeWorker] = {}  # each id's current incarnation
        self.handoff, self.compute, self.shards = handoff, compute, shards
        # (worker, incarnation, kind, epoch, payload): RESUME and SKIP, as each applied it
        self.controls: list[tuple] = []
        # An IterableDataset's workers: (worker, incarnation, epoch, seq) of each batch
        # of its shard, and of each END, it computed
        self.batches: list[tuple[int, int, int, int]] = []
        self.ends: list[tuple[int, int, int, int]] = []
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
            self._launch(spec)

    def restart(self, spec, shipped) -> None:
        self.calls.append(("restart", spec.worker_id, spec.incarnation))
        self._launch(spec)

    def add(self, spec, shipped) -> None:
        self.calls.append(("add", spec.worker_id, spec.num_workers))
        self._launch(spec)

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

    def _launch(self, spec) -> None:
        if self.handoff is None:
            return
        w = spec.worker_id
        # (a stateful dataset's own state, resumed: where its shard stands)
        pos = ((spec.rng_state or {}).get("dataset") or {}).get("pos", 0)
        self.actors[w] = FakeWorker(w, spec.incarnation, pos=pos)
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
        """A message the session sent: tasks are computed (or lost with a dead worker),
        controls applied in their turn."""
        worker = self.actors.get(message.worker_id)
        if worker is None or not worker.alive:
            return
        if isinstance(message, SendTasks):
            worker.tasks.extend(("task", message.epoch, seq, indices)
                                for seq, indices in message.tasks)
        elif isinstance(message, Control) and message.kind in (Kind.RESUME, Kind.SKIP):
            worker.tasks.append((message.kind.name.lower(), message.epoch, message.payload))
        else:
            return
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
            kind, epoch, *rest = worker.tasks.popleft()
            if kind != "task":
                self._control(worker, kind, epoch, rest[0])
                continue
            seq, indices = rest
            worker.computed.add((epoch, seq))
            self.computed.append((worker.id, worker.incarnation, seq))
            msg = (self._shard_task(worker, epoch, seq) if self.shards is not None else
                   batch(worker.id, seq, epoch, self.compute(indices), worker.incarnation))
            if (worker.id, seq) in self.drop:
                self.drop.discard((worker.id, seq))
            elif (worker.id, seq) in self.late:
                self.late.discard((worker.id, seq))
                self._held.append(msg)
            else:
                out.append(msg)
        if out:
            self.handoff.put(out)  # (data messages that arrived together)

    def _control(self, worker: FakeWorker, kind: str, epoch: int, payload: Any) -> None:
        """A RESUME or SKIP, in its turn among the tasks (TaskRunner.resume / skip)."""
        self.controls.append((worker.id, worker.incarnation, kind, epoch, payload))
        if self.shards is None:
            return  # (map-style: recorded only)
        if kind == "resume":  # a new epoch: the shard anew; a pending SKIP is dropped
            worker.pos, worker.exhausted, worker.skip = 0, False, None
        else:
            worker.skip = (epoch, payload)

    def _shard_task(self, worker: FakeWorker, epoch: int, seq: int) -> Message:
        """The shard's next batch, or END once it is exhausted (TaskRunner._run_task)."""
        shard = self.shards[worker.id]
        if worker.skip is not None:
            (skip_epoch, n), worker.skip = worker.skip, None
            if skip_epoch == epoch:  # (passed over: fetched and dropped)
                worker.pos += n
                worker.exhausted = worker.pos > len(shard)
        if not worker.exhausted and worker.pos < len(shard):
            worker.pos += 1
            self.batches.append((worker.id, worker.incarnation, epoch, seq))
            return batch(worker.id, seq, epoch, shard[worker.pos - 1], worker.incarnation)
        worker.exhausted = True
        self.ends.append((worker.id, worker.incarnation, epoch, seq))
        return Message(Kind.END, b"s", epoch, seq, worker.id, incarnation=worker.incarnation)


class Runtime:
    def __init__(self, handoff: Any = None, compute: Callable[[Any], Any] = lambda i: i,
                 shards: dict[int, list] | None = None) -> None:
        """``handoff``: the driver's queue, for a live worker group (see the module's
        docstring); None: one that only records. ``shards``: an IterableDataset's."""
        self.workers = Workers(handoff, compute, shards)
        self.session = Session(self.workers if handoff is not None else None)
        self.loop = Loop()
        self.closed = self.opened = False

    def open(self) -> None:
        self.opened = True

    def start(self, specs, shipped) -> None:
        self.workers.start(specs, shipped)

    def close(self) -> None:
        if not self.closed:
            self.closed = True
            self.workers.stop()


class Delivery:
    """The shipped loader's delivery as the driver and a worker group use it
    (dpex._shipfile.Delivery), with nothing behind it: the stand-in workers need no
    dataset."""

    digest = b"\1" * 16
    node_id = "node"
    kept = False
    fallbacks = 0

    def lend(self):
        return None

    def object_ref(self):
        return "ref"

    def release_local(self) -> None:
        pass

    def refuse_local(self) -> None:
        self.fallbacks += 1

    def closer(self):
        return lambda: None


class Owner:
    """The iterator's part: it owns the driver and is told when the driver stops it."""

    def __init__(self) -> None:
        self.stops = 0
        self.scaled: list[int] = []

    def stop(self) -> None:
        self.stops += 1
        self.driver.runtime.close()


def driver(num_workers=2, startup_timeout=120.0, max_restarts=3, *, live=False,
           compute: Callable[[Any], Any] = lambda i: i, before_start=None,
           shards: dict[int, list] | None = None, worker_rng: dict | None = None, **config):
    """An EpochDriver on an in-memory runtime: (driver, runtime, handoff, owner).
    ``live``: the worker group plays the workers (see the module's docstring);
    ``before_start(workers)`` sets them up before the driver starts them. ``shards``
    (live): an IterableDataset's, one list of batches per worker id (the driver is told
    ``iterable``); ``worker_rng``: the RNG states each worker id starts from (a resumed
    run's, as plan_launch would give them)."""
    handoff, owner = queue.SimpleQueue(), Owner()
    iterable = shards is not None
    runtime = Runtime(handoff if live else None, compute, shards)
    if before_start is not None:
        before_start(runtime.workers)
    plan = plan_launch(num_workers=num_workers, scaled_to=None, prefetch_factor=2,
                       iterable=iterable, worker_seeding="torch", resume=None)
    if worker_rng:
        plan = dataclasses.replace(plan, worker_rng=worker_rng)
    owner.driver = d = EpochDriver(
        runtime, handoff, DpexConfig(startup_timeout=startup_timeout,
                                     max_worker_restarts=max_restarts, **config),
        plan, Seeds(base=100, shared=None), ship=lambda: Shipment(Delivery(), False, 10),
        node_id="node", prefetch_factor=2, in_order=True, iterable=iterable, timeout=0,
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


def start_shards(d: EpochDriver, *, first_worker: int = 0, ended: frozenset = frozenset(),
                 skips: dict[int, int] | None = None, shared_seed: Any = None
                 ) -> Callable[[], Any]:
    """Begin an IterableDataset's epoch (torch's endless placeholder indices: it ends
    when every shard did); returns its draw. ``ended``, ``skips``: a resumed epoch's
    (see EpochDriver.start_epoch)."""
    def draw() -> list[None]:
        return [None]

    d.start_epoch(draw, shared_seed=shared_seed, first_worker=first_worker, ended=ended,
                  skips=skips or {})
    return draw


def round_robin(shards: dict[int, list], first_worker: int = 0,
                skips: dict[int, int] | None = None, ended: Any = ()) -> list[Any]:
    """torch's epoch over an IterableDataset's shards: one batch of each worker in turn
    from ``first_worker``, a worker left out of the turn once its shard ended
    (``skips``: batches each passes over first; ``ended``: shards over already)."""
    left = {w: collections.deque(shard[(skips or {}).get(w, 0):])
            for w, shard in shards.items() if w not in ended}
    order = sorted(left, key=lambda w: (w < first_worker, w))  # (from first_worker on)
    out = []
    while any(left.values()):
        for w in order:
            if left[w]:
                out.append(left[w].popleft())
    return out


def _next_batch(d: EpochDriver, draw: Callable[[], Any]) -> Any:
    """The next message that is not an END (the iterator passes over those)."""
    while (msg := d.next_message(draw)) is not EPOCH_END and msg.kind is Kind.END:
        pass
    return msg


def take(d: EpochDriver, draw: Callable[[], Any], k: int) -> list[Any]:
    """The next ``k`` batches' payloads."""
    return [_next_batch(d, draw).payload for _ in range(k)]


def wait_for(d: EpochDriver, condition: Callable[[], bool], limit: float = 5.0) -> None:
    """Take in the driver's events (no batch) until ``condition()`` holds."""
    deadline = time.monotonic() + limit
    while not condition():
        assert time.monotonic() < deadline, "the condition did not come true"
        d.receive_one(until=min(deadline, time.monotonic() + 0.05))


def rest(d: EpochDriver, draw: Callable[[], Any]) -> list[Any]:
    """The rest of the epoch's payloads."""
    out = []
    while (msg := _next_batch(d, draw)) is not EPOCH_END:
        out.append(msg.payload)
    return out
