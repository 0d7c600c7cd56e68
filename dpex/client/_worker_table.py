"""One record per worker id, and what a worker's exit calls for and says (pure).

The record is the one place a worker's state lives, created in one place
(:class:`WorkerTable`: the iterator's workers, then each one added) and read and
written by whoever keeps a rule about it: the scheduler (incarnation, readiness,
retirement; it filters results by the incarnation), the task ledger (its tasks'
counts), the loss watch (when it was last heard from) and the driver (the spec its
current incarnation was started with; replacements start from it).
"""

from __future__ import annotations

import enum
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from dpex.errors import DpexError, WorkerDiedError, WorkerStartupError

if TYPE_CHECKING:
    from dpex._spec import WorkerSpec

__all__ = ["WorkerRecord", "WorkerTable", "ShardTasks", "Recovery", "recovery", "exit_error"]


class ShardTasks:
    """An IterableDataset worker's tasks this epoch, as much as its replacement needs:
    how many it was given, and those not yet taken by the training loop (at most the
    window) or taken ahead of one that is not. Each task's entry ends when it is taken
    (one taken ahead: once every earlier one is), so an endless epoch keeps a bounded
    record."""

    def __init__(self) -> None:
        self.count = 0  # tasks given this epoch
        self._live: dict[int, Any] = {}  # seq -> indices, not yet taken
        self._ahead: dict[int, Any] = {}  # taken while an earlier one of these was not

    def __len__(self) -> int:
        return len(self._live) + len(self._ahead)

    def dispatched(self, seq: int, indices: Any) -> None:
        self.count += 1
        self._live[seq] = indices

    def taken(self, seq: int) -> None:
        indices = self._live.pop(seq, None)
        floor = min(self._live, default=None)
        if floor is not None and floor < seq:  # (in_order=False: taken out of order)
            self._ahead[seq] = indices
        if self._ahead:
            self._ahead = {s: i for s, i in self._ahead.items() if floor is not None and s > floor}

    def from_seq(self, first: int | None) -> tuple[int, list[tuple[int, Any]]]:
        """Where task ``first`` stands in the shard (how many of the worker's tasks came
        before it) and the tasks from it on, in order (None: after the last task)."""
        if first is None:
            return self.count, []
        later = sorted(t for t in (*self._live.items(), *self._ahead.items()) if t[0] >= first)
        return self.count - len(later), later


@dataclass
class WorkerRecord:
    """One worker id: the one place its state lives (see the module's docstring)."""

    id: int
    # 0 for the first actor, +1 per replacement: deaths (``restarts``), moves and kills
    incarnation: int = 0
    info: dict | None = None  # the current incarnation's HELLO; None until ready, and once gone
    known: dict | None = None  # the last HELLO of any incarnation (pid, node)
    active: bool = True  # this epoch: still has data (an IterableDataset's shard)
    shard: ShardTasks = field(default_factory=ShardTasks)  # an IterableDataset's, this epoch
    # the slot of its END this epoch (IterableDataset; -1: ended before a resumed epoch)
    ended_seq: int | None = None
    skipped: int = 0  # a resumed epoch: its batches delivered before the resume
    batches: int = 0  # its results that counted, this iterator
    first_ready_at: float | None = None
    added: bool = False  # started during the iteration (elastic), not with it
    started_at: float | None = None  # an added worker: when its current incarnation started
    retiring: bool = False  # takes no new task; stopped once it holds none
    gone: bool = False  # retired (or its start given up): no longer one of the workers
    # replacements after its fleet worker ended the session or its host died (not deaths)
    moves: int = 0
    suspended: bool = False  # silent past the lost-batch limit: no new task until it
    # is heard from; silent for another limit, it is replaced (it hangs)
    # (epoch, seq) of the batch it computes past the straggler limit, which another
    # worker computes too (a backup): no new task until it is done with it
    straggling: tuple[int, int] | None = None
    kills: int = 0  # incarnations dpex killed (hung, or a shard's batch lost)
    killed: bool = False  # the current incarnation is being killed by dpex
    # Its tasks this epoch, as the task ledger counts them (dpex.client._ledger):
    held: int = 0  # dispatched, not yet consumed (its credits in use)
    pending: int = 0  # dispatched, no result yet
    delivered: int = 0  # results that reached the trainer
    # The loss watch's readings (dpex.client._lost; 0.0: not yet, so a batch's time or
    # a silence counts from when its task was sent):
    last_result_at: float = 0.0  # its last result or HELLO (a batch's time counts from it)
    heard_at: float = 0.0  # any sign of life (a PROGRESS too)
    spec: WorkerSpec | None = None  # what the driver started its current incarnation with

    @property
    def ready(self) -> bool:
        return self.info is not None

    @property
    def restarts(self) -> int:
        """Its replacements after deaths of its own: what ``max_worker_restarts``
        counts (not moves, nor dpex's kills)."""
        return self.incarnation - self.moves - self.kills

    def describe(self) -> str:
        """How errors and warnings name it: ``dpex worker 3 (pid 123, node 10.0.0.1)``."""
        known = self.known or {}
        pid = known.get("session_pid", known.get("pid", "?"))
        return f"dpex worker {self.id} (pid {pid}, node {known.get('node_ip', 'unknown node')})"

    @property
    def starting(self) -> bool:
        """A replacement, or a worker added during the iteration, not ready yet (the
        first start of the iterator's own workers is not counted)."""
        return (self.incarnation > 0 or self.added) and self.info is None

    @property
    def accepting(self) -> bool:
        """One of the workers that new tasks may go to (not retiring, gone, suspended
        nor straggling)."""
        return not (self.retiring or self.gone or self.suspended or self.straggling)


class WorkerTable:
    """Every worker id of one iterator, ``0 .. len - 1``: the iterator's own workers,
    then one per worker added while it runs (:meth:`add`: the only place a record is
    made; ids are never reused, a gone worker's record stays)."""

    def __init__(self, num_workers: int) -> None:
        self.records = [WorkerRecord(w) for w in range(num_workers)]

    def __getitem__(self, worker_id: int) -> WorkerRecord:
        return self.records[worker_id]

    def __len__(self) -> int:
        return len(self.records)

    def add(self) -> WorkerRecord:
        """A new worker id (the next one: ids are never reused)."""
        rec = WorkerRecord(len(self.records), added=True)
        self.records.append(rec)
        return rec

    def live(self) -> list[WorkerRecord]:
        """The workers not gone (retiring ones included)."""
        return [r for r in self.records if not r.gone]

    def accepting(self) -> list[WorkerRecord]:
        return [r for r in self.records if r.accepting]

    def new_epoch(self) -> None:
        for rec in self.records:
            rec.active, rec.shard, rec.ended_seq = not rec.gone, ShardTasks(), None
            rec.skipped = 0

    def all_ready(self) -> bool:
        """The iterator's own workers, those not gone, are ready (one added while it
        runs is waited for by nobody)."""
        return all(r.info is not None for r in self.records if not (r.gone or r.added))

    def ready_infos(self) -> dict[int, dict]:
        return {r.id: r.info for r in self.records if r.info is not None and not r.gone}

    def stats(self, now: float, warm: Any = ()) -> dict[int, dict]:
        """``loader.stats()["workers"]``: each worker that said HELLO (``warm``: the ids
        whose session runs on a warm worker)."""
        out = {}
        for rec in self.records:
            if rec.known is None:
                continue
            info = {k: rec.known[k] for k in ("pid", "session_pid", "node_ip", "node_id",
                                              "transport") if k in rec.known}
            up = now - rec.first_ready_at if rec.first_ready_at is not None else 0.0
            out[rec.id] = {**info, "warm": rec.id in warm, "batches": rec.batches,
                           "batches_per_s": rec.batches / up if up > 0 else 0.0,
                           "retired": rec.gone}
        return out

    def known_infos(self) -> dict[int, dict]:
        return {r.id: r.known for r in self.records if r.known is not None}


class Recovery(enum.Enum):
    RESTART = "restart"  # a replacement with the same id; its tasks go on
    STARTUP_FAILED = "startup failed"  # fatal: it never worked
    DIED = "died"  # fatal: out of restarts


def recovery(record: WorkerRecord, *, startup_error: bool, unplaced: bool,
             max_restarts: int) -> Recovery:
    """What a worker's exit calls for. A worker whose start failed (``startup_error``:
    it raised ``WorkerStartupError``, e.g. it never reached the trainer; or it never
    said HELLO, unless Ray could not place it because its node went away: placed
    again, like a death) is fatal; one that died is replaced while restarts are left
    (:attr:`WorkerRecord.restarts`); one that dpex killed (hung, or its shard lost a
    batch) is replaced, even before its HELLO."""
    fatal = (record.known is None and not unplaced) or startup_error
    if fatal and not record.killed:
        return Recovery.STARTUP_FAILED
    # dpex's own kills have a budget of their own (the scheduler's), not max_restarts.
    if record.killed or record.restarts < max_restarts:
        return Recovery.RESTART
    return Recovery.DIED


def exit_error(record: WorkerRecord, *, startup: bool, cause: BaseException | None,
               max_restarts: int) -> DpexError:
    """What a fatal exit (see :func:`recovery`) raises: ``WorkerStartupError`` for a
    worker that failed to start (``startup``), else ``WorkerDiedError``; ``cause``: its
    error (None: its session ended without one)."""
    if startup:
        where = (record.known or {}).get("node_ip", "unknown node")
        what = str(cause) if isinstance(cause, WorkerStartupError) else (
            f"{type(cause).__name__}: {cause}")
        return WorkerStartupError(f"dpex worker {record.id} (node {where}) failed to start: "
                                  f"{what}")
    return WorkerDiedError(
        f"{record.describe()} died after {record.restarts} restart(s), the most "
        f"max_worker_restarts={max_restarts} allows: "
        + (f"{type(cause).__name__}: {cause}" if cause is not None
           else "its session ended without an error"))
