"""A slow batch is not a hung worker (issue 39, item 1), on a fake clock, without Ray.

Workers here compute their tasks in order, each for its own time, and report what they
compute every second (PROGRESS), as dpex's workers do; the loop takes at once and looks
for lost batches every second, as the iterator does. ``progress=False`` runs the same
epoch with workers that report nothing: the rules as they were before PROGRESS (a
silent worker was presumed lost, then hung), whose kills these tests also count.
"""

import collections

import pytest
from test_scheduler import Clock, draw_from, msg

from dpex._protocol import IDLE, LOADING
from dpex.client._scheduler import (
    EPOCH_END,
    MAX_HANGS_PER_BATCH,
    EpochScheduler,
    Fatal,
    KillWorker,
    SendTasks,
    StartReplacement,
)
from dpex.client._worker_table import WorkerRecord, recovery

STEP = 0.01  # the fake clock's tick: s


class Cluster:
    """``n`` map-style workers on a fake clock. ``took(w, inc, seq)``: a batch's time
    (None: forever); ``loading``: a first batch's extra time (the dataset, worker_init_fn);
    ``frozen(w, inc, now)``: the process is stopped (SIGSTOP): it computes and reports
    nothing; ``drop``: (worker, seq) whose result is lost on the way."""

    def __init__(self, n, batches, took, *, loading=0.0, frozen=None, drop=(), progress=True,
                 max_restarts=3, **limits):
        self.clock = Clock()
        self.s = EpochScheduler(n, 2, max_restarts=max_restarts, clock=self.clock, **limits)
        self.took, self.loading, self.progress = took, loading, progress
        self.frozen = frozen or (lambda w, inc, now: False)
        self.drop = set(drop)
        self.queues = [collections.deque() for _ in range(n)]
        self.inc = [0] * n
        self.working = [None] * n  # (seq, indices, started, due) or None
        self.fresh = [True] * n  # its first task (incarnation) is still to start
        self.kills, self.fatal, self.got, self.taken_at = [], None, [], []
        self.draw = draw_from([[i] for i in range(batches)])

    def apply(self, actions):
        for a in actions:
            if isinstance(a, SendTasks):
                self.queues[a.worker_id].extend(a.tasks)
            elif isinstance(a, KillWorker):
                self.kills.append((self.clock.now, a))
                w = a.worker_id
                self.queues[w].clear()
                self.working[w] = None
                self.apply(self.s.exited(w, self.inc[w]))
            elif isinstance(a, StartReplacement):
                self.inc[a.worker_id], self.fresh[a.worker_id] = a.incarnation, True
                self.apply(self.s.ready(a.worker_id, {}))
            elif isinstance(a, Fatal):
                self.fatal = a

    def tick(self, w):
        now, work = self.clock.now, self.working[w]
        if self.frozen(w, self.inc[w], now):
            return
        if work is None and self.queues[w]:
            seq, idx = self.queues[w].popleft()
            took = self.took(w, self.inc[w], seq)
            extra = self.loading if self.fresh[w] else 0.0
            self.fresh[w] = False
            due = None if took is None else now + extra + took
            work = self.working[w] = (seq, idx, now, due)
        if work is not None and work[3] is not None and now >= work[3]:
            self.working[w] = None
            if (w, work[0]) not in self.drop:
                self.apply(self.s.results([msg(1, work[0], w, payload=work[1],
                                                inc=self.inc[w])]))

    def report(self, w):
        now, work = self.clock.now, self.working[w]
        if self.frozen(w, self.inc[w], now):
            return
        if work is None:
            seq, working = (LOADING, 0.0) if self.fresh[w] and self.queues[w] else (IDLE, 0.0)
        else:
            seq, working = work[0], now - work[2]
        self.apply(self.s.progress(w, self.inc[w], 1, seq, working, len(self.queues[w])))

    def run(self, limit=5_000.0):
        """The epoch: (batches taken, seconds it took)."""
        self.apply(self.s.start_epoch(self.draw))
        for w in range(len(self.queues)):
            self.apply(self.s.ready(w, {}))
        start = self.clock.now
        next_second = start + 1.0
        while self.clock.now < start + limit and self.fatal is None:
            self.clock.now += STEP
            for w in range(len(self.queues)):
                self.tick(w)
            if self.clock.now >= next_second:
                next_second += 1.0
                if self.progress:
                    for w in range(len(self.queues)):
                        self.report(w)
                self.apply(self.s.check_lost())
            while self.fatal is None:
                item, actions = self.s.take(self.draw)
                self.apply(actions)
                if item is EPOCH_END:
                    return self.got, self.clock.now - start
                if item is None:
                    break
                self.got.append(item.payload)
                self.taken_at.append(self.clock.now - start)
        return self.got, self.clock.now - start


def every(n, slow, usual=0.05):
    return lambda w, inc, seq: slow if seq % n == n - 1 else usual


def one(seq_, slow, usual=0.05):
    return lambda w, inc, seq: slow if seq == seq_ else usual


@pytest.mark.parametrize("progress", [True, False])
def test_one_batch_in_100_taking_25_s_kills_nobody(progress):
    """The issue's first case (derived limit: 10 x 50 ms, at least 10 s)."""
    c = Cluster(2, 1000, every(100, 25.0), progress=progress, first_batch_timeout=120.0)
    got, took = c.run()
    if not progress:  # before PROGRESS: each slow batch looked lost, then hung
        assert c.kills, c.s.counters
        return
    assert got == [[i] for i in range(1000)] and c.fatal is None
    assert c.kills == [] and c.s.counters["lost"] == 0 and c.s.counters["suspended"] == 0


@pytest.mark.parametrize("case", ["150 s batch", "250 s first batch"])
def test_a_long_batch_or_a_long_first_batch_finishes_its_epoch_with_no_kill(case):
    if case == "150 s batch":
        c = Cluster(2, 200, one(40, 150.0), first_batch_timeout=120.0)
    else:  # loading the dataset and worker_init_fn take 250 s (startup_timeout: 120 s)
        c = Cluster(2, 200, lambda w, inc, seq: 0.05, loading=250.0, first_batch_timeout=120.0)
    got, took = c.run()
    assert got == [[i] for i in range(200)] and c.fatal is None
    assert c.kills == [] and c.s.counters["lost"] == 0, (c.kills, c.s.counters)


def test_before_progress_a_150_s_batch_was_killed():
    c = Cluster(2, 200, one(40, 150.0), progress=False, first_batch_timeout=120.0)
    c.run()
    assert c.kills or c.fatal


def test_a_batch_computing_past_hung_batch_timeout_is_killed_and_the_epoch_stays_exact():
    """A ``__getitem__`` that sleeps forever (its worker alive, reporting it) on worker 0's
    first incarnation: killed once the batch has run the limit, redone elsewhere."""
    def took(w, inc, seq):
        return None if (w, inc, seq) == (0, 0, 30) else 0.05

    c = Cluster(2, 300, took, hung_timeout=40.0, first_batch_timeout=120.0)
    got, elapsed = c.run()
    assert got == [[i] for i in range(300)] and c.fatal is None
    [(at, kill)] = c.kills
    assert kill.worker_id == 0 and kill.why == "computing" and kill.seq == 30
    assert 40.0 < kill.seconds < 42.0, kill  # the limit, then the next check
    assert c.s.counters["replaced_hung"] == 1 and c.s.counters["lost"] == 0


def test_a_stopped_process_is_found_silent_then_replaced_within_two_limits():
    """SIGSTOP: no result, no PROGRESS. One limit moves its tasks and suspends it, another
    replaces it; the epoch stays exact."""
    def frozen(w, inc, now):
        return (w, inc) == (0, 0) and now >= 1005.0

    c = Cluster(2, 600, lambda w, inc, seq: 0.05, frozen=frozen, lost_timeout=3.0,
                first_batch_timeout=120.0)
    got, _ = c.run()
    assert got == [[i] for i in range(600)] and c.fatal is None
    [(at, kill)] = c.kills
    assert kill.why == "silent" and 1005.0 + 6.0 < at < 1005.0 + 8.5, at  # two limits
    assert c.s.counters["suspended"] == 1 and c.s.counters["replaced_hung"] == 1


def test_a_healthy_workers_last_result_lost_is_found_by_its_progress():
    """Worker 1's result of its last task is dropped; it reports itself idle: that task
    is lost once it stayed missing for the limit (2 s), not hung."""
    c = Cluster(2, 40, lambda w, inc, seq: 0.05, drop=[(1, 39)], lost_timeout=2.0,
                first_batch_timeout=120.0)
    got, took = c.run()
    assert got == [[i] for i in range(40)]
    assert c.s.counters["lost"] == 1 and c.kills == [] and took < 8.0, (c.s.counters, took)


def test_a_result_dropped_while_its_worker_computes_on_is_found_by_its_progress():
    """Worker 0 is past seq 4 (it computes a later, slow task), whose result never came."""
    c = Cluster(2, 20, lambda w, inc, seq: 30.0 if seq == 6 else 0.05, drop=[(0, 4)],
                lost_timeout=3.0, first_batch_timeout=120.0)
    got, took = c.run()
    assert got == [[i] for i in range(20)]
    assert c.s.counters["lost"] == 1 and c.kills == [], c.s.counters
    assert c.taken_at[4] < 6.0, c.taken_at  # found while seq 6 still computes (30 s)


def test_a_suspended_workers_late_results_clear_it_even_when_others_delivered_them():
    """The second path of item 1: its late copies arrive after another worker delivered
    the same batches (their slots are gone): it answered, so it takes tasks again."""
    clock = Clock()
    s = EpochScheduler(2, 2, lost_timeout=2.0, first_batch_timeout=2.0, clock=clock)
    draw = draw_from([[i] for i in range(20)])
    s.start_epoch(draw)
    for w in (0, 1):
        s.ready(w, {})
    s.results([msg(1, 1, 1, payload=[1])])
    clock.now += 3
    s.check_lost()  # worker 0 (seq 0, 2) silent: suspended, its tasks to worker 1
    assert s.workers[0].suspended
    s.results([msg(1, 0, 1, payload=[0]), msg(1, 2, 1, payload=[2])])
    while s.take(draw)[0] not in (None, EPOCH_END):
        pass
    s.results([msg(1, 0, 0, payload=[0])])  # the late copy: its slot was taken already
    assert not s.workers[0].suspended and s.counters["unsuspended"] >= 1
    clock.now += 3
    assert not [a for a in s.check_lost() if isinstance(a, KillWorker)]


def test_a_batch_that_hangs_wherever_it_runs_ends_the_epoch_with_an_error_naming_it():
    c = Cluster(2, 100, lambda w, inc, seq: None if seq == 10 else 0.05, hung_timeout=20.0,
                first_batch_timeout=120.0)
    c.run()
    assert c.fatal is not None and len(c.kills) == MAX_HANGS_PER_BATCH - 1
    assert "killed as hung after" in c.fatal.hung and "batch 10" in c.fatal.hung, c.fatal


def test_dpex_kills_do_not_spend_max_worker_restarts():
    """With the Ray test's numbers: max_worker_restarts=1 and two kills as hung."""
    rec = WorkerRecord(0, info={}, known={})
    for _ in range(2):
        rec.kills, rec.killed = rec.kills + 1, True
        assert recovery(rec, startup_error=False, unplaced=False,
                        max_restarts=1).value == "restart"
        rec.incarnation, rec.killed = rec.incarnation + 1, False
    assert recovery(rec, startup_error=False, unplaced=False, max_restarts=1).value == "restart"
    rec.incarnation += 1  # a death of its own
    assert recovery(rec, startup_error=False, unplaced=False, max_restarts=1).value == "died"
