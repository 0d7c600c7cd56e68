"""Mid-epoch resume with dpex's workers: a resumed run yields exactly torch's
uninterrupted batches, worker seeds and worker RNG draws included.

dpex's workers run in this process (tests/inprocess.py: the real task runner, its RNG
records and RNG queries) unless a test is marked ``ray``: a real case of each kind
runs on the shared Ray instance (and what only processes show: a worker killed, a
state over the wire's size limit). torch's loader with its worker processes runs
beside most (``subprocess``: the e2e tier)."""

import os
import signal
import time

import dsets
import pytest
import torch
from dsets import assert_same, json_trip, round_trip

from dpex import DpexDataLoader, ResumeStateError, UnsupportedError

pytestmark = [pytest.mark.timeout(300), pytest.mark.usefixtures("dpex_workers"),
              pytest.mark.subprocess]  # (torch's workers beside)
ON_RAY = pytest.mark.ray


def rest_of_epoch(loader, state):
    """What ``loader`` yields after loading ``state``: the rest of that epoch (closed
    after)."""
    loader.load_state_dict(state)
    try:
        return list(loader)
    finally:
        loader.close()


def probe_loader(cls, num_workers, persistent, **kwargs):
    """SeedProbe: each sample carries its worker's id, seed and torch / random / NumPy
    draws, so a batch is equal only if the worker's RNG stood where torch's did."""
    return cls(dsets.SeedProbe(), batch_size=3, shuffle=True, num_workers=num_workers,
               persistent_workers=persistent, generator=torch.Generator().manual_seed(5),
               **kwargs)


def dpex_probe(num_workers, persistent):
    return probe_loader(DpexDataLoader, num_workers, persistent, distribute_mode=True)


def interrupted(make, epochs, cut_epoch, cut, make_resumed=None, trip=round_trip):
    """``epochs`` epochs; in ``cut_epoch`` stop after ``cut`` batches, save (through
    ``trip``), close, and go on with a new loader (``make_resumed``, else ``make``) that
    loads the state."""
    loader, out, timings = make(), [], {}
    for e in range(epochs):
        if e != cut_epoch:
            out.append(list(loader))
            continue
        it = iter(loader)
        part = [next(it) for _ in range(cut)]
        t0 = time.monotonic()
        state = trip(loader.state_dict())
        timings["state_dict_s"] = time.monotonic() - t0
        del it
        loader.close()
        loader = (make_resumed or make)()
        t0 = time.monotonic()
        loader.load_state_dict(state)
        it = iter(loader)
        part.append(next(it))
        timings["load_and_first_batch_s"] = time.monotonic() - t0
        out.append(part + list(it))
    loader.close()
    return out, timings


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@pytest.mark.parametrize("cut_epoch,cut", [(0, 3), pytest.param(1, 5, marks=ON_RAY)])
def test_a_resumed_run_is_torchs_uninterrupted_run_rng_draws_included(persistent, cut_epoch,
                                                                      cut):
    ref = probe_loader(dsets.torch_loader, 2, persistent)
    want = [list(ref) for _ in range(3)]
    got, _ = interrupted(lambda: dpex_probe(2, persistent), 3, cut_epoch, cut)
    assert_same(want, got, "epochs")


@pytest.mark.parametrize("dataset", ["map", pytest.param("iterable", marks=ON_RAY)])
def test_a_mid_epoch_state_through_json_resumes_exactly_rng_draws_included(dataset):
    """torchdata's TestJsonSerDe, with workers: ``json.dumps`` the state mid-epoch and
    resume from ``json.loads`` of it (worker ids come back as strings)."""
    if dataset == "map":
        ref, make = probe_loader(dsets.torch_loader, 2, False), lambda: dpex_probe(2, False)
    else:
        ref = shards_loader(dsets.torch_loader, dsets.PositionedShards(), False)

        def make():
            return shards_loader(DpexDataLoader, dsets.PositionedShards(), False,
                                 distribute_mode=True)
    got, _ = interrupted(make, 1, 0, 3, trip=json_trip)
    assert_same([list(ref)], got, "epochs")


def test_a_state_between_epochs_of_persistent_workers_keeps_their_rng_going():
    ref = probe_loader(dsets.torch_loader, 2, True)
    want = [list(ref) for _ in range(2)]
    loader = dpex_probe(2, True)
    first = list(loader)
    state = round_trip(loader.state_dict())
    loader.close()
    assert not state["mid_epoch"] and set(state["worker_rng"]) == {0, 1}
    second = rest_of_epoch(dpex_probe(2, True), state)
    assert_same(want, [first, second], "epochs")


def test_with_another_worker_count_the_index_batches_and_seeds_are_torchs():
    ref = probe_loader(dsets.torch_loader, 2, False)
    want = [list(ref) for _ in range(2)]
    got, _ = interrupted(lambda: dpex_probe(2, False), 2, 0, 4,
                         make_resumed=lambda: dpex_probe(3, False))
    for e, (w_epoch, g_epoch) in enumerate(zip(want, got, strict=True)):
        assert [b["i"].tolist() for b in g_epoch] == [b["i"].tolist() for b in w_epoch], e
    # The epoch after the resumed one is a new iterator of the 3-worker loader: its
    # seeds are torch's for 3 workers from the same base seed.
    base = want[1][0]["seed"][0].item() - want[1][0]["worker"][0].item()
    assert all((b["seed"] - b["worker"] == base).all() for b in got[1])


def test_prefetched_batches_not_yet_taken_are_computed_again_not_lost():
    ref = probe_loader(dsets.torch_loader, 2, False)
    want = list(ref)
    loader = dpex_probe(2, False)
    it = iter(loader)
    part = [next(it) for _ in range(2)]
    # The epoch's first 4 tasks (the credit window) went out at once: batches 2 and 3
    # arrive without being taken (later tasks go out as the loop needs them). The
    # training thread reads what arrived only while it waits for a batch (one hop):
    # wait here as it would, or whether they were read is a race with the workers.
    deadline = time.monotonic() + 30
    while loader.stats()["received"] < 4 and time.monotonic() < deadline:
        it._driver.receive_one(until=time.monotonic() + 0.05)
    assert loader.stats()["received"] >= 4
    state = round_trip(loader.state_dict())
    assert state["yielded"] == 2
    del it
    loader.close()
    assert_same(want, part + rest_of_epoch(dpex_probe(2, False), state), "epoch")


def shards_loader(cls, dataset, persistent, num_workers=2, **kwargs):
    return cls(dataset, batch_size=3, num_workers=num_workers, persistent_workers=persistent,
               generator=torch.Generator().manual_seed(3), **kwargs)


@pytest.mark.parametrize("dataset", ["NoisyShards", "PositionedShards"])
@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@pytest.mark.parametrize("cut_epoch,cut", [(0, 2), pytest.param(1, 9, marks=ON_RAY)])
def test_an_iterable_dataset_resumes_mid_epoch_exactly(dataset, persistent, cut_epoch, cut):
    # Worker 1's shard (18 items, 6 batches) ends before worker 0's (24 items, 8 batches):
    # batch 9 of epoch 2 comes after worker 1's END was taken.
    make = getattr(dsets, dataset)
    ref = shards_loader(dsets.torch_loader, make(), persistent)
    want = [list(ref) for _ in range(2)]
    got, _ = interrupted(lambda: shards_loader(DpexDataLoader, make(), persistent,
                                               distribute_mode=True), 2, cut_epoch, cut)
    assert_same(want, got, "epochs")


def test_a_stateful_iterable_datasets_own_state_travels_in_the_checkpoint():
    loader = shards_loader(DpexDataLoader, dsets.PositionedShards(), False, distribute_mode=True)
    it = iter(loader)
    for _ in range(5):
        next(it)
    state = round_trip(loader.state_dict())
    loader.close()
    shards = state["iterable"]
    assert shards["stateful"] and sum(w["taken"] for w in shards["workers"].values()) == 5
    # Each worker's dataset position: the items of the batches it delivered that were
    # taken (3 per batch), not those it had prefetched.
    assert {w: s["dataset"]["pos"] for w, s in state["worker_rng"].items()} == {
        w: 3 * shards["workers"][w]["taken"] for w in (0, 1)}


@ON_RAY  # (the size limit is the wire's)
def test_a_worker_state_over_max_message_bytes_is_refused_by_size_not_waited_for():
    """A dataset state larger than the control socket takes was cut by libzmq unseen,
    and state_dict() timed out after 30 s naming nothing."""
    loader = shards_loader(DpexDataLoader, dsets.BulkyPositionedShards(300_000), False,
                           distribute_mode=True, max_message_bytes=200_000)
    it = iter(loader)
    for _ in range(3):
        next(it)
    t0 = time.monotonic()
    with pytest.raises(ResumeStateError, match=r"is 3\d\d,\d{3} bytes, over "
                                               r"max_message_bytes=200,000"):
        loader.state_dict()
    assert time.monotonic() - t0 < 15
    del it
    loader.close()


def test_an_iterable_state_refuses_another_worker_count_by_name():
    loader = shards_loader(DpexDataLoader, dsets.NoisyShards(), False, distribute_mode=True)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    loader.close()
    other = shards_loader(DpexDataLoader, dsets.NoisyShards(), False, num_workers=3,
                          distribute_mode=True)
    with pytest.raises(ResumeStateError, match="num_workers=2"):
        other.load_state_dict(state)


def test_a_worker_whose_shard_ended_before_the_state_gets_no_task_after_it():
    # Worker 0 has 10 batches, worker 1 has 6: after 14 batches worker 1's END was taken.
    def make(cls, **kwargs):
        return shards_loader(cls, dsets.NoisyShards(37, 10), False, **kwargs)

    want = list(make(dsets.torch_loader))
    loader = make(DpexDataLoader, distribute_mode=True)
    it = iter(loader)
    got = [next(it) for _ in range(14)]
    state = round_trip(loader.state_dict())
    loader.close()
    assert state["iterable"]["workers"][1] == {"taken": 6, "ended": True}
    resumed = make(DpexDataLoader, distribute_mode=True)
    resumed.load_state_dict(state)
    got += list(resumed)
    # Worker 1 is not asked to pass over its whole shard again to find its end.
    assert resumed.stats()["workers"][1]["batches"] == 0
    resumed.close()
    assert_same(want, got, "epoch")


@ON_RAY  # (a worker process killed)
def test_a_state_taken_as_a_worker_dies_comes_at_once_and_resumes_the_batches_exactly():
    ref = probe_loader(dsets.torch_loader, 2, False)
    want = [b["i"].tolist() for b in ref]
    loader = dpex_probe(2, False)
    it = iter(loader)
    got = [next(it)["i"].tolist() for _ in range(3)]
    victim = next(info.get("session_pid", info["pid"])
                  for w, info in it._ready.items() if w == 1)
    os.kill(victim, signal.SIGKILL)
    t0 = time.monotonic()
    state = round_trip(loader.state_dict())  # worker 1 never answers: it is replaced
    assert time.monotonic() - t0 < 15  # not the 30 s the query may wait for a live worker
    assert state["worker_rng"][1] is None and state["worker_rng"][0] is not None
    del it
    loader.close()
    got += [b["i"].tolist() for b in rest_of_epoch(dpex_probe(2, False), state)]
    assert got == want


def test_a_stateful_iterable_datasets_next_epoch_after_a_state_between_epochs_is_whole():
    ref = shards_loader(dsets.torch_loader, dsets.PositionedShards(), True)
    want = [list(ref) for _ in range(2)]
    loader = shards_loader(DpexDataLoader, dsets.PositionedShards(), True, distribute_mode=True)
    first = list(loader)
    state = round_trip(loader.state_dict())
    loader.close()
    resumed = shards_loader(DpexDataLoader, dsets.PositionedShards(), True,
                            distribute_mode=True)
    second = rest_of_epoch(resumed, state)
    assert_same(want, [first, second], "epochs")


def test_a_stateful_iterable_state_without_its_workers_states_resumes_by_passing_over():
    # Another rank's state (Lightning saves rank 0's): the workers' own states are not
    # used, so each worker passes over the batches it delivered instead.
    ref = shards_loader(dsets.torch_loader, dsets.PositionedShards(), False)
    want = list(ref)
    loader = shards_loader(DpexDataLoader, dsets.PositionedShards(), False, distribute_mode=True)
    it = iter(loader)
    got = [next(it) for _ in range(5)]
    state = {**round_trip(loader.state_dict()), "rank": 1}
    del it
    loader.close()
    resumed = shards_loader(DpexDataLoader, dsets.PositionedShards(), False,
                            distribute_mode=True)
    got += rest_of_epoch(resumed, state)
    assert_same(want, got, "epoch")


def test_a_second_checkpoint_after_a_resume_keeps_every_workers_rng_states():
    ref = probe_loader(dsets.torch_loader, 2, False)
    want = list(ref)
    loader = dpex_probe(2, False)
    it = iter(loader)
    got = [next(it) for _ in range(5)]  # batch 4 by worker 0: worker 1's last is batch 3
    state = round_trip(loader.state_dict())
    del it
    loader.close()
    for _ in range(2):  # resumed, one batch (worker 1's), saved again: worker 0 took none
        loader = dpex_probe(2, False)
        loader.load_state_dict(state)
        it = iter(loader)
        got.append(next(it))
        state = round_trip(loader.state_dict())
        del it
        loader.close()
    got += rest_of_epoch(dpex_probe(2, False), state)
    assert_same(want, got, "epoch")


def test_a_state_after_the_loop_was_left_says_where_it_stood():
    ref = probe_loader(dsets.torch_loader, 2, False)
    want = [b["i"].tolist() for b in ref]
    loader = dpex_probe(2, False)
    got = []
    for batch in loader:  # the usual way out when a job is told to stop
        got.append(batch["i"].tolist())
        if len(got) == 4:
            break
    state = round_trip(loader.state_dict())
    assert state["mid_epoch"] and state["yielded"] == 4
    loader.close()
    got += [b["i"].tolist() for b in rest_of_epoch(dpex_probe(2, False), state)]
    assert got == want


def test_a_mid_epoch_state_with_in_order_false_is_refused_by_name():
    loader = probe_loader(DpexDataLoader, 2, False, distribute_mode=True, in_order=False)
    it = iter(loader)
    next(it)
    with pytest.raises(UnsupportedError, match="in_order=False"):
        loader.state_dict()
    del it
    loader.close()


def test_a_stateful_samplers_position_survives_a_window_wider_than_the_loaders_own():
    """The loader kept a stateful sampler's states for the window of its own
    ``num_workers``; scale_workers() (or the autoscaler) widens dpex's window, and a
    state_dict() then lost the sampler's position (None): the resumed epoch replayed a
    fresh sampler, epoch 0's order in epoch 1. The states now go as their batches are
    yielded (issue 26: one window rule)."""
    from test_resume import StatefulShuffle
    from torch.utils.data import DataLoader

    n = 48

    def make(cls, **kwargs):
        return cls(dsets.Squares(n, max_sleep=0), batch_size=1, sampler=StatefulShuffle(n, 7),
                   **kwargs)

    def dpex_loader():
        return make(DpexDataLoader, num_workers=1, prefetch_factor=4, persistent_workers=True,
                    distribute_mode=True)

    ref = make(DataLoader)
    want = [[b[1].tolist() for b in ref] for _ in range(2)][1]
    loader = dpex_loader()
    loader.scale_workers(3)  # a window of 12 batches; the loader's own: 4
    list(loader)
    it = iter(loader)
    part = [next(it)[1].tolist() for _ in range(20)]
    state = round_trip(loader.state_dict())
    assert state["sampler_state"] == {"epoch": 1, "pos": 20}
    del it
    loader.close()
    assert part + [b[1].tolist() for b in rest_of_epoch(dpex_loader(), state)] == want


def test_per_sample_seeding_gives_each_sample_its_draws_on_any_worker_and_rank_count():
    """worker_seeding="per_sample": a sample's random draws depend on its position in
    the epoch only, so 1 or 3 workers, 2 ranks or 3 resumed from them, draw the same."""
    from torch.utils.data import DistributedSampler

    dataset = dsets.SeedProbe()

    def rank_loader(ranks, rank, workers):
        sampler = DistributedSampler(dataset, num_replicas=ranks, rank=rank, seed=4)
        return DpexDataLoader(dataset, batch_size=3, sampler=sampler, num_workers=workers,
                              distribute_mode=True, worker_seeding="per_sample")

    def by_sample(batches):
        """Each sample's draws (torch, random, NumPy), by index."""
        out = {}
        for batch in batches:
            for i, *draws in zip(batch["i"].tolist(), batch["torch"][:, 0].tolist(),
                                 batch["random"].tolist(), batch["numpy"].tolist(),
                                 strict=True):
                out.setdefault(i, draws)
        return out

    one = by_sample(batch for r in range(2) for batch in rank_loader(2, r, 1))
    three = by_sample(batch for r in range(2) for batch in rank_loader(2, r, 3))
    assert one == three and len(one) == len(dataset)
    # 2 ranks take 2 steps; 3 ranks resume from rank 1's state
    loaders = [rank_loader(2, r, 2) for r in range(2)]
    taken = []
    for loader in loaders:
        it = iter(loader)
        taken += [next(it) for _ in range(2)]
    state = round_trip(loaders[1].state_dict())
    for loader in loaders:
        loader.close()
    resumed = []
    for r in range(3):
        resumed += rest_of_epoch(rank_loader(3, r, 2), state)
    before, after = by_sample(taken), by_sample(resumed)
    assert not set(before) & set(after) and {**before, **after} == one
