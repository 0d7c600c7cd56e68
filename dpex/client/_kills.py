"""dpex's own kills of its workers and their budget (pure: no I/O).

dpex kills a worker it presumes hung (silent, or computing one batch past
``hung_batch_timeout``) or, for an IterableDataset, one whose shard lost a batch (only
a replacement can redo it). Those kills are not the worker's deaths: they do not spend
``max_worker_restarts``, but a budget of their own, per worker id per iterator and per
batch that computed too long (a batch that hangs wherever it runs). Past it, the epoch
ends with the reason (``WorkerHungError``).
"""

from __future__ import annotations

import collections
from dataclasses import dataclass, field

__all__ = ["KillWorker", "KillBudget", "MAX_KILLS_PER_WORKER", "MAX_HANGS_PER_BATCH"]

MAX_KILLS_PER_WORKER = 3
MAX_HANGS_PER_BATCH = 2


@dataclass(frozen=True)
class KillWorker:
    """End a worker presumed broken; its exit comes back as ``exited``. ``why``:
    "silent" (hung: no sign of life), "computing" (hung: on batch ``seq`` past
    ``hung_timeout``) or "lost" (an IterableDataset's batch ``seq`` lost: only a
    replacement can redo its shard); ``seconds``: the silence, or the batch's time."""
    worker_id: int
    why: str = field(default="silent", compare=False)  # (what the warning says)
    seq: int | None = field(default=None, compare=False)
    seconds: float = field(default=0.0, compare=False)

    def reason(self) -> str:
        """Why dpex kills it, as the warning and the final error say."""
        return {"computing": f"killed as hung after {self.seconds:.0f} s computing batch "
                             f"{self.seq} (hung_batch_timeout)",
                "silent": f"killed as hung after {self.seconds:.0f} s without a sign of "
                          "life (no result, no progress report)",
                "lost": f"killed for a lost batch ({self.seq}) of its IterableDataset "
                        "shard, so that a replacement redoes the shard from there"}[self.why]


class KillBudget:
    """What one iterator's kills have spent. Invariant: a worker id is killed at most
    ``MAX_KILLS_PER_WORKER`` times, a batch at most ``MAX_HANGS_PER_BATCH`` - 1 times
    for computing too long; the kill past either is refused, with the reason."""

    def __init__(self) -> None:
        self._hangs: collections.Counter[int] = collections.Counter()  # seq -> overdue

    def new_epoch(self) -> None:
        self._hangs.clear()  # (batch numbers start again)

    def spend(self, kill: KillWorker, kills_before: int) -> str | None:
        """Charge ``kill`` (its worker was killed ``kills_before`` times): None if the
        budget allows it, else why the epoch ends."""
        if kill.why == "computing" and kill.seq is not None and kill.seq >= 0:
            self._hangs[kill.seq] += 1
            if self._hangs[kill.seq] >= MAX_HANGS_PER_BATCH:
                return (f"{kill.reason()}; batch {kill.seq} hung {self._hangs[kill.seq]} "
                        "times, on each worker it ran on")
        if kills_before >= MAX_KILLS_PER_WORKER:
            return (f"{kill.reason()}; dpex killed worker {kill.worker_id} {kills_before} "
                    f"times before, the most it does ({MAX_KILLS_PER_WORKER})")
        return None
