"""Backups for stragglers: a map-style batch computed again elsewhere (pure).

A batch far slower than its peers (a read from a dead mount, a lock never released, a
node in trouble) used to hold the whole epoch until ``hung_batch_timeout``. As batch
engines do (MapReduce's backup tasks, Flink's speculative execution), the scheduler
gives it a second attempt on another worker with room once its worker has computed
it past the straggler limit (``straggler_timeout``); the first result counts, the
other is dropped as a duplicate. The slow worker is not killed for it: it keeps its
process, takes no new task until it is done with that batch (``WorkerRecord.
straggling``), and is replaced only past ``hung_batch_timeout``, as before. The tasks
queued behind the slow batch on that worker go to the others with it (they would wait
as long). The same holds the other way: when the slow worker's copy comes first, the
tasks queued behind the backup's now useless copy go to the others, and the backup's
worker takes none until it is done with that copy; a wasted backup then costs one
worker's time on one batch, not the batches queued behind it.

This book counts them for ``stats()["backups"]``: ``launched`` (batches given a
backup), ``won`` (the backup's copy came first), ``wasted`` (the slow worker's came
first: the backup's work was for nothing).
"""

from __future__ import annotations

__all__ = ["Backups"]


class Backups:
    def __init__(self) -> None:
        self.launched = self.won = self.wasted = 0
        self._slow: dict[int, int] = {}  # seq -> the straggling worker (this epoch)

    def new_epoch(self) -> None:
        self._slow.clear()

    def launched_for(self, seq: int, worker_id: int) -> None:
        """``seq``, which ``worker_id`` still computes, was sent to another worker."""
        self._slow[seq] = worker_id
        self.launched += 1

    def arrived(self, seq: int, worker_id: int, fresh: bool) -> bool:
        """A result of ``seq`` from ``worker_id`` (``fresh``: the first copy to arrive).
        True when it makes the backup wasted: the backup's worker computes a copy nobody
        needs any more."""
        slow = self._slow.get(seq)
        if slow is None:
            return False
        if not fresh:
            del self._slow[seq]  # (the second copy: nothing more to count)
            return False
        if worker_id == slow:
            self.wasted += 1
            return True
        self.won += 1
        return False

    def stats(self) -> dict[str, int]:
        return {"launched": self.launched, "won": self.won, "wasted": self.wasted}
