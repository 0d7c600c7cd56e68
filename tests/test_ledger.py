"""The task ledger: what a dead worker held, and how much of its shard it delivered."""

import pytest

from dpex.client._ledger import TaskLedger
from dpex.client._worker_table import WorkerTable


def test_outstanding_is_what_was_dispatched_and_not_received_in_seq_order():
    ledger = TaskLedger(WorkerTable(2))
    for seq in range(6):
        ledger.dispatch(seq, seq % 2, [seq * 10])
    assert ledger.received(2) and ledger.received(0)
    assert not ledger.received(2)  # a duplicate (late copy from a dead worker)
    assert ledger.outstanding(0) == [(4, [40])]
    assert ledger.outstanding(1) == [(1, [10]), (3, [30]), (5, [50])]
    assert (ledger.delivered(0), ledger.delivered(1)) == (2, 0)


def test_held_counts_until_consumed_and_reset_forgets_the_epoch():
    ledger = TaskLedger(WorkerTable(2))
    ledger.dispatch(0, 1, None)
    ledger.dispatch(1, 1, None)
    assert ledger.held(1) == 2
    ledger.received(0)
    assert ledger.held(1) == 2  # received but not yet taken by the training loop
    ledger.consumed(0)
    assert ledger.held(1) == 1 and ledger.worker_of(0) is None and ledger.worker_of(1) == 1
    ledger.consumed(1)  # skipped without a result (an exhausted iterable worker's slot)
    assert ledger.held(1) == 0 and ledger.outstanding(1) == []
    ledger.reset()
    assert ledger.delivered(1) == 0 and not ledger.received(0)
    with pytest.raises(ValueError, match="already dispatched"):
        ledger.dispatch(3, 0, None)
        ledger.dispatch(3, 1, None)


def test_a_reassigned_task_moves_with_its_hold_and_only_its_new_owner_counts():
    ledger = TaskLedger(WorkerTable(3))
    ledger.dispatch(0, 1, [0, 1])
    ledger.dispatch(1, 1, [2, 3])
    assert ledger.reassign(1, 2) == [2, 3]
    assert ledger.outstanding(1) == [(0, [0, 1])] and ledger.outstanding(2) == [(1, [2, 3])]
    assert (ledger.held(1), ledger.held(2)) == (1, 1) and ledger.worker_of(1) == 2
    assert ledger.received(1) and ledger.delivered(2) == 1 and ledger.delivered(1) == 0
    with pytest.raises(ValueError, match="not outstanding"):
        ledger.reassign(1, 0)


def test_the_counts_live_on_the_worker_records_so_an_added_worker_needs_no_growing():
    workers = WorkerTable(1)
    ledger = TaskLedger(workers)
    added = workers.add()  # (the ledger is not told: it reads and writes the record)
    ledger.dispatch(0, added.id, [0])
    assert added.held == added.pending == ledger.held(1) == 1
    assert ledger.received(0) and (added.pending, added.delivered) == (0, 1)
    ledger.reset()
    assert (added.held, added.pending, added.delivered) == (0, 0, 0)
