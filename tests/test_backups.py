"""Backups for stragglers (issue 48, step 1; dpex/client/_backups.py): a map-style batch
computed past ``straggler_timeout`` is computed again on another worker with room, the
first result counts, and the slow worker is neither killed nor given new tasks. The
rules on the in-memory driver (tests/fake_runtime.py: the straggler's progress reports
are put on the driver's queue by hand), the target with Ray: one worker blocked
forever from its second batch."""

from __future__ import annotations

import time

import dsets
import pytest
from fake_runtime import driver, indices, rest, start, take, wait_for

from dpex import DpexDataLoader
from dpex._config import DpexConfig
from dpex.client import _driver
from dpex.client._backups import Backups
from dpex.client._events import WorkerProgress

pytestmark = pytest.mark.timeout(60)


@pytest.fixture
def quick_lost_checks(monkeypatch):
    """The training thread looks for lost batches and stragglers every 50 ms."""
    monkeypatch.setattr(_driver, "_LOST_CHECK_S", 0.05)


def blocked(d, runtime, draw, w: int) -> list:
    """Worker ``w`` blocks (paused) on the next task it gets; the batches taken until it
    holds one."""
    runtime.workers.pause(w)
    got = []
    while not runtime.workers.holds(w):
        got += take(d, draw, 1)
    return got


def straggling(d, runtime, handoff, w: int, working_s: float) -> int:
    """Worker ``w`` reports it has computed the oldest task it holds for ``working_s``."""
    seq = next(t[2] for t in runtime.workers.actors[w].tasks if t[0] == "task")
    handoff.put(WorkerProgress(w, d.sched.workers[w].incarnation, d.sched.epoch, seq,
                               working_s, queued=0))
    return seq


@pytest.mark.usefixtures("quick_lost_checks")
def test_a_straggling_batch_is_computed_again_elsewhere_and_its_worker_is_not_killed():
    d, runtime, handoff, _ = driver(2, live=True, straggler_timeout=0.3)
    workers = runtime.workers
    draw = start(d, 20)
    got = take(d, draw, 2)  # (both past their first batch)
    got += blocked(d, runtime, draw, 1)
    seq = straggling(d, runtime, handoff, 1, working_s=1.0)
    got += rest(d, draw)
    assert got == indices(20)
    assert d.sched.backups.stats() == {"launched": 1, "won": 1, "wasted": 0}
    assert d.sched.workers[1].straggling == (1, seq)  # no new task while it computes
    assert all(w == 0 for w, _, s in workers.computed if s > seq)
    assert not any(call[0] in ("restart", "kill") for call in workers.calls)
    assert d.sched.counters["replaced_hung"] == 0

    workers.resume(1)  # it finishes after all: its copy is dropped, it takes tasks again
    wait_for(d, lambda: d.sched.workers[1].straggling is None)
    assert d.sched.counters["stale"] + d.sched.counters["duplicate"] >= 1  # (dropped)
    draw = start(d, 6)
    assert rest(d, draw) == indices(6)
    assert {w for w, _, s in workers.computed[-6:]} == {0, 1}


@pytest.mark.usefixtures("quick_lost_checks")
def test_no_backup_under_the_limit_nor_with_straggler_timeout_none():
    for setting, working_s in ((5.0, 0.1), (None, 1000.0)):
        d, runtime, handoff, _ = driver(2, live=True, straggler_timeout=setting)
        draw = start(d, 12)
        got = take(d, draw, 2)
        got += blocked(d, runtime, draw, 1)
        straggling(d, runtime, handoff, 1, working_s)
        deadline = time.monotonic() + 0.5
        while time.monotonic() < deadline:
            d.receive_one(until=time.monotonic() + 0.05)
        assert d.sched.backups.launched == 0, setting
        runtime.workers.resume(1)
        assert got + rest(d, draw) == indices(12)


@pytest.mark.usefixtures("quick_lost_checks")
def test_the_slow_copy_coming_first_counts_and_the_backup_is_wasted():
    d, runtime, handoff, _ = driver(2, live=True, straggler_timeout=0.2)
    workers = runtime.workers
    draw = start(d, 10)
    got = take(d, draw, 2)
    got += blocked(d, runtime, draw, 1)
    workers.pause(0)
    straggling(d, runtime, handoff, 1, working_s=1.0)
    deadline = time.monotonic() + 2
    while d.sched.backups.launched == 0:
        assert time.monotonic() < deadline, "no backup was launched"
        d.receive_one(until=time.monotonic() + 0.05)
    workers.resume(1)  # the slow worker's copy arrives before the backup's
    workers.resume(0)
    assert got + rest(d, draw) == indices(10)
    assert d.sched.backups.stats() == {"launched": 1, "won": 0, "wasted": 1}


def test_the_book_counts_the_first_copy_of_each_backed_up_batch():
    book = Backups()
    book.launched_for(5, worker_id=1)
    book.launched_for(9, worker_id=0)
    assert not book.arrived(5, 0, fresh=True)  # the backup first: won
    assert not book.arrived(5, 1, fresh=False)  # (the slow copy, dropped)
    assert book.arrived(9, 0, fresh=True)  # the slow worker first: the backup was wasted
    assert not book.arrived(7, 1, fresh=True)  # (not backed up)
    assert book.stats() == {"launched": 2, "won": 1, "wasted": 1}


@pytest.mark.parametrize("bad", [0, -1, "fast", True])
def test_a_bad_straggler_timeout_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="straggler_timeout"):
        DpexConfig(straggler_timeout=bad)


# -- on the fake clock (tests/test_hung.py's Cluster): one item in 100 taking 25 s ---------

SLOW_S, USUAL_S, BATCHES = 25.0, 0.05, 1000


def one_in_100(first_attempt_only: bool):
    """Every 100th batch takes 25 s: on its first attempt only (a straggler: a cold
    cache, a node in trouble) or wherever it runs (the item itself is slow)."""
    started: set[int] = set()

    def took(w, inc, seq):
        slow = seq % 100 == 99 and (seq not in started or not first_attempt_only)
        started.add(seq)
        return SLOW_S if slow else USUAL_S
    return took


def epoch(took, setting):
    from test_hung import Cluster
    c = Cluster(2, BATCHES, took, first_batch_timeout=120.0, straggler_timeout=setting)
    got, elapsed = c.run()
    assert got == [[i] for i in range(BATCHES)] and c.fatal is None
    assert c.kills == [] and c.s.counters["replaced_hung"] == 0, (c.kills, c.s.counters)
    return elapsed, c.s.backups.stats()


def test_a_straggler_one_batch_in_100_slow_on_its_first_attempt_costs_what_its_worker_does():
    """The slow attempt is not killed, so it holds its worker for 25 s: the floor on the
    epoch is every attempt's time over the two workers. With backups (the default
    limit) the epoch is within 10 % of that floor; without, each straggler holds it."""
    slow = BATCHES // 100
    floor = ((BATCHES - slow) * USUAL_S + slow * (SLOW_S + USUAL_S)) / 2
    elapsed, backups = epoch(one_in_100(first_attempt_only=True), "auto")
    assert backups == {"launched": slow, "won": slow, "wasted": 0}
    assert elapsed <= 1.10 * floor, (elapsed, floor)
    without, _ = epoch(one_in_100(first_attempt_only=True), None)
    assert without > slow * SLOW_S > 1.5 * elapsed, (without, elapsed)


def test_an_item_slow_wherever_it_runs_its_wasted_backups_cost_under_10_percent():
    """A backup of an item that is slow everywhere is wasted: its worker computes a copy
    nobody needs. The tasks queued behind that copy go to the others and it takes none
    until done, so a wasted backup costs one worker's time on one batch, not the
    batches queued behind it (before: 16 % slower than without backups)."""
    elapsed, backups = epoch(one_in_100(first_attempt_only=False), "auto")
    assert backups == {"launched": BATCHES // 100, "won": 0, "wasted": BATCHES // 100}
    without, _ = epoch(one_in_100(first_attempt_only=False), None)
    assert elapsed <= 1.10 * without, (elapsed, without)


# -- with Ray: the case -----------------------------------------------------------


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(180)
def test_one_worker_blocked_forever_the_epoch_ends_exact_on_a_backup_and_it_is_not_killed():
    dataset = dsets.BlockedFromSecondBatch(20)
    expected = list(dsets.torch_loader(dataset, batch_size=1))
    with DpexDataLoader(dataset, batch_size=1, num_workers=2, distribute_mode=True) as loader:
        it = iter(loader)
        started = time.monotonic()
        got = list(it)
        took = time.monotonic() - started
        stats = it.stats()
    dsets.assert_same(expected, got, "epoch")
    assert took <= 30, took
    assert stats["backups"]["launched"] >= 1 and stats["backups"]["won"] >= 1, stats["backups"]
    assert not stats["recoveries"] and stats["dropped"].get("replaced_hung", 0) == 0, stats
