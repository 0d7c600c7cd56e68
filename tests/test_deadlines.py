"""Deadlines without a clock: what is due while the training thread waits (issue 26)."""

import pytest

from dpex.client._deadlines import Deadlines, Due


def deadlines(**kw):
    return Deadlines(100.0, **{"timeout": 0.0, "startup_timeout": 30.0, "lost_every": 1.0,
                               "placement_grace": 2.0, "poll": 5.0, **kw})


@pytest.mark.parametrize("now, starting, until, due, wait", [
    (100.0, True, None, Due.WAIT, 1.0),  # the lost check comes first
    (101.0, True, None, Due.LOST_CHECK, 0.0),
    (100.5, True, 100.7, Due.WAIT, 0.2),  # until is nearer
    (100.7, True, 100.7, Due.UNTIL, 0.0),
    (130.0, True, None, Due.STARTUP_TIMED_OUT, 0.0),
    (130.0, True, 100.7, Due.STARTUP_TIMED_OUT, 0.0),  # a timeout before anything else
])
def test_what_is_due_while_workers_start(now, starting, until, due, wait):
    d = deadlines()
    d.lost_checked(now - 1.0 if due is Due.LOST_CHECK else now)
    d.placement_checked()
    got, left = d.next(now, d.wait_deadline(now, starting), starting, until)
    assert got is due and left == pytest.approx(wait)


def test_the_placement_check_comes_once_per_start_and_only_while_starting():
    d = deadlines(lost_every=100.0)
    assert d.next(101.0, d.wait_deadline(101.0, True), True) == (Due.WAIT, pytest.approx(1.0))
    assert d.next(102.0, d.wait_deadline(102.0, True), True)[0] is Due.PLACEMENT_CHECK
    assert d.next(102.0, None, False)[0] is Due.WAIT  # running: no placement question
    d.placement_checked()
    assert d.next(103.0, d.startup_at, True)[0] is Due.WAIT
    d.starting(110.0)  # a replacement: its own start-up limit and placement check
    assert d.startup_at == 140.0
    assert d.next(112.0, d.startup_at, True)[0] is Due.PLACEMENT_CHECK


def test_torchs_timeout_counts_from_the_wait_and_zero_waits_forever_polling():
    d = deadlines(timeout=3.0, lost_every=100.0)
    limit = d.wait_deadline(150.0, starting=False)
    assert limit == 153.0
    assert d.next(152.0, limit, False) == (Due.WAIT, pytest.approx(1.0))
    assert d.next(153.0, limit, False)[0] is Due.TIMED_OUT
    d = deadlines(timeout=0.0, lost_every=100.0)
    assert d.wait_deadline(150.0, starting=False) is None
    assert d.next(150.0, None, False) == (Due.WAIT, 5.0)  # the poll: is the loop alive?


def test_a_check_that_ran_past_a_timeout_cannot_postpone_it():
    """The old loop recomputed its wait as min(deadline, lost check) and ran the lost
    check whenever that was <= 0: a deadline that passed during a check turned it into
    a busy loop of lost checks that never raised."""
    d = deadlines(timeout=1.0)
    limit = d.wait_deadline(100.0, starting=False)
    d.lost_checked(102.0)  # the check itself ran until after the limit
    assert d.next(102.0, limit, False)[0] is Due.TIMED_OUT
