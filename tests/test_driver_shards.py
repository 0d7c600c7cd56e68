"""EpochDriver's rules for an IterableDataset's shards, with the in-memory worker group
playing the workers (tests/fake_runtime.py, ``driver(shards=...)``): each worker
iterates its own shard, so a dead worker's replacement passes over (SKIP) what its
predecessor delivered, or resumes its dataset's own state; a shard that ended answers
END and gets no more tasks. The epoch is torch's: one batch of each worker in turn, a
worker left out once its shard ended (``round_robin``, checked against torch's
DataLoader for these shard shapes). No Ray: each test runs in milliseconds. The real
cases stay on Ray: test_faults.py (a worker SIGKILLed), test_lost.py (a lossy data
socket), test_resume_ray.py (real datasets' own state, through state_dict())."""

from __future__ import annotations

import pytest
from fake_runtime import driver, rest, round_robin, start_shards, take, wait_for

from dpex.client._scheduler import SendTasks

pytestmark = pytest.mark.timeout(30)

# Worker 0's shard outlasts worker 1's (10 and 6 batches).
SHARDS = {0: [f"a{i}" for i in range(10)], 1: [f"b{i}" for i in range(6)]}


def skips(workers):
    """The SKIPs the workers applied: (worker, incarnation, epoch, n)."""
    return [(w, inc, epoch, n) for w, inc, kind, epoch, n in workers.controls
            if kind == "skip"]


def delivered(workers, w, epoch=1):
    """The slots of the batches (not ENDs) worker ``w`` computed and sent in ``epoch``."""
    return [seq for v, _, e, seq in workers.batches if (v, e) == (w, epoch)]


# -- a replacement passes over what its predecessor delivered ---------------------------

@pytest.mark.parametrize("held", [True, False], ids=["tasks-it-held", "batches-ahead"])
def test_a_dead_workers_replacement_passes_over_exactly_what_it_delivered(held):
    """(test_faults.py keeps the real case: a worker SIGKILLed.) ``held``: it dies
    holding tasks it never computed (they are redone); else with batches delivered
    that the training loop has not taken yet (they are not)."""
    d, runtime, _, _ = driver(2, live=True, shards=SHARDS)
    workers = runtime.workers
    draw = start_shards(d)
    got = take(d, draw, 3)
    if held:
        workers.pause(0)
        got += take(d, draw, 2)
        assert workers.holds(0)
    before = delivered(workers, 0)
    if not held:  # (more than the training loop took of it)
        assert len(before) > sum(b.startswith("a") for b in got)
    workers.die(0)
    got += rest(d, draw)
    assert got == round_robin(SHARDS)
    assert skips(workers) == [(0, 1, 1, len(before))]
    assert ("restart", 0, 1) in workers.calls and d.sched.counters["restarted"] == 1


def test_a_batch_of_a_shard_lost_has_its_worker_replaced_redoing_the_shard_from_it():
    """(test_lost.py keeps the real case: a lossy data socket.) Overtaken by its
    worker's next batch, the loss shows; only a replacement can make the rest of the
    shard: the worker is killed (no restart spent), the replacement passes over the
    two batches before it and redoes every task from it (a later batch that did
    arrive comes again, as a duplicate)."""
    d, runtime, _, _ = driver(2, live=True, shards=SHARDS, max_restarts=0)
    workers = runtime.workers
    workers.drop.add((0, 4))  # worker 0's third task
    draw = start_shards(d)
    assert rest(d, draw) == round_robin(SHARDS)
    assert [c for c in workers.calls if c[0] in ("kill", "restart")] == [
        ("kill", 0), ("restart", 0, 1)]
    assert skips(workers) == [(0, 1, 1, 2)]
    counters = d.sched.counters
    assert counters["lost"] == 1 and counters["replaced_for_lost"] == 1
    assert counters["duplicate"] >= 1


def test_a_batch_of_a_dead_worker_that_arrives_after_its_death_is_redone_not_counted():
    d, runtime, _, _ = driver(2, live=True, shards=SHARDS)
    workers = runtime.workers
    workers.late.add((0, 4))
    draw = start_shards(d)
    got = take(d, draw, 2)
    assert 4 in delivered(workers, 0)
    workers.die(0)
    workers.release_late()  # (after its exit)
    got += rest(d, draw)
    assert got == round_robin(SHARDS)
    assert skips(workers) == [(0, 1, 1, 2)]  # the batches before it, not it
    assert d.sched.counters["stale_incarnation"] == 1
    assert (0, 1, 4) in workers.computed


def test_a_replacement_still_starting_is_waited_for_its_shard_is_nobody_elses():
    """A map-style dead worker's tasks go to the survivors; a shard's wait for its
    worker's replacement (the survivor makes its own batches meanwhile)."""
    d, runtime, _, _ = driver(2, live=True, shards=SHARDS)
    workers = runtime.workers
    draw = start_shards(d)
    got = take(d, draw, 4)
    workers.never_start.add(1)
    workers.die(1)
    wait_for(d, lambda: ("restart", 1, 1) in workers.calls)
    got += take(d, draw, 1)  # (worker 0's: it is not held up)
    assert d.sched.workers[1].starting and workers.holds(1)  # (its tasks wait for it)
    workers.say_hello(1)
    got += rest(d, draw)
    assert got == round_robin(SHARDS)
    assert d.sched.counters["handed_over"] == 0
    assert {w for w, inc, _ in workers.computed if inc == 1} == {1}


# -- a shard that ended -----------------------------------------------------------------

def test_a_worker_whose_shard_ended_gets_no_task_once_its_end_came():
    shards = {0: [f"a{i}" for i in range(30)], 1: ["b0", "b1"]}
    d, runtime, _, _ = driver(2, live=True, shards=shards)
    after_end = []  # tasks sent to a worker whose END the driver had taken in
    send_all = runtime.session.send_all

    def watched(messages):
        after_end.extend((m.worker_id, seq) for m in messages if isinstance(m, SendTasks)
                         and not d.sched.workers[m.worker_id].active for seq, _ in m.tasks)
        send_all(messages)

    runtime.session.send_all = watched
    draw = start_shards(d)
    expected = round_robin(shards)
    got = take(d, draw, len(expected))  # (not rest(): with the rule broken it never ends)
    assert not after_end
    assert len([seq for w, _, seq in runtime.workers.computed if w == 1]) <= 2 + 2  # (+ window)
    got += rest(d, draw)
    assert got == expected


def test_a_replacement_of_a_worker_whose_shard_ended_gets_no_task_this_epoch():
    """It is started (a persistent worker has later epochs), told to pass over its
    whole shard (SKIP: its predecessor's tasks, the END's included) and given no task:
    its slots hold nothing."""
    shards = {0: [f"a{i}" for i in range(12)], 1: ["b0", "b1"]}
    d, runtime, _, _ = driver(2, live=True, shards=shards)
    workers = runtime.workers
    draw = start_shards(d)
    got = take(d, draw, 6)
    assert not d.sched.workers[1].active
    tasks = d.sched.workers[1].shard.count
    workers.die(1)
    got += rest(d, draw)
    assert got == round_robin(shards)
    assert ("restart", 1, 1) in workers.calls
    assert skips(workers) == [(1, 1, 1, tasks)]
    assert not [c for c in workers.computed if c[:2] == (1, 1)]


# -- a resumed epoch ---------------------------------------------------------------------

def test_a_resumed_epoch_passes_over_what_each_worker_delivered_before_and_after():
    """(test_resume_ray.py keeps the real case, through state_dict().) Worker 1's
    shard ended before the state: it gets no task at all (not one to find its end
    again). Worker 0 passes over its 3 batches; its replacement, those and the ones
    it delivered since."""
    shards = {**SHARDS, 2: [f"c{i}" for i in range(8)]}
    d, runtime, _, _ = driver(3, live=True, shards=shards)
    workers = runtime.workers
    draw = start_shards(d, first_worker=2, ended=frozenset({1}), skips={0: 3, 2: 2})
    got = take(d, draw, 4)
    since = delivered(workers, 0)
    workers.die(0)
    got += rest(d, draw)
    assert got == round_robin(shards, first_worker=2, skips={0: 3, 2: 2}, ended={1})
    assert not [c for c in workers.computed if c[0] == 1]
    assert skips(workers) == [(0, 0, 1, 3), (2, 0, 1, 2), (0, 1, 1, 3 + len(since))]


def test_a_replacement_resumes_its_datasets_own_state_in_the_resumed_epoch_only():
    """A stateful dataset resumes where its state says (no SKIP for it); a replacement
    in that epoch starts from the same state and passes over only what was delivered
    since; one in a later epoch starts its shard anew."""
    d, runtime, _, _ = driver(2, live=True, shards=SHARDS, worker_rng={0: {"dataset": {"pos": 3}},
                                          1: {"dataset": {"pos": 2}}})
    workers = runtime.workers
    epochs = []
    for epoch in (1, 2):
        draw = start_shards(d)
        got = take(d, draw, 4)
        since = delivered(workers, 0, epoch)
        workers.die(0)
        epochs.append(got + rest(d, draw))
        assert skips(workers)[-1] == (0, epoch, epoch, len(since))
    assert epochs == [round_robin(SHARDS, skips={0: 3, 1: 2}), round_robin(SHARDS)]
    assert len(skips(workers)) == 2  # (none for the resumed state itself)
