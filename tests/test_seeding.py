"""worker_seeding="per_batch": a batch's random draws depend only on which batch it is,
so an epoch is the same with any number of workers, after a worker's death and after
a resume with another worker count."""

import os
import signal

import dsets
import pytest
import torch
from dsets import assert_same, round_trip

from dpex import DpexDataLoader
from dpex.server._rng import batch_seed, seed_batch

pytestmark = pytest.mark.timeout(300)
ray_only = pytest.mark.usefixtures("ray_session")
# dpex's workers in this process (tests/inprocess.py) but for the case marked `ray`
either = pytest.mark.usefixtures("dpex_workers")
ON_RAY = pytest.mark.ray


def augmented(num_workers, seeding="per_batch", persistent=False, **kwargs):
    return DpexDataLoader(dsets.Augmented(), batch_size=4, shuffle=True,
                          num_workers=num_workers, persistent_workers=persistent,
                          generator=torch.Generator().manual_seed(11), distribute_mode=True,
                          worker_seeding=seeding, **kwargs)


def epochs(loader, n):
    try:
        return [list(loader) for _ in range(n)]
    finally:
        loader.close()


def test_a_batch_seed_depends_on_the_batch_only():
    seeds = {batch_seed(7, e, p) for e in (1, 2) for p in range(50)}
    assert len(seeds) == 100  # every batch its own
    assert batch_seed(7, 1, 3) == batch_seed(7, 1, 3) != batch_seed(8, 1, 3)
    seed_batch(batch_seed(7, 1, 3))
    a = torch.rand(3)
    seed_batch(batch_seed(7, 1, 3))
    assert torch.equal(a, torch.rand(3))


@pytest.mark.parametrize("bad", [dict(distribute_mode=False, num_workers=2),
                                 dict(distribute_mode=True, num_workers=0)])
def test_per_batch_seeding_outside_dpexs_workers_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="worker_seeding='per_batch' seeds dpex's workers"):
        DpexDataLoader(dsets.Augmented(), worker_seeding="per_batch", **bad)
    with pytest.raises(ValueError, match="worker_seeding must be one of"):
        DpexDataLoader(dsets.Augmented(), distribute_mode=True, num_workers=1,
                       worker_seeding="per_worker")


@either
@pytest.mark.parametrize("persistent", [False, pytest.param(True, marks=ON_RAY)],
                         ids=["fresh", "persistent"])
def test_the_same_augmented_epochs_with_1_2_and_3_workers(persistent):
    runs = {n: epochs(augmented(n, persistent=persistent), 2) for n in (1, 2, 3)}
    for n in (2, 3):
        assert_same(runs[1], runs[n], f"{n} workers")
    first, second = runs[1]
    assert [b["i"].tolist() for b in first] != [b["i"].tolist() for b in second]
    # the draws differ from batch to batch and epoch to epoch: seeded per batch, not fixed
    crops = [b["crop"].tolist() for b in first + second]
    assert len({repr(c) for c in crops}) == len(crops)
    # torch's per-worker seeding gives another epoch with another worker count
    torch_runs = [epochs(augmented(n, seeding="torch"), 1)[0] for n in (1, 2)]
    assert [b["crop"].tolist() for b in torch_runs[0]] != [
        b["crop"].tolist() for b in torch_runs[1]]


@ray_only
def test_an_epoch_with_a_worker_killed_mid_way_is_the_same():
    want = epochs(augmented(2), 1)[0]
    loader = augmented(2, max_worker_restarts=2)
    it = iter(loader)
    got = [next(it) for _ in range(3)]
    victim = next(info.get("session_pid", info["pid"])
                  for w, info in it._ready.items() if w == 0)
    os.kill(victim, signal.SIGKILL)
    got += list(it)
    assert it.stats()["dropped"].get("restarted", 0) == 1
    loader.close()
    assert_same(want, got)


@either
@pytest.mark.parametrize("persistent,cut_epoch", [(False, 0), pytest.param(True, 1, marks=ON_RAY)],
                         ids=["fresh-epoch1", "persistent-epoch2"])
def test_a_resume_with_another_worker_count_goes_on_exactly(persistent, cut_epoch):
    want = epochs(augmented(2, persistent=persistent), 3)
    loader = augmented(2, persistent=persistent)
    got = [list(loader) for _ in range(cut_epoch)]
    it = iter(loader)
    part = [next(it) for _ in range(4)]
    state = round_trip(loader.state_dict())
    assert state["worker_rng"] in (None, {})  # nothing per worker to keep
    del it
    loader.close()
    resumed = augmented(3, persistent=persistent)
    resumed.load_state_dict(state)
    got.append(part + list(resumed))
    got += epochs(resumed, 3 - len(got))
    assert_same(want, got, "epoch")
