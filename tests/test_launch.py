"""The launch plan (dpex/client/_launch.py): what an iterator starts with, table-tested
without Ray. The live behaviour of each rule is in test_autoscale.py, test_resume_ray.py
and test_worker_seeding.py; these pin the decisions themselves."""

import pytest
import torch

import dpex
from dpex.client._launch import RNG_MARGIN, plan_launch
from dpex.client.resume import ResumeState

RNG = torch.zeros(1)


def resume(skip=5, mid_epoch=True, worker_rng=None, rng_workers=0, iterable=None,
           epochs_before=0):
    return ResumeState(rng_source="generator", base_rng_source="generator", num_workers=2,
                       rank=0, world_size=1, identity=None, length=None, sampler_epoch=None,
                       yielded=skip, sampler_rng=RNG, iterator_rng=RNG, mid_epoch=mid_epoch,
                       worker_rng=worker_rng, worker_rng_num_workers=rng_workers,
                       iterable=iterable, epochs_before=epochs_before)


def plan(num_workers=2, scaled_to=None, prefetch_factor=2, iterable=False,
         worker_seeding="per_worker", resume=None):
    return plan_launch(num_workers=num_workers, scaled_to=scaled_to,
                       prefetch_factor=prefetch_factor, iterable=iterable,
                       worker_seeding=worker_seeding, resume=resume)


@pytest.mark.parametrize("num_workers,scaled_to,iterable,want", [
    (3, None, False, 3),  # the loader's count
    (3, 5, False, 5),  # scale_workers(5) left with the loader
    (3, 5, True, 3),  # ... but an IterableDataset's count is fixed
    (dpex.Autoscale(2, 6), None, False, 2),  # a policy starts at min
    (dpex.Autoscale(2, 6), 4, False, 4),  # ... or where its last iterator ended
    (dpex.Autoscale(2, 6), 9, False, 6),  # ... within max
    (dpex.Autoscale(2, 6), 1, False, 2),  # ... and min
    (dpex.Autoscale(2), 40, False, 40),  # no max: as the last one ended
])
def test_the_worker_count(num_workers, scaled_to, iterable, want):
    got = plan(num_workers, scaled_to, iterable=iterable)
    assert got.num_workers == want
    assert (got.autoscale is not None) == isinstance(num_workers, dpex.Autoscale)


def test_a_policy_over_an_iterable_dataset_is_refused_by_name():
    with pytest.raises(ValueError, match="needs a map-style dataset"):
        plan(dpex.Autoscale(1, 3), iterable=True)


@pytest.mark.parametrize("state,num_workers,first", [
    (None, 3, 0),
    (resume(skip=7), 3, 1),  # batch 7 of the epoch: worker 7 % 3
    (resume(skip=7, mid_epoch=False), 3, 0),  # between epochs: no position
    (resume(skip=7, iterable={"next_worker": 2}), 4, 2),  # the next shard's worker
])
def test_the_worker_of_the_first_batch(state, num_workers, first):
    assert plan(num_workers, resume=state).first_worker == first


def test_the_workers_rng_states_apply_only_with_the_saved_worker_count():
    states = {0: {"torch": 1}, 1: None}
    same = plan(2, resume=resume(worker_rng=states, rng_workers=2))
    assert same.rng_state(0) == {"torch": 1} and same.rng_state(1) is None
    assert plan(3, resume=resume(worker_rng=states, rng_workers=2)).worker_rng == {}


@pytest.mark.parametrize("iterable,seeding,keep", [
    (False, "per_worker", 2 * 3 + RNG_MARGIN),  # prefetch_factor x workers, and a margin
    (True, "per_worker", 2 * 3 + RNG_MARGIN),
    (False, "per_batch", 0),  # each batch seeded from its number: nothing to keep
    (True, "per_batch", 2 * 3 + RNG_MARGIN),  # a shard's RNG runs on across batches
])
def test_which_rng_states_workers_keep(iterable, seeding, keep):
    got = plan(3, iterable=iterable, worker_seeding=seeding,
               resume=resume(worker_rng={0: {"torch": 1}}, rng_workers=3))
    assert got.rng_keep == keep
    assert (got.rng_state(0) is not None) == (keep > 0)


@pytest.mark.parametrize("state,seeds", [
    (None, (0, 0)),
    (resume(skip=5, epochs_before=2), (2, 5)),  # resumed mid-epoch: batch 5 of epoch 2
    (resume(skip=5, mid_epoch=False, epochs_before=3), (3, 0)),  # at an epoch boundary
])
def test_per_batch_seeds_start_where_the_saved_run_stood(state, seeds):
    got = plan(2, worker_seeding="per_batch", resume=state)
    assert got.per_batch and got.batch_seeds == seeds
    assert plan(2, resume=state).batch_seeds is None
