"""LossWatch without I/O: gaps found on arrival, silence only past the first batch."""

from dpex.client._lost import LossWatch


def test_a_result_that_overtakes_an_earlier_task_reports_that_task_lost():
    watch = LossWatch(2, timeout=None, floor=10.0)
    for seq in range(3):
        watch.sent(seq, 1 if seq == 0 else None)
    assert watch.result(1, 2, [(0, [0]), (1, [1])]) == [(0, [0]), (1, [1])]
    assert watch.result(1, 0, [(1, [1])]) == []  # nothing sent before it is missing


def test_silence_counts_only_for_workers_past_their_first_batch_and_a_set_timeout():
    watch = LossWatch(2, timeout=0.0, floor=10.0)
    assert watch.limit() is None and watch.silent([0, 1]) == []
    watch = LossWatch(2, timeout=1e-9, floor=10.0)
    watch.sent(0, 0)
    assert watch.silent([0, 1]) == []  # no result yet: still loading
    watch.result(0, 0, [])
    assert watch.silent([0, 1]) == [0]
    assert LossWatch(1, timeout=None, floor=10.0).limit() == 10.0
