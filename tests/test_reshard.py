"""Resuming a DistributedSampler's epoch on another number of ranks: the layout rules
against torch's own DistributedSampler and DataLoader batching (no Ray, no processes)."""

import itertools

import pytest
import torch
from torch.utils.data import BatchSampler
from torch.utils.data.distributed import DistributedSampler

from dpex.client.resume._reshard import Layout, epoch_order


def torch_rank_batches(n, ranks, rank, batch_size, shuffle=True, seed=7, epoch=2,
                       sampler_drop_last=False, loader_drop_last=False):
    sampler = DistributedSampler(range(n), num_replicas=ranks, rank=rank, shuffle=shuffle,
                                 seed=seed, drop_last=sampler_drop_last)
    sampler.set_epoch(epoch)
    return list(BatchSampler(sampler, batch_size, loader_drop_last))


CASES = list(itertools.product([1, 10, 23, 24], [1, 3, 4], [1, 4], [False, True],
                               [False, True], [False, True]))


@pytest.mark.parametrize("n,ranks,batch_size,shuffle,sampler_drop_last,loader_drop_last",
                         CASES)
def test_a_fresh_layout_deals_as_distributed_sampler_and_batches_as_the_loader(
        n, ranks, batch_size, shuffle, sampler_drop_last, loader_drop_last):
    layout = Layout(0, n, ranks, batch_size, sampler_drop_last, loader_drop_last)
    order = epoch_order(n, shuffle, 7, 2)
    for rank in range(ranks):
        theirs = torch_rank_batches(n, ranks, rank, batch_size, shuffle, 7, 2,
                                    sampler_drop_last, loader_drop_last)
        assert list(layout.rank_batches(order, rank)) == theirs
        assert layout.batches == len(theirs)


def global_stream(layout, order):
    """What all ranks take, in the job's global order: each step's batches, rank by rank,
    entry by entry (the g-th batches of all ranks together are a contiguous stretch)."""
    per_rank = [list(layout.rank_batches(order, r)) for r in range(layout.num_replicas)]
    out = []
    for step in range(layout.batches):
        width = len(per_rank[0][step])
        for j in range(width):
            out += [per_rank[r][step][j] for r in range(layout.num_replicas)]
    return out


@pytest.mark.parametrize("n,old,new,batch_size,new_batch_size,taken", [
    (100, 4, 3, 4, 4, 3), (100, 3, 2, 4, 4, 5), (100, 2, 4, 4, 4, 7), (37, 4, 3, 3, 3, 1),
    (37, 3, 2, 2, 3, 4), (10, 2, 4, 2, 1, 1), (101, 4, 3, 5, 5, 0), (64, 4, 2, 4, 8, 2),
    (23, 4, 3, 2, 2, 2), (23, 3, 4, 2, 2, 3)])
@pytest.mark.parametrize("sampler_drop_last", [False, True])
@pytest.mark.parametrize("loader_drop_last", [False, True])
def test_the_rest_on_other_ranks_is_each_untaken_sample_once_in_the_global_order(
        n, old, new, batch_size, new_batch_size, taken, sampler_drop_last, loader_drop_last):
    order = epoch_order(n, True, 3, 1)
    full = Layout(0, n, old, batch_size, sampler_drop_last, loader_drop_last)
    stream = global_stream(full, order)
    cut, end = full.taken(taken), full.taken(full.batches)
    # The ranks' first `taken` batches are the stream's first entries: order[:cut].
    before = stream[:min(taken * batch_size, full.per_rank) * old]
    assert before[:cut] == order[:cut].tolist() and set(before) == set(order[:cut].tolist())
    # The uninterrupted run's rest, padding aside, is order[cut:end].
    assert stream[len(before):][:end - cut] == order[cut:end].tolist()
    assert set(stream[len(before):]) <= set(order[:end].tolist())

    rest = full.rest(taken, new, new_batch_size)
    resumed = global_stream(rest, order)
    # Every untaken sample once, in the uninterrupted run's global order (cut short by
    # the drop_last settings), then the new ranks' padding: repeats of the rest's first
    # entries, fewer than the ranks.
    real = min(len(resumed), end - cut)
    assert resumed[:real] == order[cut:cut + real].tolist()
    padding = resumed[real:]
    assert len(padding) < new and padding == order[cut:end].tolist()[:len(padding)]
    if sampler_drop_last:
        assert not padding
    if sampler_drop_last or loader_drop_last:
        assert end - cut - real < new * (new_batch_size + 1)
    else:
        assert real == end - cut


def test_a_second_resume_continues_the_first_ones_stretch():
    """4 ranks -> 3 after 2 batches -> 2 after 1 more: still the same global order."""
    order = epoch_order(50, True, 0, 0)
    first = Layout(0, 50, 4, 2)
    second = first.rest(2, 3, 2)
    third = second.rest(1, 2, 2)
    assert (first.taken(2), second.start, second.taken(1), third.start) == (16, 16, 22, 22)
    assert global_stream(third, order)[:28] == order[22:].tolist()
    assert Layout.from_state(third.to_state()) == third


def test_positions_number_the_dealt_stretch():
    layout = Layout(10, 30, 3, 2)
    order = epoch_order(50, False, 0, 0)
    part = layout.rank_part(order, 1)
    assert [order[layout.position(1, k)].item() for k in range(len(part) - 1)] == \
        part[:-1].tolist()  # (the last one is padding, past the stretch)


# -- the loader: a state of S ranks resumed on T (num_workers=0: the sampler's rules,
# without Ray; tests/test_reshard_torchrun.py runs the whole job under torchrun) ------

N = 41


def dist_loader(cls, ranks, rank, batch_size, shuffle, sampler_drop_last, loader_drop_last,
                epoch=0, **kw):
    sampler = DistributedSampler(range(N), num_replicas=ranks, rank=rank, shuffle=shuffle,
                                 seed=5, drop_last=sampler_drop_last)
    sampler.set_epoch(epoch)
    return cls(range(N), batch_size=batch_size, sampler=sampler, drop_last=loader_drop_last,
               **kw)


def first_seen(entries, seen):
    out = []
    for x in entries:
        if x not in seen:
            seen.add(x)
            out.append(x)
    return out


@pytest.mark.parametrize("ranks,new_ranks,batch_size,new_batch_size",
                         [(4, 3, 2, 2), (3, 2, 2, 2), (2, 4, 3, 3), (4, 2, 2, 4)])
@pytest.mark.parametrize("shuffle", [False, True])
@pytest.mark.parametrize("sampler_drop_last,loader_drop_last",
                         [(False, False), (True, False), (False, True)])
def test_a_state_of_some_ranks_resumes_the_epoch_on_another_number_of_ranks(
        ranks, new_ranks, batch_size, new_batch_size, shuffle, sampler_drop_last,
        loader_drop_last):
    from torch.utils.data import DataLoader

    from dpex import DpexDataLoader

    settings = (shuffle, sampler_drop_last, loader_drop_last)
    taken = 2
    # torch's uninterrupted epoch on the old ranks, in the job's global order
    full = [[b.tolist() for b in dist_loader(DataLoader, ranks, r, batch_size, *settings)]
            for r in range(ranks)]
    uninterrupted = global_stream_of(full)
    before = global_stream_of([batches[:taken] for batches in full])
    # each old rank's state after `taken` steps; the new ranks load one of them
    states = []
    for r in range(ranks):
        loader = dist_loader(DpexDataLoader, ranks, r, batch_size, *settings,
                             distribute_mode=True)
        it = iter(loader)
        for _ in range(taken):
            next(it)
        states.append(loader.state_dict())
    seen = set(before)
    expected = first_seen(uninterrupted[len(before):], seen)
    for state in (states[0], states[-1]):  # any rank's state says the same
        resumed_ranks = []
        for r in range(new_ranks):
            loader = dist_loader(DpexDataLoader, new_ranks, r, new_batch_size, *settings,
                                 distribute_mode=True)
            loader.load_state_dict(state)
            resumed_ranks.append([b.tolist() for b in loader])
            # the next epoch: what the new ranks give from the start, as torch's
            loader.sampler.set_epoch(1)
            theirs = dist_loader(DataLoader, new_ranks, r, new_batch_size, *settings, epoch=1)
            assert [b.tolist() for b in loader] == [b.tolist() for b in theirs]
        resumed = global_stream_of(resumed_ranks)
        real = first_seen(resumed, set(before))
        assert resumed[:len(real)] == real == expected[:len(real)]  # the global order
        assert len(resumed) - len(real) < new_ranks  # then the new padding only
        if sampler_drop_last or loader_drop_last:
            assert len(expected) - len(real) < new_ranks * (new_batch_size + 1)
        else:
            assert real == expected and sorted(before + real) == list(range(N))


def global_stream_of(per_rank):
    out = []
    for step in range(len(per_rank[0])):
        for j in range(len(per_rank[0][step])):
            out += [batches[step][j] for batches in per_rank if j < len(batches[step])]
    return out


def test_another_number_of_ranks_without_a_distributed_sampler_is_refused_by_name(
        monkeypatch):
    from dpex import DpexDataLoader
    from dpex.client.resume import _load
    from dpex.errors import UnsupportedError

    loader = DpexDataLoader(range(N), batch_size=2, shuffle=True, distribute_mode=True)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    assert state["world_size"] == 1
    monkeypatch.setattr(_load, "ranks", lambda: (3, 0))  # (world size, rank)
    fresh = DpexDataLoader(range(N), batch_size=2, shuffle=True, distribute_mode=True)
    with pytest.raises(UnsupportedError, match=r"job of 1 ranks, and this job has 3.*"
                       r"RandomSampler.*DistributedSampler"):
        fresh.load_state_dict(state)
    # between epochs nothing is lost: the next epoch starts anew on any rank count
    for _ in it:
        pass
    fresh.load_state_dict(loader.state_dict())


def test_per_sample_seeding_needs_a_map_style_dataset():
    from dpex import DpexDataLoader

    class Stream(torch.utils.data.IterableDataset):
        def __iter__(self):
            return iter(range(3))

    with pytest.raises(ValueError, match="per_sample.*IterableDataset"):
        DpexDataLoader(Stream(), batch_size=2, num_workers=1, distribute_mode=True,
                       worker_seeding="per_sample")
