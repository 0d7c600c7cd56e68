"""Which batches were lost on the way, and which workers hang: the bookkeeping behind
``lost_batch_timeout`` and ``hung_batch_timeout``.

Pure (no I/O). A worker computes its tasks in the order it got them and sends the
results over one connection, so a result that overtakes an earlier task of the same
worker means that task was lost (a *gap*). Every second each worker also says what
its compute thread works on and for how long (PROGRESS, sent by its control thread),
which tells three cases apart:

- **computing**: its PROGRESS names a task it holds. It is neither lost nor hung, however
  long the batch takes (cold reads, retries with back-off, a slow video), up to
  ``hung_limit`` seconds on one batch (``hung_batch_timeout``; a first batch's time
  includes loading the dataset and ``worker_init_fn``): past that it is *overdue*,
  killed and replaced as hung, as a ``__getitem__`` that sleeps forever would be.
- **past a task** whose result never came: its PROGRESS names a later task, or says it
  is idle (a task sent more than ``IDLE_GRACE_S`` before). That result (or the task)
  was lost although the worker is healthy (a frame dropped with a connection): once
  it has stayed missing for the limit, it is *lost* and computed again.
- **silent**: a worker holding tasks from which nothing came, no result and no
  PROGRESS, for the limit, counted from when it could start its oldest task (its
  previous result, or the task's arrival if it was idle: idle time is no batch time).
  Its process is stopped (SIGSTOP), wedged holding the GIL, or cut off: its tasks
  are presumed lost; silent for another limit since, it *hangs*: killed and replaced.

The limit is ``lost_batch_timeout`` or, derived, ``factor`` x the 90th percentile of
the workers' usual time per batch, at least ``floor``; a worker's first batch is judged
against ``first_limit`` (the loader's ``startup_timeout``) for silence instead: a
dataset's unpickling can hold the GIL for long. A worker that sends no PROGRESS (an
in-memory fake) is judged by its results alone, as before PROGRESS existed.

When each worker was last heard from lives on its record
(:class:`~dpex.client._worker_table.WorkerRecord`: ``last_result_at``, ``heard_at``),
which only this watch writes.
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

from dpex.client._worker_table import WorkerTable

__all__ = ["LossWatch"]

FACTOR = 10.0
# straggler_timeout="auto": a batch computed this many times the usual, at least the
# floor, gets a backup on another worker (dpex.client._backups).
STRAGGLER_FACTOR, STRAGGLER_FLOOR_S = 4.0, 5.0
# A worker idle in its PROGRESS is past the tasks sent to it this much earlier (the
# rest may still be on their way to it).
IDLE_GRACE_S = 2.0
IDLE, LOADING = -1, -2  # (as in dpex._protocol: a PROGRESS's seq)


class LossWatch:
    def __init__(self, workers: WorkerTable, timeout: float | None, floor: float,
                 clock: Callable[[], float] = time.monotonic,
                 first_limit: float | None = None, hung_limit: float | None = None) -> None:
        self.timeout, self.floor, self.clock = timeout, floor, clock
        self.first_limit, self.hung_limit = first_limit, hung_limit
        self._workers = workers
        self._sends = itertools.count()
        self._order: dict[int, tuple[int, float]] = {}  # seq -> (send order, when sent)
        self._past_first: set[int] = set()  # workers (incarnations) that sent a result
        self._flagged: dict[int, float] = {}  # silent worker -> when judged so
        self._batch_times: collections.deque[float] = collections.deque(maxlen=64)
        # Each worker's last PROGRESS: (seq, seconds on it, when it came).
        self._working: dict[int, tuple[int | None, float, float]] = {}
        self._passed: dict[int, float] = {}  # seq -> when its worker was seen past it

    def new_epoch(self) -> None:
        self._order.clear()
        self._passed.clear()

    def sent(self, seq: int) -> None:
        """``seq`` was sent (again), now."""
        self._order[seq] = (next(self._sends), self.clock())
        self._passed.pop(seq, None)

    def sent_after(self, seq: int, than: int) -> bool:
        """``seq`` was last sent after ``than`` was (both still untaken)."""
        return self._order.get(seq, (-1, 0.0))[0] > self._order.get(than, (-1, 0.0))[0]

    def forget(self, seq: int) -> None:
        """``seq`` was taken: nothing can overtake it any more."""
        self._order.pop(seq, None)
        self._passed.pop(seq, None)

    def alive(self, worker_id: int) -> None:
        """A (re-)HELLO: the worker's silence counts from now."""
        rec = self._workers[worker_id]
        rec.last_result_at = rec.heard_at = self.clock()

    def replaced(self, worker_id: int) -> None:
        self._past_first.discard(worker_id)
        self._flagged.pop(worker_id, None)
        self._working.pop(worker_id, None)

    def batch_time(self, worker_id: int, seq: int, now: float) -> float | None:
        """How long ``worker_id`` took for ``seq``, arriving ``now``: from when it could
        start it (its previous result or HELLO, or the task's (re)sending if later).
        The one definition: the scheduler reports it too (the autoscaler's input)."""
        sent = self._order.get(seq)
        return None if sent is None else now - max(self._workers[worker_id].last_result_at,
                                                    sent[1])

    def result(self, worker_id: int, seq: int, outstanding: list[tuple[int, Any]],
               now: float | None = None, took: float | None = None) -> list[tuple[int, Any]]:
        """A result of ``worker_id`` arrived (``now``; ``took``: the worker's own time on
        it, where it said): the tasks of ``outstanding`` (the worker's) that it
        overtook, which were lost."""
        now = self.clock() if now is None else now
        sent = self._order.get(seq)
        if took is None:
            took = self.batch_time(worker_id, seq, now)
        if worker_id in self._past_first and took is not None:
            self._batch_times.append(took)
        self._past_first.add(worker_id)
        rec = self._workers[worker_id]
        rec.last_result_at = rec.heard_at = now
        self._flagged.pop(worker_id, None)
        if sent is None:
            return []
        return [task for task in outstanding if self._order.get(task[0], sent)[0] < sent[0]]

    def progress(self, worker_id: int, seq: int | None, working_s: float, holds: list[int],
                 now: float | None = None) -> None:
        """A PROGRESS of ``worker_id`` (``now``): it works on ``seq`` (``IDLE``, ``LOADING``,
        or None: a task of another epoch) for ``working_s``, and holds ``holds``. Its tasks
        it is past are marked (lost once they stay missing for the limit)."""
        now = self.clock() if now is None else now
        self._workers[worker_id].heard_at = now
        self._flagged.pop(worker_id, None)
        self._working[worker_id] = (seq, working_s, now)
        if seq == IDLE:
            past = [s for s in holds if s in self._order
                    and self._order[s][1] < now - IDLE_GRACE_S]
        elif seq is not None and seq >= 0 and seq in holds and seq in self._order:
            mine = self._order[seq][0]
            past = [s for s in holds if s in self._order and self._order[s][0] < mine]
            for s in holds:  # it works on this one; those after it wait behind it
                if s in self._order and self._order[s][0] >= mine:
                    self._passed.pop(s, None)
        else:
            past = []  # loading, or not comparable: it is past nothing we know of
        for s in past:
            self._passed.setdefault(s, now)

    def silent(self, busy: dict[int, Iterable[int]]) -> list[int]:
        """Workers of ``busy`` (ready worker -> the seqs it holds) from which nothing came
        (no result, no PROGRESS) for longer than the limit since they could start their
        oldest task. Each is flagged: judged by :meth:`hung` from then on, not here
        again until it is heard from."""
        now, out = self.clock(), []
        for w, seqs in busy.items():
            limit = self._limit_for(w)
            sent = [self._order[s][1] for s in seqs if s in self._order]
            if limit is None or not sent or w in self._flagged:
                continue
            if now - max(self._workers[w].heard_at, min(sent)) > limit:
                self._flagged[w] = now
                out.append(w)
        return out

    def passed(self, busy: dict[int, Iterable[int]]) -> dict[int, list[int]]:
        """The seqs each worker of ``busy`` was seen past (its PROGRESS) longer than the
        limit ago whose results never came: lost although the worker is healthy."""
        limit, now = self.limit(), self.clock()
        if limit is None:
            return {}
        out = {w: [s for s in seqs if now - self._passed.get(s, now) > limit]
               for w, seqs in busy.items()}
        return {w: seqs for w, seqs in out.items() if seqs}

    def overdue(self, busy: Iterable[int]) -> list[tuple[int, int, float]]:
        """Workers of ``busy`` (holding tasks) whose PROGRESS shows one batch (or the
        loading before its first) worked on longer than ``hung_limit``: (worker, its
        seq, seconds), at every check until it is replaced (the scheduler kills once)."""
        if not self.hung_limit:
            return []
        now, out = self.clock(), []
        for w in busy:
            seq, working_s, at = self._working.get(w, (IDLE, 0.0, now))
            if seq == IDLE or w in self._flagged:
                continue
            working = working_s + (now - at)
            if working > self.hung_limit:
                out.append((w, -1 if seq is None else seq, working))
        return out

    def stragglers(self, busy: dict[int, Iterable[int]], setting: float | str | None
                   ) -> list[tuple[int, int]]:
        """Workers of ``busy`` whose PROGRESS shows one of the batches they hold computed
        longer than the straggler limit (``setting``: seconds, ``"auto"`` or None, see
        ``straggler_timeout``; a first batch, which loads the dataset, is not judged):
        (worker, seq)."""
        if setting is None:
            return []
        limit = float(setting) if setting != "auto" else max(
            STRAGGLER_FLOOR_S, STRAGGLER_FACTOR * self._usual())
        now, out = self.clock(), []
        for w, seqs in busy.items():
            seq, working_s, at = self._working.get(w, (IDLE, 0.0, now))
            if (seq is not None and seq >= 0 and seq in seqs and w in self._past_first
                    and w not in self._flagged and working_s + (now - at) > limit):
                out.append((w, seq))
        return out

    def hung(self) -> list[tuple[int, float]]:
        """Flagged workers silent for another limit since: replace them (with how long
        they have been silent). Each is named once. The lost-batch limit, also after a
        first batch: startup_timeout, which covers loading the dataset, was granted
        already."""
        now, out = self.clock(), []
        limit = self.limit()
        for w, at in list(self._flagged.items()):
            if limit is not None and now - at > limit:
                del self._flagged[w]
                out.append((w, now - self._workers[w].heard_at))
        return out

    def heard(self, worker_id: int) -> None:
        """Any result of the worker's (a late copy of a task handed to another too): it
        is not hung."""
        self._workers[worker_id].heard_at = self.clock()
        self._flagged.pop(worker_id, None)

    def _limit_for(self, worker_id: int) -> float | None:
        limit = self.limit()
        if limit is None or worker_id in self._past_first:
            return limit
        return self.first_limit  # None: a first batch is never judged

    def limit(self) -> float | None:
        if self.timeout is not None:
            return self.timeout or None  # 0: never presume a batch lost
        return max(self.floor, FACTOR * self._usual())

    def _usual(self) -> float:
        """The workers' usual time per batch: the 90th percentile of the recent ones."""
        times = sorted(self._batch_times)
        return times[int(0.9 * len(times))] if times else 0.0
