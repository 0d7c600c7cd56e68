"""The epoch's rules in one place, pure: no I/O, no Ray, no threads.

:class:`EpochScheduler` decides, for one iterator, which index batch goes to
which worker, which arriving result counts, when the training loop may take a
batch, when the epoch ends, and what a worker's death or a lost batch requires.
The iterator drives it with events and carries out the actions it returns, in
the order returned (a replacement is started before tasks are sent to it):

=========================  ===================================================
event                      actions it may return
=========================  ===================================================
``start_epoch(draw)``      ``Control`` (RESUME) to every worker, ``SendTasks``
``take(draw)``             ``SendTasks`` for the credit a taken slot frees
``results(messages)``      ``SendTasks`` / ``KillWorker`` for overtaken tasks
``ready(w, info)``         none
``exited(w, ...)``         ``Fatal``, or ``StartReplacement`` then ``Control``
                           (SKIP) and ``SendTasks``
``check_lost()``           ``SendTasks`` / ``KillWorker`` for silent workers,
                           lost batches and overdue ones; ``Fatal`` once dpex's
                           kills of a worker or a batch are spent
``progress(w, ...)``       none (a PROGRESS: what the worker computes)
``add_worker(draw)``       ``StartWorker``, ``SendTasks`` for the credit it adds
``retire_worker(w)``       ``SendTasks`` (its queued tasks, to others), later
                           ``StopWorker`` once it holds nothing
=========================  ===================================================

The worker set is elastic for a map-style dataset: a worker added during an epoch
takes tasks once it is ready (its credits serve the others until then); a retired
one takes no new task, finishes those it holds and is then stopped, and if it dies
first they go to the others. Which worker computes a batch never changes the batch
(``worker_seeding="per_batch"``, or a dataset that draws nothing from the worker's
RNG), so the epoch is unchanged. An IterableDataset's shards are per worker: its
worker count is fixed.

Invariants (tests/test_scheduler.py checks them, one test drives the scheduler
with scrambled arrivals, duplicates, losses, deaths and restarts):

1. Each epoch hands the training loop slots 0, 1, ... in order (``in_order``)
   and each exactly once, whatever the order and duplication of arrivals.
2. ``in_flight`` (dispatched and not taken) never exceeds ``capacity``
   (``prefetch_factor ×`` the workers that take tasks; after a retirement until
   the training loop has taken the excess); it is the ledger's count of live
   tasks, not a counter kept beside it.
3. A result counts only if it is of the current epoch, its task is outstanding,
   its sender is the current incarnation of its worker id (the header says,
   whatever the transport) and, for an IterableDataset, it comes from the task's
   owner; any other copy is counted (stale, stale_incarnation, misrouted,
   duplicate) and dropped.
4. The tasks a dead or silent worker held whose results did not arrive are
   exactly the tasks sent again: a map-style batch to the ready worker holding
   least (torch defines nothing about which worker computes a batch), an
   IterableDataset's by a replacement of its worker, which first passes over
   what its predecessor delivered (the shard is the worker's).
5. The epoch ends when every slot drawn is taken and the sampler is exhausted,
   or no worker can take more (an IterableDataset whose shards all ended).
"""

from __future__ import annotations

import collections
import time
from collections.abc import Callable
from typing import Any

from dpex._config import prefetch_window
from dpex._protocol import Kind, Message
from dpex.client._actions import (
    Control,
    Fatal,
    SendTasks,
    StartReplacement,
    StartWorker,
    StopWorker,
)
from dpex.client._backups import Backups
from dpex.client._kills import MAX_HANGS_PER_BATCH, KillBudget, KillWorker
from dpex.client._ledger import TaskLedger
from dpex.client._loss_rules import LossRules
from dpex.client._lost import IDLE, LossWatch
from dpex.client._ordering import OrderingBuffer
from dpex.client._worker_table import Recovery, WorkerTable, recovery

__all__ = ["EpochScheduler", "MAX_HANGS_PER_BATCH", "SendTasks", "Control", "StartReplacement", "KillWorker", "Fatal",
           "StartWorker", "StopWorker", "EPOCH_END"]

EPOCH_END = object()  # what take() returns once the epoch has nothing more


# -- the scheduler -----------------------------------------------------------------------

class EpochScheduler(LossRules):
    def __init__(self, num_workers: int, prefetch_factor: int, *, in_order: bool = True,
                 iterable: bool = False, max_restarts: int = 3,
                 lost_timeout: float | None = None, lost_floor: float = 10.0,
                 first_batch_timeout: float | None = None, hung_timeout: float | None = None,
                 straggler_timeout: float | str | None = None,
                 clock: Callable[[], float] = time.monotonic) -> None:
        if (window := prefetch_window(prefetch_factor, num_workers)) < 1:
            raise ValueError(f"credit window capacity must be >= 1, got {window}")
        self.prefetch_factor = prefetch_factor
        self.in_order, self.iterable = in_order, iterable
        self.max_restarts = max_restarts
        self.clock = clock
        self.workers = WorkerTable(num_workers)  # (the ledger and the watch keep counts there)
        self.ledger = TaskLedger(self.workers)
        self.buffer = OrderingBuffer(in_order)
        self.losses = LossWatch(self.workers, lost_timeout, lost_floor, clock,
                                first_limit=first_batch_timeout, hung_limit=hung_timeout)
        self.kill_budget = KillBudget()
        self.straggler_timeout = None if iterable else straggler_timeout  # (one owner)
        self.backups = Backups()
        self.counters: collections.Counter[str] = collections.Counter()
        self.recoveries: list[dict] = []  # one per restart: when reported, when ready
        self.epoch = 0
        self._sent = 0  # the next seq
        self._turn = 0  # the worker id whose turn is next (torch's round robin)
        self._out: list[Any] = []
        # Tasks drawn (at torch's moment: one per slot taken) but not yet sent. They go
        # out in groups, so the loop thread wakes once per group, not once per batch:
        # when ``group`` have gathered, when a worker has nothing else to do, or when
        # the training loop is about to wait for the one slot that is unsent.
        self._unsent: dict[int, list[tuple[int, Any]]] = {}
        # The workers' recent times per batch (LossWatch.batch_time: from when a worker
        # could start a task to its result), the autoscaler's input.
        self.batch_times: collections.deque[float] = collections.deque(maxlen=64)

    @property
    def num_workers(self) -> int:
        """The workers that take tasks now (the ids run higher once some retired); a
        suspended one counts: its credits serve the others until it is heard or replaced."""
        return sum(not (r.retiring or r.gone) for r in self.workers.records)

    @property
    def capacity(self) -> int:
        """The credit window: ``prefetch_factor`` per worker that takes tasks (one while
        none does)."""
        return prefetch_window(self.prefetch_factor, max(1, self.num_workers))

    @property
    def group(self) -> int:
        return max(1, self.capacity // 2)

    @property
    def in_flight(self) -> int:
        """Batches dispatched and not yet taken: the credits in use."""
        return self.ledger.live()

    def _actions(self) -> list[Any]:
        out, self._out = self._out, []
        return out

    # -- epochs and dispatch ---------------------------------------------------------

    def start_epoch(self, draw: Callable[[], Any], resume: Any = None,
                    first_worker: int = 0, ended: frozenset[int] = frozenset(),
                    skips: dict[int, int] | None = None) -> list[Any]:
        """A new epoch whose index batches ``draw()`` returns (StopIteration at the
        end); from the second on, every worker is told to RESUME with ``resume``.
        Its first batch goes to ``first_worker`` (torch's turn starts at worker 0; a
        resumed epoch's at the worker whose turn it was). A resumed IterableDataset
        epoch names the workers whose shards ``ended`` already and how many batches
        each worker ``skips`` (it delivered them before). (``draw`` is passed, never
        kept: the scheduler holds no reference to the iterator that owns it.)"""
        self.epoch += 1
        self._sent = 0
        self.buffer.reset()
        self.ledger.reset()
        self.losses.new_epoch()
        self.backups.new_epoch()
        self.kill_budget.new_epoch()
        self.workers.new_epoch()
        self._turn = first_worker % len(self.workers)
        self._unsent = {}
        if self.epoch > 1:
            self._out += [Control(r.id, Kind.RESUME, self.epoch, resume)
                          for r in self.workers.live()]
        for w in ended:
            rec = self.workers[w]
            rec.active, rec.ended_seq = False, -1
        self._stop_drained()
        for w, n in (skips or {}).items():
            self.workers[w].skipped = n
        self._out += [Control(r.id, Kind.SKIP, self.epoch, r.skipped)
                      for r in self.workers.records if r.skipped]
        self._dispatch(draw, self.capacity)
        self._flush()
        return self._actions()

    def _next_worker(self) -> int | None:
        """torch's choice: the next active worker in turn; with ``in_order=False`` only
        one holding fewer than its share of the window, so a slow worker cannot hoard it.
        A map-style dataset's replacement that is still starting is passed over while
        another worker can take the batch (an IterableDataset's shard is its worker's).
        A worker added during the iteration gets its own tasks in turn from the start
        (held for it until it is ready): lent to the others, its credits would queue on
        them a backlog that the in-order loop has to wait through, at the old pace,
        before the added worker's first result could count (with ``in_order=False``,
        where nothing waits for a slot, they serve the others meanwhile)."""
        # (the share of those that can start a task now)
        share = self.capacity // max(1, sum(r.active and r.accepting and not r.starting
                                            for r in self.workers.records))
        fallback = None
        for _ in range(len(self.workers)):
            rec = self.workers[self._turn]
            self._turn = (self._turn + 1) % len(self.workers)
            if rec.active and rec.accepting and (
                    self.in_order or rec.starting or rec.held < share):
                if not rec.starting or self.iterable or (
                        self.in_order and rec.added and rec.incarnation == 0):
                    return rec.id
                fallback = rec.id if fallback is None else fallback
        if fallback is not None and self.workers[fallback].added and any(
                r.accepting and r.active and not r.starting for r in self.workers.records):
            return None  # the others are at their share: wait for a credit, not for it
        return fallback

    def _dispatch(self, draw: Callable[[], Any], n: int, to: int | None = None) -> None:
        """Draw up to ``n`` index batches, as credits allow, and queue them as tasks
        (for worker ``to``, or each for the next worker in turn)."""
        for _ in range(n):
            if self.in_flight >= self.capacity:
                break
            # A map-style batch is drawn only once a worker can take it (none can while
            # the others are at their share and an added one starts: in_order=False).
            w = to if to is not None else None if self.iterable else self._next_worker()
            if w is None and not self.iterable:
                break
            try:
                index = draw()
            except StopIteration:
                break
            if self.iterable:
                w = self._next_worker()
            if w is None:
                # As torch: the drawn index is dropped. Only an IterableDataset (whose
                # "indices" are placeholders) can have no worker here.
                break
            seq, self._sent = self._sent, self._sent + 1
            self.ledger.dispatch(seq, w, index)
            if self.iterable:  # (a map-style task needs no record once it is taken)
                self.workers[w].shard.dispatched(seq, index)
            self._unsent.setdefault(w, []).append((seq, index))

    def _starving(self, w: int) -> bool:
        """Every task ``w`` has is still here: it has nothing to compute."""
        return self.ledger.pending(w) == len(self._unsent.get(w, ()))

    def _flush(self, only_if_needed: bool = False) -> None:
        """Send the queued tasks (with ``only_if_needed``: when a group has gathered, a
        worker would go idle, or the next slot's task is among them)."""
        if not self._unsent:
            return
        if only_if_needed and sum(map(len, self._unsent.values())) < self.group and not any(
                self._starving(w) for w in self._unsent):
            return
        for w, tasks in self._unsent.items():
            for seq, _ in tasks:
                self.losses.sent(seq)
            self._out.append(SendTasks(w, self.epoch, tasks))
        self._unsent = {}

    def _unqueue(self, w: int) -> None:
        """Forget ``w``'s queued tasks: they are re-routed with its outstanding ones."""
        self._unsent.pop(w, None)

    # -- the training loop's side -----------------------------------------------------

    def take(self, draw: Callable[[], Any]) -> tuple[Any, list[Any]]:
        """The next message for the training loop (END and ERROR included), ``None``
        if it has not arrived, or ``EPOCH_END``; and the actions its credit allows
        (new index batches come from ``draw``)."""
        # Slots given to an IterableDataset worker after the task that found its shard
        # exhausted hold nothing (one before it that is missing was lost: it is redone).
        # Its tasks are never given to another worker, so "after" is a larger seq.
        while self.buffer.next_seq < self._sent:
            seq = self.buffer.next_seq
            rec = self.workers[self.ledger.worker_of(seq)]
            if seq in self.buffer or rec.active or seq < rec.ended_seq:
                break
            self.buffer.skip(seq)
            self._taken(draw, seq)
        ready = self.buffer.pop()
        if ready is not None:
            seq, msg = ready
            self._taken(draw, seq)
            self._flush(only_if_needed=True)
            return msg, self._actions()
        if self.buffer.next_seq >= self._sent:
            return EPOCH_END, self._actions()
        # About to wait. Tasks still queued are sent if a worker has nothing else, or
        # the slot waited for is among them (with in_order=False: any slot).
        self._flush(only_if_needed=self.in_order and all(
            seq != self.buffer.next_seq for tasks in self._unsent.values() for seq, _ in tasks))
        return None, self._actions()

    def _taken(self, draw: Callable[[], Any], seq: int) -> None:
        """Slot ``seq`` was taken (or passed over): its bookkeeping ends here, and its
        credit draws the next task."""
        if self.iterable:
            self.workers[self.ledger.worker_of(seq)].shard.taken(seq)
        self.ledger.consumed(seq)
        self.losses.forget(seq)
        self._dispatch(draw, 1)

    # -- what the workers send ----------------------------------------------------------

    def results(self, messages: list[Message]) -> list[Any]:
        for msg in messages:
            self._result(msg)
        self._stop_drained()
        return self._actions()

    def _stop_drained(self) -> None:
        """Stop each retiring worker that holds nothing any more (its last results came,
        or others computed them: a hand-over after a loss). Per burst of results: no
        loop unless a worker was ever retired (an exit while retiring stops it there)."""
        if not self.counters["retired"]:
            return
        for rec in self.workers.records:
            if rec.retiring and not rec.gone and not rec.pending:
                self._stop(rec.id)

    def _result(self, msg: Message) -> None:
        owner = self.ledger.worker_of(msg.seq)
        sender = self.workers[msg.worker_id] if msg.worker_id < len(self.workers) else None
        if sender is not None and sender.straggling == (msg.epoch, msg.seq) and (
                msg.incarnation == sender.incarnation):
            sender.straggling = None  # done with the batch it straggled on: tasks again
        if msg.worker_id < len(self.workers) and self.workers[msg.worker_id].suspended:
            self._heard(msg.worker_id, msg.incarnation)  # (late and stale ones too)
        if msg.epoch != self.epoch or owner is None:
            self.counters["stale"] += 1
            return
        if msg.worker_id != owner and self.iterable:
            self.counters["misrouted"] += 1
            return
        if msg.incarnation != self.workers[msg.worker_id].incarnation:
            self.counters["stale_incarnation"] += 1  # sent late by a replaced worker
            return
        # (A map-style batch given to another worker may come from its first owner: the
        # same batch, and the first copy to arrive counts.)
        fresh = self.ledger.received(msg.seq)
        self.workers[msg.worker_id].batches += fresh
        if self.backups.arrived(msg.seq, msg.worker_id, fresh):
            self._backup_wasted(owner, msg.seq)
        now = msg.received_at if msg.received_at is not None else self.clock()
        # The worker's own time on the batch where it says (the header's took_us): the
        # trainer reads batches when the training loop asks, so ``now`` may be late.
        worked = msg.took_us / 1e6 if msg.took_us else None
        if fresh and msg.worker_id == owner:
            took = worked if worked is not None else self.losses.batch_time(owner, msg.seq,
                                                                             now)
            if took is not None and took > 0:
                self.batch_times.append(took)
        if msg.worker_id == owner:  # a duplicate can overtake a loss too
            lost = self.losses.result(  # (nothing left to overtake: no sort per batch)
                owner, msg.seq, self.ledger.outstanding(owner) if self.ledger.pending(owner) else [],
                now, took=worked)
            if lost:
                self.counters["lost"] += len(lost)
                self._recompute(owner, lost)
        if not fresh:  # e.g. late, from a worker presumed dead; or redone
            self.counters["duplicate"] += 1
            return
        if msg.kind is Kind.END:
            rec = self.workers[msg.worker_id]
            rec.active, rec.ended_seq = False, msg.seq
        if not self.buffer.put(msg.seq, msg):
            self.counters["stale"] += 1

    def _heard(self, worker_id: int, incarnation: int) -> bool:
        """Any authenticated message of ``worker_id``'s current incarnation (a late copy
        of a batch another worker delivered, a PROGRESS): it answers, so it is not hung
        and, if it was suspended, takes tasks again. False for another incarnation's."""
        rec = self.workers[worker_id]
        if incarnation != rec.incarnation or rec.gone:
            return False
        self.losses.heard(worker_id)
        if rec.suspended:
            rec.suspended = False
            self.counters["unsuspended"] += 1
        return True

    def progress(self, worker_id: int, incarnation: int, epoch: int, seq: int,
                 working_s: float, queued: int = 0, at: float | None = None) -> list[Any]:
        """A PROGRESS of ``worker_id``: its compute thread works on ``seq`` of ``epoch``
        (or is IDLE, or LOADING) for ``working_s`` seconds, ``queued`` items waiting."""
        if worker_id >= len(self.workers) or not self._heard(worker_id, incarnation):
            return []
        rec = self.workers[worker_id]
        if rec.straggling is not None and rec.straggling != (epoch, seq):
            rec.straggling = None  # done with the batch it straggled on: tasks again
        holds = [s for s, _ in self.ledger.outstanding(worker_id)] if self.ledger.pending(
            worker_id) else []
        if (epoch != self.epoch and seq >= 0) or (seq == IDLE and queued):
            seq = None  # another epoch's task, or between two tasks: compares to nothing
        self.losses.progress(worker_id, seq, working_s, holds, at)
        return self._actions()

    def ready(self, worker_id: int, info: dict) -> list[Any]:
        """The current incarnation of ``worker_id`` said HELLO."""
        rec = self.workers[worker_id]
        rec.info = rec.known = info
        if rec.first_ready_at is None:
            rec.first_ready_at = self.clock()
        self.losses.alive(worker_id)
        for r in self.recoveries:
            if r["worker"] == worker_id and "ready_at" not in r:
                r["ready_at"] = self.clock()
        return self._actions()

    def exited(self, worker_id: int, incarnation: int, *, startup_error: bool = False,
               unplaced: bool = False, cause: str = "?", at: float | None = None,
               moved: bool = False) -> list[Any]:
        """A worker's actor ended (its ``serve`` call returned or failed); ``moved``: its
        fleet worker ended the session (``dpex fleet scale`` removed it), or the actor a
        session was a guest on died, which is replaced without counting against
        ``max_restarts``."""
        rec = self.workers[worker_id]
        if incarnation != rec.incarnation or rec.gone:
            return []  # a predecessor, replaced already; or a retired worker, stopped
        if rec.retiring or (rec.added and rec.known is None):
            # Died while retiring, or an added worker that never started: not replaced
            # (the others hold the epoch); what it held goes to them.
            self.counters["retired_died" if rec.retiring else "add_failed"] += 1
            rec.retiring = True
            self._unqueue(worker_id)
            self._stop(worker_id)  # (its StopWorker cleans up after the dead actor)
            return self._actions()
        if moved:
            rec.moves += 1
            self.counters["moved"] += 1
        decision = recovery(rec, startup_error=startup_error, unplaced=unplaced,
                            max_restarts=self.max_restarts)
        if decision is not Recovery.RESTART:
            return [Fatal(worker_id, startup=decision is Recovery.STARTUP_FAILED)]
        self.recoveries.append({"worker": worker_id,
                                "reported_at": self.clock() if at is None else at,
                                "cause": cause})
        self._restart(worker_id)
        return self._actions()

    def _restart(self, w: int) -> None:
        """A replacement with the same worker id gets every task of this epoch whose
        result has not arrived (map-style: the survivors take them at once)."""
        rec = self.workers[w]
        rec.incarnation += 1
        rec.info, rec.suspended, rec.killed, rec.straggling = None, False, False, None
        self._unqueue(w)  # they are among its outstanding tasks, re-routed below
        self.counters["restarted"] += 1
        self.losses.replaced(w)
        self._out.append(StartReplacement(w, rec.incarnation))
        tasks = self.ledger.outstanding(w)
        if self.iterable:
            # The shard is this worker's: the replacement passes over the batches before
            # the first one missing, then redoes every task from there on (results that
            # did arrive come again as duplicates and are dropped).
            at, tasks = rec.shard.from_seq(min((seq for seq, _ in tasks), default=None))
            at += rec.skipped  # (a resumed epoch: delivered before it too)
            if at:
                self._out.append(Control(w, Kind.SKIP, self.epoch, at))
        elif self._hand_over(w, tasks):
            return  # the survivors compute them now; the replacement takes new tasks
        if tasks:
            self.counters["redispatched"] += len(tasks)
            for seq, _ in tasks:
                self.losses.sent(seq)
            self._out.append(SendTasks(w, self.epoch, tasks))

    # -- an elastic worker set ------------------------------------------------------------

    def add_worker(self, draw: Callable[[], Any]) -> list[Any]:
        """One more worker (a new id): started at once, given tasks once ready. The
        credit it adds holds its own tasks until then with ``in_order`` (see
        :meth:`_next_worker`), else serves the others meanwhile."""
        if self.iterable:
            raise ValueError("an IterableDataset's worker count is fixed: each worker "
                             "iterates its own shard")
        rec = self.workers.add()  # (its one record: the ledger's and the watch's counts too)
        self.counters["added"] += 1
        self._out.append(StartWorker(rec.id))
        if self.epoch:
            # Its credits: its own tasks with in_order (see _next_worker), else the
            # others' meanwhile.
            self._dispatch(draw, self.prefetch_factor, rec.id if self.in_order else None)
            self._flush(only_if_needed=True)
        return self._actions()

    def retire_worker(self, worker_id: int | None = None) -> list[Any]:
        """Take a worker out (by default the newest): it gets no new task; the tasks
        queued for it go to the others; it is stopped once it holds none."""
        accepting = self.workers.accepting()
        if self.iterable:
            raise ValueError("an IterableDataset's worker count is fixed: each worker "
                             "iterates its own shard")
        if len(accepting) < 2:
            raise ValueError("cannot retire the last worker that takes tasks")
        rec = self.workers[worker_id] if worker_id is not None else max(
            accepting, key=lambda r: (r.added, not r.ready, r.id))
        if not rec.accepting:
            raise ValueError(f"worker {rec.id} is retiring, gone or suspended (silent past "
                             "the lost-batch limit)")
        rec.retiring = True
        self.counters["retired"] += 1
        queued = {seq for seq, _ in self._unsent.pop(rec.id, [])}
        for seq, _ in self.ledger.outstanding(rec.id):
            if rec.ready and seq not in queued:
                continue  # sent to it: it finishes that one
            # Never sent, or sent to a worker that cannot start it yet: to the others.
            v = self._least_held(exclude=rec.id)
            self._unsent.setdefault(v, []).append((seq, self.ledger.reassign(seq, v)))
        if not rec.pending:
            self._stop(rec.id)
        self._flush(only_if_needed=True)
        return self._actions()

    def _least_held(self, exclude: int) -> int:
        others = [r for r in self.workers.accepting() if r.id != exclude and r.active] or [
            r for r in self.workers.live()  # (all suspended: one of them, not none)
            if r.id != exclude and r.active and not r.retiring]
        ready = [r for r in others if r.ready] or others
        return min(ready, key=lambda r: r.held).id

    def _stop(self, w: int) -> None:
        """``w`` (retiring) is gone; whatever it still held goes to the others."""
        rec = self.workers[w]
        rec.gone, rec.info = True, None
        tasks = self.ledger.outstanding(w)
        if tasks and not self._hand_over(w, tasks):
            # No other worker is ready: to those starting (sent once they are).
            for seq, _ in tasks:
                v = self._least_held(exclude=w)
                self.losses.sent(seq)
                self._out.append(SendTasks(v, self.epoch, [(seq, self.ledger.reassign(seq, v))]))
        self._out.append(StopWorker(w))
