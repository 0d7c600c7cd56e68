"""Which batches were lost on the way: the bookkeeping behind ``lost_batch_timeout``.

Pure (no I/O). A worker computes its tasks in the order it got them and sends the
results over one connection, so a result that overtakes an earlier task of the same
worker means that task was lost (a *gap*); a worker holding tasks that sends nothing
for the limit lost them (*silence*). The limit is ``lost_batch_timeout`` or, derived,
``factor`` x the 90th percentile of the worker's usual time per batch, at least
``floor`` (a worker's first batch, which includes loading, does not count).
"""

from __future__ import annotations

import collections
import itertools
import time
from collections.abc import Callable
from typing import Any

__all__ = ["LossWatch"]

FACTOR = 10.0


class LossWatch:
    def __init__(self, num_workers: int, timeout: float | None, floor: float,
                 clock: Callable[[], float] = time.monotonic) -> None:
        self.timeout, self.floor, self.clock = timeout, floor, clock
        self._sends = itertools.count()
        self._order: dict[int, int] = {}  # seq -> when it was (last) sent, in order
        self._progress = [clock()] * num_workers  # last sign of life, per worker
        self._past_first: set[int] = set()  # workers (incarnations) that sent a result
        self._batch_times: collections.deque[float] = collections.deque(maxlen=64)

    def new_epoch(self) -> None:
        self._order.clear()

    def add_worker(self) -> None:
        """One more worker id (the next one), silent from now."""
        self._progress.append(self.clock())

    def sent(self, seq: int, worker_id: int | None = None) -> None:
        """``seq`` was sent (again); to an idle ``worker_id``, whose clock starts now."""
        self._order[seq] = next(self._sends)
        if worker_id is not None:
            self._progress[worker_id] = self.clock()

    def forget(self, seq: int) -> None:
        """``seq`` was taken: nothing can overtake it any more."""
        self._order.pop(seq, None)

    def alive(self, worker_id: int) -> None:
        """A (re-)HELLO: the worker's silence counts from now."""
        self._progress[worker_id] = self.clock()

    def replaced(self, worker_id: int) -> None:
        self._past_first.discard(worker_id)

    def result(self, worker_id: int, seq: int,
               outstanding: list[tuple[int, Any]]) -> list[tuple[int, Any]]:
        """A result of ``worker_id`` arrived: the tasks of ``outstanding`` (the worker's)
        that it overtook, which were lost."""
        now = self.clock()
        if worker_id in self._past_first:
            self._batch_times.append(now - self._progress[worker_id])
        self._past_first.add(worker_id)
        self._progress[worker_id] = now
        order = self._order.get(seq)
        if order is None:
            return []
        return [task for task in outstanding if self._order.get(task[0], order) < order]

    def silent(self, ready: Any) -> list[int]:
        """Workers of ``ready``, past their first batch, silent beyond the limit (each
        is judged again only after another limit)."""
        limit = self.limit()
        if limit is None:
            return []
        now = self.clock()
        out = [w for w in self._past_first & set(ready) if now - self._progress[w] > limit]
        for w in out:
            self._progress[w] = now
        return out

    def limit(self) -> float | None:
        if self.timeout is not None:
            return self.timeout or None  # 0: never presume a batch lost
        times = sorted(self._batch_times)
        usual = times[int(0.9 * len(times))] if times else 0.0
        return max(self.floor, FACTOR * usual)
