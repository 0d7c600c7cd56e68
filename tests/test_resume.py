"""Mid-epoch resume (``state_dict`` / ``load_state_dict``) against torch's uninterrupted
sequence. These tests run torch's own loader path (``distribute_mode=False``, which
takes the same resume code) without Ray; tests/test_resume_ray.py runs dpex's workers."""

import io

import dsets
import pytest
import resumable
import torch
from dsets import round_trip
from torch.utils.data import BatchSampler, DataLoader, DistributedSampler, RandomSampler, Sampler

from dpex import DpexDataLoader, ResumeStateError, UnsupportedError

N, BATCH = 50, 4  # 13 batches per epoch, the last one short


def as_lists(batch):
    """The dataset indices in a batch (Squares' second field)."""
    ids = batch[1]
    return ids.tolist() if isinstance(ids, torch.Tensor) else ids


def run(make, epochs, cut_epoch=None, cut=None, resume=True):
    """Batches of ``epochs`` epochs (index lists). With a cut: in epoch ``cut_epoch``
    take ``cut`` batches from an iterator, then (``resume``) save the state and go on
    with a new loader that loads it; ``resume=False`` is the uninterrupted reference
    (the loop goes on with the same loader)."""
    loader = make()
    out = []
    for e in range(epochs):
        set_epoch(loader, e)
        if e != cut_epoch:
            out.append([as_lists(b) for b in loader])
            continue
        it = iter(loader)
        out.append([as_lists(next(it)) for _ in range(cut)])
        finished = cut == len(loader)  # all taken, StopIteration not seen yet
        if resume:
            state = round_trip(loader.state_dict())
            del it
            if hasattr(loader, "close"):
                loader.close()
            loader = make()
            set_epoch(loader, e)
            loader.load_state_dict(state)
            it = None if finished else iter(loader)
        if not finished:
            out[-1] += [as_lists(b) for b in it]
    return out


def set_epoch(loader, e):
    if isinstance(loader.sampler, DistributedSampler):
        loader.sampler.set_epoch(e)


class StatefulShuffle(Sampler):
    """A sampler with its own state_dict (torchdata's convention: load, then iter resumes)."""

    def __init__(self, n, seed):
        self.n, self.seed, self.epoch, self.pos, self.resume_at = n, seed, 0, 0, 0

    def __iter__(self):
        order = torch.randperm(self.n, generator=torch.Generator().manual_seed(self.seed + self.epoch))
        start, self.resume_at = self.resume_at, 0
        for i in range(start, self.n):
            self.pos = i + 1  # the next to yield, while suspended after yielding i
            yield int(order[i])
        self.pos, self.epoch = 0, self.epoch + 1

    def __len__(self):
        return self.n

    def state_dict(self):
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state):
        self.epoch, self.resume_at = state["epoch"], state["pos"]


def configurations():
    ds = dsets.Squares(N, max_sleep=0)
    seed = 7
    return {
        "shuffle+generator": lambda cls, **kw: cls(
            ds, batch_size=BATCH, shuffle=True, generator=torch.Generator().manual_seed(seed), **kw),
        "sequential": lambda cls, **kw: cls(ds, batch_size=BATCH, **kw),
        "custom sampler": lambda cls, **kw: cls(ds, batch_size=BATCH, sampler=dsets.ReversedSampler(N), **kw),
        "batch sampler": lambda cls, **kw: cls(ds, batch_sampler=BatchSampler(
            RandomSampler(ds, generator=torch.Generator().manual_seed(seed)), 3, False), **kw),
        "stateful sampler": lambda cls, **kw: cls(ds, batch_size=BATCH, sampler=StatefulShuffle(N, seed), **kw),
        "distributed rank 1 of 3": lambda cls, **kw: cls(ds, batch_size=BATCH, sampler=DistributedSampler(
            ds, num_replicas=3, rank=1, shuffle=True, seed=seed), **kw),
        "batch_size=None": lambda cls, **kw: cls(
            ds, batch_size=None, shuffle=True, generator=torch.Generator().manual_seed(seed), **kw),
    }


CONFIGS = configurations()


@pytest.mark.parametrize("name", sorted(CONFIGS))
@pytest.mark.parametrize("cut_epoch,cut", [(0, 0), (0, 5), (1, 1), (1, 12), (0, 13), (2, 13)])
def test_resumed_run_equals_torchs_uninterrupted_run(name, cut_epoch, cut):
    make = CONFIGS[name]
    cut = min(cut, len(make(DataLoader)))  # 13: the whole epoch (5 batches per rank)
    want = run(lambda: make(DataLoader), 4, cut_epoch, cut, resume=False)
    got = run(lambda: make(DpexDataLoader), 4, cut_epoch, cut)
    assert got == want


def test_a_state_at_the_end_of_an_epoch_starts_the_next_epoch_not_an_empty_one():
    make = CONFIGS["shuffle+generator"]
    want = run(lambda: make(DataLoader), 2)
    loader = make(DpexDataLoader)
    first = [as_lists(b) for b in loader]  # StopIteration seen
    state = round_trip(loader.state_dict())
    assert not state["mid_epoch"]
    resumed = make(DpexDataLoader)
    resumed.load_state_dict(state)
    assert [first, [as_lists(b) for b in resumed]] == want


def test_without_a_generator_the_order_is_replayed_and_the_training_rng_moves_as_torchs():
    ds = dsets.Squares(N, max_sleep=0)
    torch.manual_seed(3)
    want = [as_lists(b) for b in DataLoader(ds, batch_size=BATCH, shuffle=True)]
    torch.manual_seed(3)
    loader = DpexDataLoader(ds, batch_size=BATCH, shuffle=True)
    it = iter(loader)
    got = [as_lists(next(it)) for _ in range(4)]
    state = round_trip(loader.state_dict())
    torch.manual_seed(99)  # the resumed job's own global RNG
    list(DataLoader(ds, batch_size=BATCH, shuffle=True))
    after_torchs_epoch = torch.get_rng_state()  # its base seed's and its order's draws
    torch.manual_seed(99)
    resumed = DpexDataLoader(ds, batch_size=BATCH, shuffle=True)
    resumed.load_state_dict(state)
    got += [as_lists(b) for b in resumed]
    assert got == want  # the order replayed from the saved RNG states, not from seed 99
    # and the job's RNG moved as torch's own epoch moves it: a job that seeds as the
    # saved one did finds it where the uninterrupted run had it.
    assert torch.equal(torch.get_rng_state(), after_torchs_epoch)


def test_a_second_checkpoint_after_a_resume_counts_from_the_epochs_start():
    make = CONFIGS["shuffle+generator"]
    want = run(lambda: make(DataLoader), 2)
    loader = make(DpexDataLoader)
    it = iter(loader)
    got = [as_lists(next(it)) for _ in range(3)]
    state = loader.state_dict()
    for _ in range(2):  # resume, take 2 more, save again: preempted twice in one epoch
        loader = make(DpexDataLoader)
        loader.load_state_dict(round_trip(state))
        assert loader.state_dict()["yielded"] == state["yielded"]  # loaded, not yet iterated
        it = iter(loader)
        got += [as_lists(next(it)) for _ in range(2)]
        state = loader.state_dict()
    assert state["yielded"] == 7
    loader = make(DpexDataLoader)
    loader.load_state_dict(round_trip(state))
    got += [as_lists(b) for b in loader]
    assert [got, [as_lists(b) for b in loader]] == want


def test_the_state_is_small_plain_data():
    make = CONFIGS["stateful sampler"]
    loader = make(DpexDataLoader)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    buf = io.BytesIO()
    torch.save(state, buf)
    assert buf.tell() < 32_000  # generator states (5 KB each), no batches
    assert round_trip(state)["sampler_state"] == {"epoch": 0, "pos": BATCH}


@pytest.mark.parametrize("change,match", [
    (lambda s: {"model": 1}, "what DpexDataLoader.state_dict"),
    (lambda s: {**s, "version": 99}, "version 99"),
    (lambda s: {**s, "length": 7}, "13 batches per epoch|had 7 batches"),
    (lambda s: {**s, "rng_source": "global"}, "generator"),
])
def test_a_state_that_does_not_fit_is_a_clear_error(change, match):
    make = CONFIGS["shuffle+generator"]
    loader = make(DpexDataLoader)
    it = iter(loader)
    next(it)
    state = change(loader.state_dict())
    with pytest.raises(ResumeStateError, match=match):
        make(DpexDataLoader).load_state_dict(state)


@pytest.mark.subprocess  # (torch's own worker processes)
def test_a_mid_epoch_iterable_state_resumes_only_where_its_position_means_something():
    # num_workers=0: the position is the dataset's one iterator, in the trainer: it
    # resumes there (tests/test_resume_conformance.py), not in workers' shards.
    loader = DpexDataLoader(dsets.ShardedRange(0, 20), batch_size=2)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    with pytest.raises(ResumeStateError, match="num_workers=0 only"):
        DpexDataLoader(dsets.ShardedRange(0, 20), batch_size=2, num_workers=2,
                       distribute_mode=True).load_state_dict(state)
    # torch's own worker processes cannot tell where their shards stand.
    loader = dsets.torch_loader(dsets.ShardedRange(0, 20), batch_size=2, num_workers=2)
    loader = DpexDataLoader.from_loader(loader, distribute_mode=False)
    it = iter(loader)
    next(it)
    state = loader.state_dict()
    del it
    with pytest.raises(UnsupportedError, match="IterableDataset by torch's own loader"):
        DpexDataLoader(dsets.ShardedRange(0, 20), batch_size=2).load_state_dict(state)


def test_another_ranks_state_keeps_the_order_but_not_its_workers_rng_states():
    # (Lightning under DDP saves rank 0's loader state and every rank loads it.)
    from dpex.client.resume import loaded

    make = CONFIGS["shuffle+generator"]
    loader = make(DpexDataLoader)
    it = iter(loader)
    next(it)
    state = {**loader.state_dict(), "worker_rng": {0: {"torch": torch.get_rng_state()}},
             "worker_rng_num_workers": 0}
    assert loaded(make(DpexDataLoader)._resume_view(), state).worker_rng == state["worker_rng"]
    other = loaded(make(DpexDataLoader)._resume_view(), {**state, "rank": 1})
    assert other.worker_rng is None and other.yielded == 1


def test_a_drawings_sampler_states_go_as_their_batches_are_yielded():
    """dpex's iterator keeps a stateful sampler's state for every batch drawn and not yet
    yielded, however wide its window grew (keep=None); torch's iterators, whose window
    is fixed, keep the newest ``keep``."""
    from dpex.client.resume import IndexView

    wide = iter(IndexView(StatefulShuffle(N, 7), None, keep=None))
    for _ in range(30):
        next(wide)
    assert wide.sampler_state_at(0) == {"epoch": 0, "pos": 0}  # nothing yielded yet
    wide.yielded(12)
    assert wide.sampler_state_at(11) is None
    assert wide.sampler_state_at(12) == {"epoch": 0, "pos": 12}
    assert wide.sampler_state_at(30) == {"epoch": 0, "pos": 30}
    narrow = iter(IndexView(StatefulShuffle(N, 7), None, keep=4))
    for _ in range(30):
        next(narrow)
    assert narrow.sampler_state_at(25) is None and narrow.sampler_state_at(26) is not None


@pytest.mark.parametrize("cls", ["torchdata", DpexDataLoader])
def test_a_state_after_iter_before_the_first_next_resumes_the_whole_epoch(cls):
    """num_workers=0, shuffle=True, no generator: the epoch's order is drawn from torch's
    global RNG at the first next(), and the dataset keeps that RNG as its own state
    (torchdata's DummyMapDataset does). A state taken between iter() and that next()
    resumes to the batches the uninterrupted run gave, as torchdata's
    StatefulDataLoader does: the dataset's state goes back before that draw, not after."""
    epochs = 2  # dpex: the resumed epoch and the next one
    if cls == "torchdata":
        cls = pytest.importorskip("torchdata.stateful_dataloader").StatefulDataLoader
        epochs = 1  # (its next epoch draws from the global RNG of the resumed job)

    def new():
        return cls(resumable.MapGlobalRng(), batch_size=2, shuffle=True)

    torch.manual_seed(5)
    want = [b.tolist() for _ in range(epochs) for b in new()]
    torch.manual_seed(5)
    loader = new()
    it = iter(loader)
    state = round_trip(loader.state_dict())
    del it
    torch.manual_seed(5)  # the resumed job seeds as the first one did
    resumed = new()
    resumed.load_state_dict(state)
    assert [b.tolist() for _ in range(epochs) for b in resumed] == want
