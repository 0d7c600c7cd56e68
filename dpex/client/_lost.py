"""Which batches were lost on the way, and which workers hang: the bookkeeping behind
``lost_batch_timeout``.

Pure (no I/O). A worker computes its tasks in the order it got them and sends the
results over one connection, so a result that overtakes an earlier task of the same
worker means that task was lost (a *gap*). A worker holding tasks that sends nothing
for the limit, counted from when it could start its oldest one (its previous result,
or the task's arrival if it was idle: idle time is no batch time), is *silent*. The
limit is ``lost_batch_timeout`` or, derived, ``factor`` x the 90th percentile of the
workers' usual time per batch, at least ``floor``; a worker's first batch, which
includes loading the dataset, is judged against ``first_limit`` (the loader's
``startup_timeout``) instead. A silent worker that then stays silent for another
limit, with nothing more to do, *hangs* (stuck in ``__getitem__``, not a lost frame).
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable, Iterable
from typing import Any

__all__ = ["LossWatch"]

FACTOR = 10.0


class LossWatch:
    def __init__(self, num_workers: int, timeout: float | None, floor: float,
                 clock: Callable[[], float] = time.monotonic,
                 first_limit: float | None = None) -> None:
        self.timeout, self.floor, self.clock = timeout, floor, clock
        self.first_limit = first_limit
        self._sends = itertools.count()
        self._order: dict[int, tuple[int, float]] = {}  # seq -> (send order, when sent)
        self._last = [clock()] * num_workers  # last sign of life (a result, a HELLO)
        self._past_first: set[int] = set()  # workers (incarnations) that sent a result
        self._flagged: dict[int, float] = {}  # silent worker -> when judged so
        self._batch_times: collections.deque[float] = collections.deque(maxlen=64)

    def new_epoch(self) -> None:
        self._order.clear()

    def add_worker(self) -> None:
        """One more worker id (the next one), silent from now."""
        self._last.append(self.clock())

    def sent(self, seq: int) -> None:
        """``seq`` was sent (again), now."""
        self._order[seq] = (next(self._sends), self.clock())

    def forget(self, seq: int) -> None:
        """``seq`` was taken: nothing can overtake it any more."""
        self._order.pop(seq, None)

    def alive(self, worker_id: int) -> None:
        """A (re-)HELLO: the worker's silence counts from now."""
        self._last[worker_id] = self.clock()

    def replaced(self, worker_id: int) -> None:
        self._past_first.discard(worker_id)
        self._flagged.pop(worker_id, None)

    def batch_time(self, worker_id: int, seq: int, now: float) -> float | None:
        """How long ``worker_id`` took for ``seq``, arriving ``now``: from when it could
        start it (its previous result or HELLO, or the task's (re)sending if later).
        The one definition: the scheduler reports it too (the autoscaler's input)."""
        sent = self._order.get(seq)
        return None if sent is None else now - max(self._last[worker_id], sent[1])

    def result(self, worker_id: int, seq: int, outstanding: list[tuple[int, Any]],
               now: float | None = None) -> list[tuple[int, Any]]:
        """A result of ``worker_id`` arrived (``now``): the tasks of ``outstanding`` (the
        worker's) that it overtook, which were lost."""
        now = self.clock() if now is None else now
        sent = self._order.get(seq)
        took = self.batch_time(worker_id, seq, now)
        if worker_id in self._past_first and took is not None:
            self._batch_times.append(took)
        self._past_first.add(worker_id)
        self._last[worker_id] = now
        self._flagged.pop(worker_id, None)
        if sent is None:
            return []
        return [task for task in outstanding if self._order.get(task[0], sent)[0] < sent[0]]

    def silent(self, busy: dict[int, Iterable[int]]) -> list[int]:
        """Workers of ``busy`` (ready worker -> the seqs it holds) that could have started
        their oldest task longer than the limit ago and sent nothing since. Each is
        flagged: judged by :meth:`hung` from then on, not here again until it sends."""
        now, out = self.clock(), []
        for w, seqs in busy.items():
            limit = self._limit_for(w)
            sent = [self._order[s][1] for s in seqs if s in self._order]
            if limit is None or not sent or w in self._flagged:
                continue
            if now - max(self._last[w], min(sent)) > limit:
                self._flagged[w] = now
                out.append(w)
        return out

    def hung(self) -> list[int]:
        """Flagged workers silent for another limit since: replace them. (Each is named
        once. The lost-batch limit, also after a first batch: startup_timeout, which
        covers loading the dataset, was granted already.)"""
        now, out = self.clock(), []
        limit = self.limit()
        for w, at in list(self._flagged.items()):
            if limit is not None and now - at > limit:
                del self._flagged[w]
                out.append(w)
        return out

    def heard(self, worker_id: int) -> None:
        """Any result of the worker's (a late copy of a task handed to another too): it
        is not hung."""
        self._last[worker_id] = self.clock()
        self._flagged.pop(worker_id, None)

    def _limit_for(self, worker_id: int) -> float | None:
        limit = self.limit()
        if limit is None or worker_id in self._past_first:
            return limit
        return self.first_limit  # None: a first batch is never judged

    def limit(self) -> float | None:
        if self.timeout is not None:
            return self.timeout or None  # 0: never presume a batch lost
        times = sorted(self._batch_times)
        usual = times[int(0.9 * len(times))] if times else 0.0
        return max(self.floor, FACTOR * usual)
