"""What an iterator starts with, decided in one pure function.

A new ``RayDataLoaderIter`` resolves, from its loader's settings and a loaded resume
state, how many workers it starts, which worker takes the epoch's first batch, which
RNG states each worker starts from and how many it keeps, and how batches are
seeded. :func:`plan_launch` makes all of those decisions, with no Ray, sockets or
clock, so each rule is table-tested (tests/test_launch.py); the iterator only carries
the plan out.
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from dpex._autoscale import Autoscale
from dpex._config import prefetch_window
from dpex.client.resume import ResumeState

__all__ = ["LaunchPlan", "plan_launch", "RNG_MARGIN"]

# A worker keeps its RNG states after each batch it computed for state_dict(), as many
# as the credit window holds and this margin more (batches it holds beyond its share
# while another worker starts or is replaced).
RNG_MARGIN = 2


@dataclass(frozen=True)
class LaunchPlan:
    """An iterator's start (see :func:`plan_launch`)."""

    num_workers: int
    autoscale: Autoscale | None  # num_workers=dpex.Autoscale(...): the policy
    first_worker: int  # the worker that takes the epoch's first task (a resumed one's)
    shards: dict | None  # an IterableDataset's saved shard positions (resuming mid-epoch)
    epochs_before: int  # epochs the resumed base seed served before (persistent workers)
    # worker_seeding="per_batch": (epochs before, batches before) the first seeded batch
    batch_seeds: tuple[int, int] | None
    rng_keep: int  # RNG states a worker keeps for state_dict() (0: none asked for)
    worker_rng: dict[int, Any] = field(default_factory=dict)  # resumed states by worker
    # worker_seeding="per_sample": what each sample's seed is made from (None: off)
    sample_seed: int | None = None

    @property
    def per_batch(self) -> bool:
        return self.batch_seeds is not None

    def rng_state(self, worker_id: int) -> Any:
        """The RNG states worker ``worker_id`` starts from (None: seeded afresh)."""
        return self.worker_rng.get(worker_id)


def plan_launch(*, num_workers: int, scaled_to: int | None, prefetch_factor: int,
                iterable: bool, worker_seeding: str, resume: ResumeState | None,
                base_seed: int = 0, sampler_seed: int | None = None) -> LaunchPlan:
    """Decide an iterator's start.

    ``num_workers``: the loader's (an int, or a :class:`~dpex.Autoscale` policy);
    ``scaled_to``: the count ``scale_workers()`` or the autoscaler left with the loader
    (None if neither); ``resume``: a loaded state not yet taken by an iterator.

    - Workers: a policy starts where the loader's last iterator ended, within
      ``[min, max]`` (at ``min`` the first time); a fixed count is the loader's, or the
      last ``scale_workers()`` count (map-style datasets only: an IterableDataset's
      shards are per worker). A policy over an IterableDataset is refused.
    - Resuming mid-epoch: the worker of the epoch's first batch is the one that had
      it in the saved run (by batch number, or an IterableDataset's next shard); the
      workers' RNG states apply only with the saved run's worker count.
    - ``worker_seeding="per_batch"``: each batch is seeded from its number, so a
      map-style dataset's workers keep and restore no RNG states.
    - ``worker_seeding="per_sample"``: each sample is seeded from its position, made
      from ``sampler_seed`` (a DistributedSampler's ``seed``: the same on every rank)
      or else the iterator's ``base_seed``; no RNG states are kept either.
    """
    policy = num_workers if isinstance(num_workers, Autoscale) else None
    if policy is not None:
        if iterable:
            raise ValueError(
                f"num_workers={policy!r} needs a map-style dataset: an IterableDataset's "
                "worker count is fixed, since each worker iterates its own shard; give "
                "it a number of workers")
        last = scaled_to or policy.min
        count = max(policy.min, min(last, policy.max or last))
    elif scaled_to and not iterable:
        count = scaled_to
    else:
        count = int(num_workers)
    mid_epoch = resume is not None and resume.mid_epoch
    first_worker = resume.yielded % count if mid_epoch else 0
    shards = resume.iterable if mid_epoch else None
    if shards is not None:
        first_worker = shards["next_worker"]
    per_batch = worker_seeding == "per_batch"
    per_sample = worker_seeding == "per_sample"
    epochs_before = resume.epochs_before if resume is not None else 0
    keep_rng = not ((per_batch or per_sample) and not iterable)
    worker_rng = (resume.worker_rng if keep_rng and resume is not None
                  and resume.worker_rng_fits(count) else {})
    return LaunchPlan(
        num_workers=count, autoscale=policy, first_worker=first_worker, shards=shards,
        epochs_before=epochs_before,
        batch_seeds=(epochs_before, resume.yielded if mid_epoch else 0) if per_batch else None,
        rng_keep=prefetch_window(prefetch_factor, count) + RNG_MARGIN if keep_rng else 0,
        worker_rng=dict(worker_rng or {}),
        sample_seed=(sampler_seed if sampler_seed is not None else base_seed)
        if per_sample else None)
