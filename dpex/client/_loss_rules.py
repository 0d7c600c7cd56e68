"""The scheduler's rules for lost batches, hung workers and stragglers (a mixin of
:class:`~dpex.client._scheduler.EpochScheduler`, one concept apart from dispatch and
results): what :meth:`check_lost` does each time the training thread looks, and how
tasks move off a worker (backed up, handed over, computed again) or a worker is killed.

It reads and changes the scheduler's own state: ``workers``, ``ledger``, ``losses``,
``backups``, ``kill_budget``, ``counters``, ``epoch``, ``iterable``,
``prefetch_factor``, ``straggler_timeout`` and its action list (``_out``), through
``_flush``, ``_stop_drained`` and ``_actions``.
"""

from __future__ import annotations

import collections
from typing import Any

from dpex.client._actions import Fatal, SendTasks
from dpex.client._kills import KillWorker

__all__ = ["LossRules"]


class LossRules:
    def check_lost(self) -> list[Any]:
        """The lost-batch and hung-worker rules (:mod:`dpex.client._lost`). A worker
        that holds tasks and from which nothing came for the limit lost them (a frame
        or task dropped with a connection), or is stopped or wedged: they are computed
        again, and a map-style worker takes no new task until it is heard from; silent
        for another limit, it hangs: killed and replaced. A task a healthy worker is
        past whose result stays missing for the limit is computed again. A worker that
        computes one batch past ``hung_timeout`` is killed and replaced. (An idle
        worker's silence says nothing.)"""
        self._flush()  # (what is queued here was never sent, so never lost)
        busy = {w: [seq for seq, _ in self.ledger.outstanding(w)]
                for w in self.workers.ready_infos() if self.ledger.pending(w)}
        silent = self.losses.silent(busy)
        lost = {w: self.ledger.outstanding(w) for w in silent}
        for w in silent:
            if not self.iterable:
                self.workers[w].suspended = True
                self.counters["suspended"] += 1
        for w, seqs in self.losses.passed(
                {w: seqs for w, seqs in busy.items() if w not in lost}).items():
            lost[w] = [t for t in self.ledger.outstanding(w) if t[0] in seqs]
        for w, tasks in lost.items():
            self.counters["lost"] += len(tasks)
            self._recompute(w, tasks, avoid=set(silent))
        for w, seq in self.losses.stragglers(busy, self.straggler_timeout):
            self._back_up(w, seq)
        computing = [*busy, *(r.id for r in self.workers.records
                              if r.straggling and r.id not in busy)]
        for w, seq, working in self.losses.overdue(computing):
            self._kill(KillWorker(w, "computing", seq, working))
        for w, silence in self.losses.hung():
            rec = self.workers[w]
            if self.iterable or not rec.suspended or rec.gone:
                continue  # (an IterableDataset's silent worker was killed at once)
            self._kill(KillWorker(w, "silent", None, silence))
        self._stop_drained()
        return self._actions()

    def _back_up(self, w: int, seq: int) -> None:
        """``w`` straggles on ``seq``: it and the tasks queued behind it go to the other
        workers (:mod:`dpex.client._backups`) if one has room; ``w`` keeps computing."""
        rec = self.workers[w]
        if rec.killed or not any(r.id != w and r.ready and r.active and r.accepting
                                 and r.pending < self.prefetch_factor
                                 for r in self.workers.records):
            return  # (tried again at the next check)
        if self._hand_over(w, self.ledger.outstanding(w)):
            rec.straggling = (self.epoch, seq)
            self.backups.launched_for(seq, w)

    def _backup_wasted(self, v: int, seq: int) -> None:
        """The slow worker's copy of ``seq`` came first: ``v`` computes a useless backup;
        the tasks queued behind it there go to the others, and ``v`` takes no new task
        until it is done with that copy (as a straggler)."""
        rec = self.workers[v]
        behind = [t for t in self.ledger.outstanding(v) if self.losses.sent_after(t[0], seq)]
        if not rec.killed and rec.straggling is None and self._hand_over(v, behind):
            rec.straggling = (self.epoch, seq)

    def _kill(self, kill: KillWorker) -> None:
        """dpex kills a worker (its exit comes back and it is replaced, apart from
        ``max_restarts``), or gives up once its budget is spent (:mod:`._kills`)."""
        rec = self.workers[kill.worker_id]
        if rec.killed:
            return  # on its way out already
        spent = self.kill_budget.spend(kill, rec.kills)
        rec.kills += 1
        rec.killed = True
        self.counters["replaced_for_lost" if kill.why == "lost" else "replaced_hung"] += 1
        self._out.append(kill if spent is None else
                         Fatal(kill.worker_id, startup=False, hung=spent))

    def _recompute(self, w: int, tasks: list[tuple[int, Any]],
                   avoid: set[int] = frozenset()) -> None:
        """A map-style batch by the ready worker holding least (not one of ``avoid``,
        also silent; ``w`` itself if it is alone), an IterableDataset's by a
        replacement of ``w`` (only it can produce the rest of its shard), which starts
        after what ``w`` delivered."""
        if self.iterable:
            self._kill(KillWorker(w, "lost", min(seq for seq, _ in tasks) if tasks else None))
            return
        self._hand_over(w, tasks, keep_owner_if_alone=True, avoid=avoid)

    def _hand_over(self, w: int, tasks: list[tuple[int, Any]],
                   keep_owner_if_alone: bool = False, avoid: set[int] = frozenset()) -> bool:
        """Give map-style ``tasks`` of ``w`` to the other ready workers at once; False if
        there is none (they wait for ``w``'s replacement)."""
        others = [r.id for r in self.workers.records
                  if r.id != w and r.ready and r.active and r.accepting and r.id not in avoid]
        if not others:
            if not keep_owner_if_alone:
                return False
            others = [w]
        sent: dict[int, list[tuple[int, Any]]] = collections.defaultdict(list)
        for seq, _ in tasks:
            v = min(others, key=self.ledger.held)
            sent[v].append((seq, self.ledger.reassign(seq, v)))
            self.losses.sent(seq)
        for v, batch in sent.items():
            self.counters["handed_over"] += len(batch) if v != w else 0
            self._out.append(SendTasks(v, self.epoch, batch))
        return True

