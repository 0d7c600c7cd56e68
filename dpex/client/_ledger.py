"""Which worker holds which task of the current epoch: the record recovery replays.

Pure bookkeeping, no I/O. A task is *dispatched* to a worker, then *received*
(its result reached the trainer) and finally *consumed* (taken by the training
loop, which returns its credit). Invariant, per worker ``w``::

    outstanding(w) == [tasks of w dispatched and not yet received], in seq order
    held(w) == number of tasks of w dispatched and not yet consumed
    pending(w) == len(outstanding(w))

When a worker dies, ``outstanding(w)`` is exactly what must be sent again, and
``delivered(w)`` is how many of its results this epoch already reached the
trainer. The per-worker counts live on the workers' records
(:class:`~dpex.client._worker_table.WorkerRecord`: ``held``, ``pending``,
``delivered``), which only this ledger writes; the per-task ones here.
"""

from __future__ import annotations

from typing import Any

from dpex.client._worker_table import WorkerTable

__all__ = ["TaskLedger"]


class TaskLedger:
    def __init__(self, workers: WorkerTable) -> None:
        self._workers = workers
        self.reset()

    def reset(self) -> None:
        """A new epoch: nothing dispatched yet."""
        self._worker: dict[int, int] = {}
        self._indices: dict[int, Any] = {}  # dispatched, not yet received
        for rec in self._workers.records:
            rec.held = rec.pending = rec.delivered = 0

    def dispatch(self, seq: int, worker_id: int, indices: Any) -> None:
        if seq in self._worker:
            raise ValueError(f"task {seq} was already dispatched")
        self._worker[seq] = worker_id
        self._indices[seq] = indices
        rec = self._workers[worker_id]
        rec.held += 1
        rec.pending += 1

    def reassign(self, seq: int, worker_id: int) -> Any:
        """Give the outstanding task ``seq`` to ``worker_id`` (its worker died or its
        result is overdue); its indices. A result from the former owner no longer counts."""
        if seq not in self._indices:
            raise ValueError(f"task {seq} is not outstanding")
        old, new = self._workers[self._worker[seq]], self._workers[worker_id]
        old.held -= 1
        old.pending -= 1
        self._worker[seq] = worker_id
        new.held += 1
        new.pending += 1
        return self._indices[seq]

    def worker_of(self, seq: int) -> int | None:
        """The worker a live (not consumed) task belongs to; None if there is no such task."""
        return self._worker.get(seq)

    def received(self, seq: int) -> bool:
        """Record that the result of ``seq`` arrived; False if it was not outstanding
        (a duplicate from a worker presumed dead, or a task of another epoch)."""
        if self._indices.pop(seq, _MISSING) is _MISSING:
            return False
        rec = self._workers[self._worker[seq]]
        rec.delivered += 1
        rec.pending -= 1
        return True

    def consumed(self, seq: int) -> None:
        """The training loop took (or skipped) ``seq``: its slot is free."""
        w = self._worker.pop(seq, None)
        if w is not None:
            rec = self._workers[w]
            rec.held -= 1
            if self._indices.pop(seq, _MISSING) is not _MISSING:
                rec.pending -= 1

    def live(self) -> int:
        """Tasks dispatched and not yet consumed, over all workers."""
        return len(self._worker)

    def held(self, worker_id: int) -> int:
        return self._workers[worker_id].held

    def pending(self, worker_id: int) -> int:
        """How many tasks of ``worker_id`` have no result yet (``len(outstanding(w))``)."""
        return self._workers[worker_id].pending

    def delivered(self, worker_id: int) -> int:
        return self._workers[worker_id].delivered

    def outstanding(self, worker_id: int) -> list[tuple[int, Any]]:
        """``(seq, indices)`` of the tasks of ``worker_id`` whose results have not arrived."""
        return sorted(((seq, idx) for seq, idx in self._indices.items()
                       if self._worker[seq] == worker_id), key=lambda task: task[0])


_MISSING = object()
