"""What the training loop took from each worker, for ``state_dict()`` (pure: no I/O).

A resumed map-style worker starts from its RNG states right after its last batch
that was taken; an IterableDataset's worker also needs how many of its batches of
the epoch were taken and whether its shard ended (see docs/RESUME.md).
"""

from __future__ import annotations

from typing import Any

from dpex._protocol import Kind, Message

__all__ = ["TakenRecord"]


class TakenRecord:
    def __init__(self, num_workers: int, iterable: bool, stateful_dataset: bool,
                 shards: dict | None = None) -> None:
        """``shards``: a resumed IterableDataset epoch's positions (``state["iterable"]``),
        which the iterator's first epoch starts from."""
        self.num_workers, self.iterable, self.stateful = num_workers, iterable, stateful_dataset
        self.last: dict[int, tuple[int, int]] = {}  # worker -> its last batch taken
        self.count: dict[int, int] = {}  # this epoch's batches taken, per worker
        self.ended: set[int] = set()  # workers whose END was taken this epoch
        self._shards = shards

    def new_epoch(self) -> None:
        shards, self._shards = self._shards, None
        workers = shards["workers"] if shards else {}
        self.count = {int(w): s["taken"] for w, s in workers.items()}
        self.ended = {int(w) for w, s in workers.items() if s["ended"]}

    def took(self, msg: Message) -> None:
        if msg.kind is Kind.END:
            self.ended.add(msg.worker_id)
            return
        self.last[msg.worker_id] = (msg.epoch, msg.seq)
        self.count[msg.worker_id] = self.count.get(msg.worker_id, 0) + 1

    def resume_points(self, epoch: int, mid_epoch: bool) -> dict[int, tuple[int, int]]:
        """Which RNG states (and stateful IterableDataset states) ``state_dict()`` asks
        each worker for: right after its last batch taken, (epoch, seq). In the middle
        of an IterableDataset's epoch a worker resumes by passing over what it
        delivered, from its state when the epoch began (seq -1), unless its dataset
        keeps its own position."""
        if not mid_epoch or not self.iterable:
            return dict(self.last)
        start = {w: (epoch, -1) for w in range(self.num_workers)}
        if not self.stateful:
            return start
        return {**start, **{w: at for w, at in self.last.items() if at[0] == epoch}}

    def shard_positions(self, next_worker: Any) -> dict:
        """An IterableDataset's position mid-epoch: per worker the batches taken and
        whether its shard ended, the worker whose turn is next, and whether the dataset
        keeps its own position."""
        return {"workers": {w: {"taken": self.count.get(w, 0), "ended": w in self.ended}
                            for w in range(self.num_workers)},
                "next_worker": next_worker if next_worker is not None else 0,
                "stateful": self.stateful}
