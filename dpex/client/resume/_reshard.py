"""One epoch of torch's ``DistributedSampler`` as the ranks share it, and the rest of
it on another number of ranks (pure: tensors in, tensors out).

``DistributedSampler`` orders an epoch by ``seed + epoch`` (or not at all), pads the
order to a multiple of the rank count (or cuts it, ``drop_last``) and deals it:
rank r of R takes entries ``r, r + R, r + 2R, ...``. Each rank's loader batches its
part by ``batch_size``, so the g-th batches of all R ranks together are the stretch
``[g·B·R, (g+1)·B·R)`` of the dealt order, and after g batches per rank the job has
taken exactly its first ``g·B·R`` entries, whichever rank's state says so.

A :class:`Layout` is a stretch ``[start, end)`` of the epoch's order dealt that way.
A fresh epoch is ``[0, len(dataset))``. Resumed on R' ranks, the rest of the epoch
is the stretch after what was taken, up to where the saved layout would have ended,
dealt to R' ranks by the same rules (padded from its own start): each sample no rank
took comes once, in the uninterrupted run's global order.

Each entry has a position in the epoch (``start`` + its place in the dealt stretch);
``worker_seeding="per_sample"`` seeds a sample from it, so a sample gets the same
random draws whichever rank, worker or batch takes it.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Iterator

import torch

__all__ = ["Layout", "epoch_order"]


def epoch_order(length: int, shuffle: bool, seed: int, epoch: int) -> torch.Tensor:
    """The epoch's order before padding, as ``DistributedSampler.__iter__`` makes it
    (tests/test_reshard.py holds the two together)."""
    if not shuffle:
        return torch.arange(length)
    generator = torch.Generator()
    generator.manual_seed(seed + epoch)
    return torch.randperm(length, generator=generator)


@dataclasses.dataclass(frozen=True)
class Layout:
    """The stretch ``[start, end)`` of an epoch's order, dealt to ``num_replicas`` ranks
    as ``DistributedSampler`` deals (``sampler_drop_last``: cut instead of padded), each
    rank's part batched by ``batch_size`` (``loader_drop_last``: the last short batch
    dropped)."""

    start: int
    end: int
    num_replicas: int
    batch_size: int
    sampler_drop_last: bool = False
    loader_drop_last: bool = False

    @property
    def length(self) -> int:
        return self.end - self.start

    @property
    def per_rank(self) -> int:
        """Entries each rank takes (``DistributedSampler.num_samples``)."""
        n, ranks = self.length, self.num_replicas
        if self.sampler_drop_last and n % ranks:
            return math.ceil((n - ranks) / ranks)
        return math.ceil(n / ranks)

    @property
    def batches(self) -> int:
        """Batches per rank."""
        if self.loader_drop_last:
            return self.per_rank // self.batch_size
        return math.ceil(self.per_rank / self.batch_size)

    def taken(self, batches: int) -> int:
        """Where the epoch's order stands after ``batches`` batches per rank: every
        entry before it was taken by some rank (padding repeats nothing new)."""
        per_rank = min(batches * self.batch_size, self.per_rank)
        if self.loader_drop_last:
            per_rank = min(per_rank, self.batches * self.batch_size)
        return self.start + min(per_rank * self.num_replicas, self.length)

    def rest(self, batches: int, num_replicas: int, batch_size: int) -> Layout:
        """What is left after ``batches`` batches per rank, on ``num_replicas`` ranks
        with ``batch_size`` (the drop_last settings stay): up to where this layout
        would have ended."""
        return Layout(self.taken(batches), self.taken(self.batches), num_replicas,
                      batch_size, self.sampler_drop_last, self.loader_drop_last)

    def rank_part(self, order: torch.Tensor, rank: int) -> torch.Tensor:
        """Rank ``rank``'s entries, in the order it takes them."""
        stream = order[self.start:self.end]
        total = self.per_rank * self.num_replicas
        if self.sampler_drop_last:
            stream = stream[:total]
        elif total > len(stream) > 0:
            repeats = math.ceil((total - len(stream)) / len(stream)) + 1
            stream = stream.repeat(repeats)[:total]
        return stream[rank:total:self.num_replicas]

    def rank_batches(self, order: torch.Tensor, rank: int) -> Iterator[list[int]]:
        """Rank ``rank``'s index batches, lazily (an epoch of millions costs a slice)."""
        part = self.rank_part(order, rank)
        for first in range(0, self.batches * self.batch_size, self.batch_size):
            yield part[first:first + self.batch_size].tolist()

    def position(self, rank: int, taken: int) -> int:
        """The epoch position of rank ``rank``'s entry number ``taken`` (from 0); the
        next ones of its batch follow every ``num_replicas``."""
        return self.start + taken * self.num_replicas + rank

    def to_state(self) -> dict:
        return dataclasses.asdict(self)

    @classmethod
    def from_state(cls, state: dict) -> Layout:
        return cls(**state)
