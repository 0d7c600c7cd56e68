"""Elastic workers and the autoscaler: the rules without Ray (a scripted loop), then
live loaders whose worker set changes mid-epoch and still yield torch's batches."""

import copy
import pickle
import sys
import time

import dsets
import pytest
import torch
from dsets import assert_same

from dpex import Autoscale, DpexDataLoader
from dpex.client._autoscaler import Autoscaler

# -- the type --------------------------------------------------------------------------


@pytest.mark.subprocess  # (torch's twin starts its worker processes)
def test_autoscale_is_an_int_that_survives_copies_pickles_and_rebuilds():
    policy = Autoscale(2, 16, target=0.1, interval=0.5, patience=4)
    assert policy == 2 and isinstance(policy, int) and range(policy) == range(2)
    for twin in (copy.deepcopy(policy), pickle.loads(pickle.dumps(policy))):
        assert type(twin) is Autoscale and repr(twin) == repr(policy)
    loader = DpexDataLoader(dsets.Squares(), num_workers=policy, distribute_mode=True)
    # Lightning re-creates a loader from its attributes: the policy comes along
    rebuilt = DpexDataLoader(loader.dataset, num_workers=loader.num_workers,
                             distribute_mode=loader.distribute_mode)
    assert rebuilt.num_workers.max == 16 and rebuilt.prefetch_factor == 2
    torch_twin = DpexDataLoader(dsets.Squares(), num_workers=policy)  # torch's: min workers
    assert torch_twin._get_iterator()._num_workers == 2


@pytest.mark.parametrize("bad,match", [
    (dict(min=0), "min"), (dict(min=3, max=2), "max"), (dict(target=1.5), "target"),
    (dict(interval=0), "interval"), (dict(patience=0), "patience")])
def test_bad_autoscale_settings_are_refused_by_name(bad, match):
    with pytest.raises(ValueError, match=f"Autoscale\\({match}="):
        Autoscale(**bad)


# -- the rules ---------------------------------------------------------------------------


class Loop:
    """A scripted training loop: each window the loop waits ``stall`` of the time and
    takes batches at ``rate``; workers take ``batch_s`` per batch."""

    def __init__(self, policy, most=None, workers=None):
        self.now, self.waited, self.taken = 100.0, 0.0, 0
        self.workers = workers or policy.min
        self.scaler = Autoscaler(policy, most or policy.max or 8, self.now)
        self.scaler.begin(self.now, 0.0, 0)
        assert self.window(stall=0.9, rate=1, batch_s=1.0) is None  # an epoch's first: filling

    def window(self, stall, rate, batch_s, starting=0, room=None, in_flight=0):
        span = self.scaler.policy.interval
        self.now += span
        self.waited += stall * span
        self.taken += round(rate * span)
        new = self.scaler.tick(self.now, self.waited, self.taken, self.workers, starting,
                               batch_s, room, in_flight=in_flight)
        if new is not None:
            self.workers = new
        return new


def test_a_stalled_loop_goes_straight_to_the_workers_it_needs_then_holds():
    loop = Loop(Autoscale(1, 32))
    # the loop's own step: (1 - 0.5) s / 10 batches = 50 ms; a batch takes 200 ms: 4 needed
    assert loop.window(stall=0.5, rate=10, batch_s=0.2) == 5  # 4 plus 15 %
    assert "4.0 workers keep up" in loop.scaler.decisions[-1]["reason"]
    for _ in range(4):
        assert loop.window(stall=0.5, rate=10, batch_s=0.2, starting=2) is None  # starting
    assert loop.window(stall=0.5, rate=10, batch_s=0.2) is None  # the window they started in
    assert loop.window(stall=0.5, rate=10, batch_s=0.2) is None  # held (2 windows)
    assert loop.window(stall=0.5, rate=10, batch_s=0.2) is None
    assert loop.window(stall=0.5, rate=10, batch_s=0.2) == 1  # the trial: 5 were no better
    loop = Loop(Autoscale(1, 32), workers=2)  # the loop waits, yet 2 are more than enough
    for _ in range(2):
        assert loop.window(stall=0.5, rate=40, batch_s=0.005) is None
    assert loop.window(stall=0.5, rate=40, batch_s=0.005) == 3  # it lasts: one more, tried
    for _ in range(2):
        assert loop.window(stall=0.5, rate=40, batch_s=0.005) is None  # (held)
    assert loop.window(stall=0.5, rate=40, batch_s=0.005) == 2  # no better: back


def test_a_scale_up_is_judged_only_once_its_workers_made_a_batch_and_the_backlog_drained():
    """Slow batches (0.25 s, a 25 ms loop step): 1 -> 12. The added workers' first
    results come late (their sessions load the dataset), then the loop takes the 24
    batches dispatched before the scale-up at the old pace: none of that is the new
    count's rate (it used to be judged there: 1 -> 12 -> 1 -> 11 -> 1)."""
    loop = Loop(Autoscale(1, 12))
    assert loop.window(stall=0.9, rate=4, batch_s=0.25, in_flight=24) == 12
    for _ in range(3):  # HELLO came, the dataset loads: no first result yet
        assert loop.window(stall=1.0, rate=0, batch_s=0.25, starting=11) is None
    for _ in range(6):  # the backlog, at the old pace (and the window it ended in)
        assert loop.window(stall=0.9, rate=4, batch_s=0.25) is None
    for _ in range(5):  # the new pace: kept
        assert loop.window(stall=0.1, rate=36, batch_s=0.25) is None
    assert loop.workers == 12 and len(loop.scaler.decisions) == 1


def test_more_workers_that_do_not_raise_the_rate_are_taken_back_and_capped_a_while():
    loop = Loop(Autoscale(2, 32))
    assert loop.window(stall=0.6, rate=40, batch_s=0.1) == 12  # step 10 ms: 10 needed, +15 %
    for _ in range(2):
        loop.window(stall=0.6, rate=41, batch_s=0.3)  # (held) CPU-bound: batches slower
    assert loop.window(stall=0.6, rate=42, batch_s=0.3) == 2  # rate barely moved: back
    assert "do not help" in loop.scaler.decisions[-1]["reason"]
    for _ in range(5):
        assert loop.window(stall=0.6, rate=40, batch_s=0.1) is None  # capped at 2
    assert loop.scaler.report(2)["ceiling"] == 2
    for _ in range(30):
        loop.window(stall=0.6, rate=40, batch_s=0.1)
    assert loop.scaler.decisions[2]["to"] == 12  # the ceiling is tried again later


def test_a_scale_up_that_helps_in_part_keeps_the_workers_its_gain_is_worth():
    loop = Loop(Autoscale(1, 32))
    assert loop.window(stall=0.75, rate=45, batch_s=0.022) == 5  # needs 3.9
    for _ in range(2):
        loop.window(stall=0.5, rate=80, batch_s=0.04)  # (held)
    assert loop.window(stall=0.5, rate=84, batch_s=0.04) == 2  # 1.9x the rate: 2 workers
    assert loop.scaler.report(2)["ceiling"] == 2
    assert "more workers than 2 do not help" in loop.scaler.decisions[-1]["reason"]


def test_a_kept_scale_up_is_not_taken_back():
    loop = Loop(Autoscale(1, 32))
    loop.window(stall=0.5, rate=10, batch_s=0.2)
    for _ in range(2):
        loop.window(stall=0.5, rate=10, batch_s=0.2)
    loop.window(stall=0.2, rate=40, batch_s=0.2)  # 4x the rate: kept (and still short)
    assert loop.workers >= 5
    assert not any("do not help" in d["reason"] for d in loop.scaler.decisions)


def test_workers_go_only_after_calm_windows_and_not_below_what_is_needed_or_min():
    loop = Loop(Autoscale(2, 32), workers=12)
    # step 90 ms, batch 100 ms: 1.1 needed; +35 % -> 2 (min 2)
    assert loop.window(stall=0.0, rate=10, batch_s=0.1) is None
    assert loop.window(stall=0.04, rate=10, batch_s=0.1) is None  # not calm (>= 2.5 %)
    assert loop.window(stall=0.0, rate=10, batch_s=0.1) is None
    assert loop.window(stall=0.0, rate=10, batch_s=0.1) is None
    assert loop.window(stall=0.0, rate=10, batch_s=0.1) == 2
    loop = Loop(Autoscale(1, 32), workers=3)  # calm because 3 are what it needs
    for _ in range(6):
        assert loop.window(stall=0.0, rate=10, batch_s=0.25) is None


def test_no_more_workers_than_max_or_the_cluster_has_room_for():
    loop = Loop(Autoscale(1, 4))
    assert loop.window(stall=0.9, rate=1, batch_s=1.0) == 4
    loop = Loop(Autoscale(1, 32))
    assert loop.window(stall=0.9, rate=1, batch_s=1.0, room=2) == 3
    loop = Loop(Autoscale(1, 32))
    assert loop.window(stall=0.9, rate=1, batch_s=1.0, room=0) is None


# -- live loaders ------------------------------------------------------------------------

ray_only = pytest.mark.usefixtures("ray_session")


def torch_batches(dataset, **kwargs):
    return list(dsets.torch_loader(dataset, **kwargs))


def take_until_ready(it, workers, got, limit=120.0):
    """Wait (taking nothing: the epoch must not end first on a busy machine) until
    ``workers`` workers are ready."""
    deadline = time.monotonic() + limit
    while len(it._ready) < workers:
        assert time.monotonic() < deadline, f"only {sorted(it._ready)} ready"
        it._driver.receive_one(until=time.monotonic() + 0.2)  # (HELLOs arrive as events)


@ray_only
@pytest.mark.timeout(300)
def test_stats_and_scale_workers_from_another_thread_while_the_loop_runs():
    """A metrics server's thread reads stats() and a control thread changes the worker
    count while the training thread iterates: no error on either side (it used to
    raise "deque mutated during iteration"), the count asked for last is carried out
    by the training thread, and the epoch is exact."""
    import itertools
    import threading

    def kwargs():
        return dict(batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(5))
    want = torch_batches(dsets.Squares(300, max_sleep=0.01), **kwargs())
    # (an autoscaler that measures every 20 ms: its history grows while stats() reads it)
    loader = DpexDataLoader(dsets.Squares(300, max_sleep=0.01), distribute_mode=True,
                            num_workers=Autoscale(1, 3, interval=0.02), **kwargs())
    it = iter(loader)
    got = [next(it)]
    errors, stop, reads = [], threading.Event(), [0]

    def meddle():
        counts = itertools.cycle([2, 3, 1, 2])
        while not stop.is_set():
            try:
                for _ in range(50):
                    loader.stats()
                    reads[0] += 1
                loader.scale_workers(next(counts))
            except Exception as exc:  # noqa: BLE001 (what the test is about)
                errors.append(exc)
                return
    thread = threading.Thread(target=meddle, daemon=True)
    switch = sys.getswitchinterval()
    sys.setswitchinterval(1e-5)  # threads take turns often: races show at once
    thread.start()
    try:
        got += list(it)
    finally:
        stop.set()
        thread.join(30)
        sys.setswitchinterval(switch)
    assert not errors, errors
    assert reads[0] > 100
    assert_same([want], [got])
    loader.scale_workers(2)  # (the epoch ended: for the next iterator)
    loader.close()


@ray_only
@pytest.mark.timeout(300)
def test_workers_added_and_retired_mid_epoch_change_no_batch():
    def kwargs():
        return dict(batch_size=2, shuffle=True, generator=torch.Generator().manual_seed(3))
    want = torch_batches(dsets.Squares(400, max_sleep=0.02), **kwargs())
    loader = DpexDataLoader(dsets.Squares(400, max_sleep=0.02), num_workers=1,
                            distribute_mode=True, **kwargs())
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    loader.scale_workers(3)
    take_until_ready(it, 3, got)
    got += [next(it) for _ in range(10)]
    ready = it.stats()["workers"]
    loader.scale_workers(1)
    got += [next(it) for _ in range(40)]  # (the retired workers' batches taken by now)
    t0 = time.monotonic()
    state = loader.state_dict()  # asks no retired worker (it would never answer)
    asked_s = time.monotonic() - t0
    got += list(it)
    stats = loader.stats()
    loader.close()
    assert_same(want, got)
    assert asked_s < 10 and state["worker_rng_num_workers"] == 0  # ids no longer fit
    assert len(ready) == 3 and all(w["batches"] for w in ready.values())
    assert stats["dropped"]["added"] == 2 and stats["dropped"]["retired"] == 2
    assert [w for w, info in stats["workers"].items() if info["retired"]] == [1, 2]


@ray_only
@pytest.mark.timeout(300)
def test_per_batch_seeding_keeps_an_augmented_epoch_exact_while_workers_come_and_go():
    def make(n):
        return DpexDataLoader(dsets.Augmented(300), batch_size=3, shuffle=True, num_workers=n,
                              generator=torch.Generator().manual_seed(4), distribute_mode=True,
                              worker_seeding="per_batch")
    with make(1) as loader:
        want = list(loader)
    loader = make(2)
    it = iter(loader)
    got = [next(it) for _ in range(4)]
    loader.scale_workers(3)
    take_until_ready(it, 3, got)
    got += [next(it) for _ in range(6)]
    loader.scale_workers(1)
    got += list(it)
    loader.close()
    assert_same(want, got)


@ray_only
@pytest.mark.timeout(300)
def test_the_autoscaler_grows_for_a_fast_loop_and_shrinks_for_a_slow_one():
    policy = Autoscale(1, 6, interval=0.4, patience=2)
    want = torch_batches(dsets.Slow(0.03, n=240), batch_size=1)
    with DpexDataLoader(dsets.Slow(0.03, n=240), batch_size=1, num_workers=policy,
                        distribute_mode=True) as loader:
        got = list(loader)  # a loop that takes no time: needs every worker it can get
        grown = loader.stats()["autoscale"]
    assert_same(want, got)
    assert grown["decisions"][0]["from"] == 1 and grown["workers"] >= 3
    assert grown["history"] and all(h["workers"] <= 6 for h in grown["history"])
    with DpexDataLoader(dsets.Slow(0.01, n=120), batch_size=1, num_workers=policy,
                        distribute_mode=True) as loader:
        loader.scale_workers(4)
        for _ in loader:
            time.sleep(0.05)  # a slow loop: one worker keeps up
        shrunk = loader.stats()["autoscale"]
    assert shrunk["workers"] < 4 and shrunk["decisions"][-1]["to"] < 4
    assert "waited for data" in shrunk["decisions"][-1]["reason"]


@pytest.mark.usefixtures("inprocess")  # (refused before any worker starts)
def test_an_iterable_dataset_cannot_autoscale_and_says_why():
    loader = DpexDataLoader(dsets.ShardedRange(), num_workers=Autoscale(1, 4),
                            distribute_mode=True)
    with pytest.raises(ValueError, match="IterableDataset's worker count is fixed"):
        iter(loader)
    loader.close()


def test_a_fleet_in_policy_mode_follows_the_sessions_up_at_once_and_down_when_idle():
    from dpex.server._fleet import fleet_target

    # (sessions, workers, idle workers, idle rounds, min, max, patience)
    assert fleet_target(6, 2, 0, 0, 1, 8, 3) == 6  # up at once, one worker per session
    assert fleet_target(12, 2, 0, 0, 1, 8, 3) == 8  # not past max
    assert fleet_target(1, 6, 5, 2, 1, 8, 3) == 6  # idle, but not for long enough
    assert fleet_target(1, 6, 5, 3, 2, 8, 3) == 2  # down to min, idle workers only
    assert fleet_target(4, 6, 1, 3, 1, 8, 3) == 5  # only as many as are idle go
    assert fleet_target(0, 1, 1, 9, 1, 8, 3) == 1
