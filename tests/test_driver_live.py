"""EpochDriver's recovery rules with the in-memory worker group playing the workers
(tests/fake_runtime.py, ``live=True``): deaths and replacements, workers that never
start, the RNG query of ``state_dict()``, scaling, lost and late frames. No Ray, no
sockets, no threads: each test runs in milliseconds (those that wait for a limit, in
its fraction of a second). The live tests keep one real case of each (test_faults.py,
test_resources.py, test_lifecycle.py, test_resume_ray.py, test_autoscale.py,
test_lost.py)."""

from __future__ import annotations

import time

import pytest
from fake_runtime import (
    driver,
    indices,
    rest,
    rng_state,
    round_robin,
    start,
    start_shards,
    take,
    wait_for,
)

from dpex._protocol import Kind
from dpex.client import _driver
from dpex.errors import DpexTimeoutError, WorkerDiedError

pytestmark = pytest.mark.timeout(30)


@pytest.fixture
def quick_lost_checks(monkeypatch):
    """The training thread looks for lost batches every 50 ms (not every second)."""
    monkeypatch.setattr(_driver, "_LOST_CHECK_S", 0.05)


# -- deaths ------------------------------------------------------------------------------

def test_a_dead_workers_tasks_go_to_the_survivors_before_its_replacement_is_up():
    """(Was test_lost.py's, on Ray.) Its replacement never starts here: the epoch ends
    on worker 0 alone, well within the replacement's startup_timeout."""
    d, runtime, _, _ = driver(2, live=True, startup_timeout=5)
    workers = runtime.workers
    draw = start(d, 20)
    got = take(d, draw, 3)
    workers.pause(1)  # (it holds the tasks sent to it from now on)
    got += take(d, draw, 1)
    assert workers.holds(1)
    workers.never_start.add(1)
    workers.die(1)
    got += rest(d, draw)
    assert got == indices(20)
    assert ("restart", 1, 1) in workers.calls
    assert d.sched.counters["handed_over"] >= 1
    assert "ready_at" not in d.sched.recoveries[0]  # the epoch did not wait for it


def test_past_max_worker_restarts_the_error_names_the_worker_and_node():
    """(Was test_faults.py's, on Ray.) A worker dies, its replacement says HELLO, then
    dies too: one restart is all max_worker_restarts=1 allows."""
    d, runtime, _, owner = driver(2, live=True, max_restarts=1)
    draw = start(d, 200)
    take(d, draw, 1)
    runtime.workers.die(1)
    wait_for(d, lambda: 1 in d.ready and d.sched.workers[1].incarnation == 1)
    assert d.ready[1]["pid"] == 1011  # worker 1, incarnation 1
    runtime.workers.die(1, RuntimeError("segfault"))
    with pytest.raises(WorkerDiedError) as err:
        rest(d, draw)
    assert str(err.value).startswith(
        "dpex worker 1 (pid 1011, node 127.0.0.1) died after 1 restart(s), the most "
        "max_worker_restarts=1 allows: RuntimeError: segfault")
    assert owner.stops == 1 and runtime.closed


def test_an_added_worker_killed_mid_epoch_is_replaced_and_the_epoch_is_exact():
    """(Was test_autoscale.py's, on Ray.) Once it said HELLO it is one of the workers:
    replaced as they are (one that never started is given up instead)."""
    d, runtime, _, _ = driver(1, live=True)
    draw = start(d, 40)
    got = take(d, draw, 2)
    d.elastic.scale_to(2, draw)
    got += take(d, draw, 4)
    assert 1 in d.ready
    runtime.workers.die(1)
    got += rest(d, draw)
    assert got == indices(40)
    assert ("restart", 1, 1) in runtime.workers.calls
    assert d.sched.counters["restarted"] == 1 and d.sched.recoveries[0]["worker"] == 1
    assert {w for w, inc, _ in runtime.workers.computed if inc == 1} == {1}  # it worked


def test_an_added_worker_dead_before_its_hello_is_given_up_not_replaced():
    d, runtime, _, _ = driver(1, live=True)
    draw = start(d, 30)
    got = take(d, draw, 2)
    runtime.workers.never_start.add(1)
    d.elastic.scale_to(2, draw)
    runtime.workers.die(1)
    got += rest(d, draw)
    assert got == indices(30)
    assert not [c for c in runtime.workers.calls if c[0] == "restart"]
    assert d.sched.counters["add_failed"] == 1 and d.sched.workers[1].gone


# -- start timeouts ----------------------------------------------------------------------

def test_hellos_that_came_while_nobody_looked_are_no_start_up_failure():
    """(Was test_lifecycle.py's non-persistent case, on Ray; its persistent case, which
    begins the same way, stays there.) The training loop first looks after
    startup_timeout: the HELLOs that came meanwhile count."""
    d, _, _, owner = driver(2, live=True, startup_timeout=0.05)
    draw = start(d, 12)
    time.sleep(0.1)
    assert rest(d, draw) == indices(12)
    assert owner.stops == 0


def test_an_added_worker_that_never_starts_is_given_up_and_its_tasks_go_to_the_others(
        quick_lost_checks):
    d, runtime, _, _ = driver(1, live=True, startup_timeout=0.2)
    draw = start(d, 30)
    got = take(d, draw, 2)
    runtime.workers.never_start.add(1)
    d.elastic.scale_to(2, draw)  # (with in_order, tasks are held for it: they wait)
    got += rest(d, draw)
    assert got == indices(30)
    assert ("retire", 1) in runtime.workers.calls and d.sched.workers[1].gone
    assert {w for w, _, _ in runtime.workers.computed} == {0}


# -- RNG queries -------------------------------------------------------------------------

def test_each_worker_is_asked_for_its_rng_states_after_its_last_batch_taken():
    d, runtime, _, _ = driver(2, live=True)
    draw = start(d, 20)
    take(d, draw, 5)  # slots 0, 2, 4 by worker 0; 1, 3 by worker 1
    assert d.worker_rng_states({0: (1, 4), 1: (1, 3)}, limit=5) == {
        0: rng_state(0, 0, 1, 4), 1: rng_state(1, 0, 1, 3)}
    assert [s for s in runtime.session.sent if s[0] == "send"] == [
        ("send", 0, Kind.RNG_QUERY, 1, 4), ("send", 1, Kind.RNG_QUERY, 1, 3)]


def test_a_worker_that_dies_while_asked_for_its_rng_states_is_none_at_once():
    """(test_resume_ray.py keeps the real case, which also resumes from that state.)"""
    d, runtime, _, _ = driver(2, live=True)
    draw = start(d, 20)
    take(d, draw, 3)
    runtime.workers.mute.add(1)  # (it would never answer)
    runtime.workers.die(1)
    t0 = time.monotonic()
    states = d.worker_rng_states({0: (1, 2), 1: (1, 1)}, limit=5)
    assert time.monotonic() - t0 < 1  # not the query's limit
    assert states == {0: rng_state(0, 0, 1, 2), 1: None}


def test_a_live_worker_that_does_not_answer_is_named_past_the_limit():
    d, runtime, _, _ = driver(2, live=True)
    draw = start(d, 20)
    take(d, draw, 3)
    runtime.workers.mute.add(1)
    with pytest.raises(DpexTimeoutError, match=r"workers \[1\] did not report their RNG "
                       r"states within 0.2 s"):
        d.worker_rng_states({0: (1, 2), 1: (1, 1)}, limit=0.2)


# -- scaling -----------------------------------------------------------------------------

def test_workers_added_and_retired_mid_epoch_change_no_batch():
    """(test_autoscale.py keeps the real case, through the loader's own API.)"""
    d, runtime, _, owner = driver(1, live=True)
    workers = runtime.workers
    draw = start(d, 200)
    got = take(d, draw, 3)
    d.elastic.scale_to(3, draw)
    got += take(d, draw, 10)
    assert {w for w, _, _ in workers.computed} == {0, 1, 2}
    d.elastic.scale_to(1, draw)
    got += rest(d, draw)
    assert got == indices(200)
    counters = d.sched.counters
    assert counters["added"] == 2 and counters["retired"] == 2 and owner.scaled == [3, 1]
    assert [c for c in workers.calls if c[0] in ("add", "retire")] == [
        ("add", 1, 2), ("add", 2, 3), ("retire", 2), ("retire", 1)]
    assert [r.id for r in d.sched.workers.records if r.gone] == [1, 2]
    late = [seq for w, _, seq in workers.computed if w in (1, 2)]
    assert max(late) < 30  # nothing went to them once retired


# -- lost frames -------------------------------------------------------------------------

def test_the_last_batch_of_a_worker_lost_is_found_by_its_silence(quick_lost_checks):
    """(Was test_lost.py's, on Ray.) Nothing comes after it to overtake it."""
    d, runtime, _, _ = driver(2, live=True, lost_batch_timeout=0.2)
    runtime.workers.drop.add((1, 19))
    draw = start(d, 20)
    t0 = time.monotonic()
    assert rest(d, draw) == indices(20)
    assert d.sched.counters["lost"] == 1 and time.monotonic() - t0 >= 0.2
    assert (0, 0, 19) in runtime.workers.computed  # computed again, by the other worker


def test_a_lost_batch_overtaken_by_a_later_one_is_computed_again_at_once():
    """(test_lost.py keeps the real case: a worker's data socket that drops them.) The
    gap shows: no lost_batch_timeout (its floor is 10 s) is waited for."""
    d, runtime, _, _ = driver(2, live=True)
    runtime.workers.drop |= {(1, 3), (1, 7)}
    draw = start(d, 20)
    t0 = time.monotonic()
    assert rest(d, draw) == indices(20)
    assert d.sched.counters["lost"] == 2 and time.monotonic() - t0 < 2


def test_a_frame_that_arrives_after_its_batch_was_computed_again_changes_nothing():
    d, runtime, _, _ = driver(2, live=True)
    runtime.workers.late.add((1, 3))
    draw = start(d, 20)
    got = take(d, draw, 8)  # slot 3 computed again (overtaken by worker 1's next)
    runtime.workers.release_late()
    got += rest(d, draw)
    assert got == indices(20)
    # (its slot was taken: the copy is another slot's no more)
    assert d.sched.counters["lost"] == 1 and d.sched.counters["stale"] == 1


# -- a long training step (issue 48): silence is judged on what was read ----------------

@pytest.mark.parametrize("iterable", [False, True], ids=["map-style", "iterable"])
def test_a_training_step_longer_than_the_lost_limit_costs_no_worker(quick_lost_checks,
                                                                     iterable):
    """Every result came at once, but the training thread was away (a validation loop,
    a checkpoint) for longer than lost_batch_timeout: what arrived meanwhile is read
    before any worker is judged silent, so nothing is presumed lost, redone or killed."""
    shards = {0: [f"a{i}" for i in range(12)], 1: [f"b{i}" for i in range(12)]}
    d, runtime, _, _ = driver(2, live=True, lost_batch_timeout=0.2,
                              shards=shards if iterable else None)
    draw = start_shards(d) if iterable else start(d, 24)
    got = []
    for _ in range(4):
        got += take(d, draw, 5)
        time.sleep(0.5)  # the step: 2.5 lost limits away from dpex
    got += rest(d, draw)
    assert got == (round_robin(shards) if iterable else indices(24))
    counters = d.sched.counters
    assert counters["lost"] == 0 and counters["redispatched"] == 0, dict(counters)
    assert counters["replaced_hung"] == 0 and counters["replaced_for_lost"] == 0
    assert [c for c in runtime.workers.calls if c[0] in ("kill", "restart")] == []


def test_a_batch_read_by_the_drain_before_a_lost_check_is_not_kept_waiting():
    """The drain before a lost check may read the very batch the loop waits for: the
    training thread then looks for it at once, not after the next event (a worker's
    next report: up to a second; a 60 ms step loop ran at half speed so)."""
    d, _, _, _ = driver(1, live=True)
    draw = start(d, 4)
    assert take(d, draw, 1) == indices(4)[:1]  # (the next results are queued, unread)
    d.deadlines.lost_at = 0.0  # a lost check is due
    t0 = time.monotonic()
    d.receive_one(until=time.monotonic() + 30)
    assert time.monotonic() - t0 < 5
    assert take(d, draw, 3) == indices(4)[1:]
