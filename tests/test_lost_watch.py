"""LossWatch without I/O: gaps found on arrival, silence counted from when a worker could
start its oldest task, a first batch judged against the startup limit, hangs named."""

import pytest

from dpex.client._lost import LossWatch
from dpex.client._worker_table import WorkerTable


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_result_that_overtakes_an_earlier_task_reports_that_task_lost():
    watch = LossWatch(WorkerTable(2), timeout=None, floor=10.0)
    for seq in range(3):
        watch.sent(seq)
    assert watch.result(1, 2, [(0, [0]), (1, [1])]) == [(0, [0]), (1, [1])]
    assert watch.result(1, 0, [(1, [1])]) == []  # nothing sent before it is missing


def test_silence_counts_only_for_busy_workers_past_their_first_batch_and_a_set_timeout():
    watch = LossWatch(WorkerTable(2), timeout=0.0, floor=10.0, first_limit=1e-9)
    watch.sent(0)
    assert watch.limit() is None and watch.silent({0: [0]}) == []  # 0: off, first too
    watch = LossWatch(WorkerTable(2), timeout=1e-9, floor=10.0)
    watch.sent(0)
    assert watch.silent({0: [0]}) == []  # no result yet, no first limit: still loading
    watch.result(0, 0, [])
    watch.sent(1)
    assert watch.silent({0: [1], 1: []}) == [0]
    assert LossWatch(WorkerTable(1), timeout=None, floor=10.0).limit() == 10.0


def test_idle_time_is_not_batch_time():
    """Issue 25, item 6: a worker idle for 100 s between 1 s batches has a usual time
    per batch of 1 s, so the derived limit is 10 s, not 1,010 s."""
    clock = Clock()
    watch = LossWatch(WorkerTable(1), timeout=None, floor=0.1, clock=clock)
    for seq in range(21):
        clock.now += 100  # nothing to do (the training loop is slow)
        watch.sent(seq)
        clock.now += 1
        watch.result(0, seq, [])
    assert watch.limit() == pytest.approx(10.0)


def test_a_task_given_to_a_long_idle_worker_is_not_silent_at_once():
    clock = Clock()
    watch = LossWatch(WorkerTable(2), timeout=5.0, floor=10.0, clock=clock)
    watch.sent(0)
    clock.now += 1
    watch.result(1, 0, [])
    clock.now += 100  # idle, then another worker's lost task is handed to it
    watch.sent(1)
    clock.now += 4
    assert watch.silent({1: [1]}) == []
    clock.now += 2
    assert watch.silent({1: [1]}) == [1]
    assert watch.silent({1: [1]}) == []  # flagged: judged by hung() from now


def test_a_first_batch_is_judged_against_the_startup_limit():
    clock = Clock()
    watch = LossWatch(WorkerTable(1), timeout=None, floor=10.0, clock=clock, first_limit=120.0)
    clock.now += 50  # starting: HELLO comes later
    watch.alive(0)
    watch.sent(0)
    clock.now += 119
    assert watch.silent({0: [0]}) == []
    clock.now += 2
    assert watch.silent({0: [0]}) == [0]


def test_a_flagged_worker_silent_for_another_limit_hangs_unless_heard_from():
    clock = Clock()
    watch = LossWatch(WorkerTable(2), timeout=5.0, floor=10.0, clock=clock)
    for w in (0, 1):
        watch.sent(w)
        watch.result(w, w, [])
    watch.sent(2)
    watch.sent(3)
    clock.now += 6
    assert watch.silent({0: [2], 1: [3]}) == [0, 1]
    clock.now += 3
    watch.heard(1)  # a late result: slow, not hung
    assert watch.hung() == []
    clock.now += 3
    assert watch.hung() == [(0, 12.0)]  # (silent since its result at 0)
    assert watch.hung() == []  # named once


def test_an_added_worker_is_watched_through_its_record():
    clock, workers = Clock(), WorkerTable(1)
    watch = LossWatch(workers, timeout=5.0, floor=10.0, clock=clock)
    added = workers.add()  # (the watch is not told: it reads and writes the record)
    watch.alive(added.id)
    clock.now += 1.0
    watch.sent(0)
    clock.now += 6.0
    assert added.heard_at == 1000.0 and watch.silent({added.id: [0]}) == []  # first batch
    watch.result(added.id, 0, [])
    assert added.heard_at == added.last_result_at == 1007.0
