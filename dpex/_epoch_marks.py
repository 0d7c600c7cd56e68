"""RESUME and SKIP, made good when lost: pure bookkeeping on both ends (no I/O).

Control messages travel over a connection that can break and reconnect (heartbeats,
a NAT); what was queued in it is lost, and a worker accepts the numbering gap. A lost
task is found by the lost-batch rules, but a lost RESUME would leave a worker on the
previous epoch's shard and a lost SKIP would misalign a replacement's shard, silently.
So the trainer attaches the epoch's marks (the RESUME and SKIP it sent the worker
this epoch) to every TASKS message (:class:`SentMarks`), and the worker applies each
mark once, whichever message brings it first (:class:`AppliedMarks`): a repeat is
ignored, a lost one is made good before the task that needs it.
"""

from __future__ import annotations

from typing import Any

__all__ = ["SentMarks", "AppliedMarks"]


class SentMarks:
    """The trainer's side: per worker id, the RESUME and SKIP sent to its current
    incarnation this epoch (a RESUME starts the epoch's marks anew)."""

    def __init__(self) -> None:
        self._marks: dict[int, dict[str, tuple[int, Any]]] = {}

    def resume(self, worker_id: int, epoch: int, payload: Any) -> None:
        self._marks[worker_id] = {"resume": (epoch, payload)}

    def skip(self, worker_id: int, epoch: int, n: int) -> None:
        self._marks.setdefault(worker_id, {})["skip"] = (epoch, n)

    def replaced(self, worker_id: int) -> None:
        """A new incarnation: nothing was sent to it yet."""
        self._marks.pop(worker_id, None)

    def of(self, worker_id: int) -> dict[str, tuple[int, Any]] | None:
        return self._marks.get(worker_id)


class AppliedMarks:
    """The worker's side, for one session: the epoch it runs (1 at its start, each
    RESUME after) and the SKIPs it applied. Each method answers whether to apply."""

    def __init__(self) -> None:
        self.epoch = 1
        self._skips: set[tuple[int, int]] = set()
        self.repaired = 0  # marks that came only with a TASKS message (one was lost)

    def resume(self, epoch: int) -> bool:
        if epoch <= self.epoch:
            return False  # a repeat (or older): applied already
        self.epoch = epoch
        # A SKIP of this epoch that came before it (its RESUME lost) passed over the
        # shard this RESUME replaces: it is applied again after it.
        self._skips = {mark for mark in self._skips if mark[0] != epoch}
        return True

    def skip(self, epoch: int, n: int) -> bool:
        if epoch < self.epoch or (epoch, n) in self._skips:
            return False
        self._skips.add((epoch, n))
        return True

    def repair(self, marks: dict[str, tuple[int, Any]] | None) -> list[tuple[str, Any, int]]:
        """The marks a TASKS message carries that were not applied: ``("resume",
        payload, epoch)`` then ``("skip", n, epoch)``, to apply before its tasks."""
        out: list[tuple[str, Any, int]] = []
        if not marks:
            return out
        if "resume" in marks:
            epoch, payload = marks["resume"]
            if self.resume(epoch):
                out.append(("resume", payload, epoch))
        if "skip" in marks:
            epoch, n = marks["skip"]
            if self.skip(epoch, n):
                out.append(("skip", n, epoch))
        self.repaired += len(out)
        return out
