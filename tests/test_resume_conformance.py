"""Resume conformance: the cases torchdata's StatefulDataLoader is tested on, run on the
same script with StatefulDataLoader and with DpexDataLoader.

Each case takes k batches (or a whole epoch, or leaves the loop with ``break``), saves
``state_dict()`` through ``torch.save`` / ``torch.load(weights_only=True)``, builds a
fresh loader from new dataset, sampler and generator objects seeded as before,
``load_state_dict()``, and compares everything after with an uninterrupted run of the
same loader class. Both loaders' outcomes are checked: exact everywhere but the gaps
listed below, which must still fail (docs/RESUME.md's table says the same).
"""

import gc
import re

import dsets
import pytest
import resumable
import torch
from dsets import assert_same, round_trip
from torch.utils.data import DistributedSampler

from dpex import DpexDataLoader, ResumeStateError

torchdata = pytest.importorskip("torchdata.stateful_dataloader")

EPOCHS = 3

DATASETS = {  # name -> (dataset class, loader arguments)
    "map": (resumable.MapGlobalRng, {}),
    "map-shuffled-global-rng": (resumable.MapGlobalRng, {"shuffle": True}),
    "map-shuffled-generator": (resumable.MapGlobalRng, {"shuffle": True, "generator": 7}),
    "iterable": (resumable.IterPlain, {}),
    "iterable-generator": (resumable.IterGenerator, {}),
    "iterable-stateful": (resumable.IterStateful, {}),
    "iterable-self-iterating": (resumable.SelfIterating, {}),
    "iterable-epoch-counting": (resumable.EpochCounting, {}),
}
CUTS = {  # name -> (epoch, batches taken; None: the whole epoch, state after the loop)
    "mid-epoch": (0, 3),
    "after-break": (0, 3),
    "between-epochs": (0, None),
    "second-epoch": (1, 2),
}


def make(cls, dataset, num_workers, persistent, **kwargs):
    dataset_cls, extra = DATASETS[dataset]
    kwargs = {"batch_size": 2, **extra, **kwargs}
    if "generator" in kwargs:  # a new generator, seeded as before
        kwargs["generator"] = torch.Generator().manual_seed(kwargs["generator"])
    if num_workers:
        kwargs.update(num_workers=num_workers, persistent_workers=persistent)
        if cls is DpexDataLoader:
            kwargs["distribute_mode"] = True
        else:  # (forking a process connected to Ray is a Ray limitation)
            kwargs["multiprocessing_context"] = "forkserver"
    return cls(dataset_cls(), **kwargs)


def close(loader):
    if hasattr(loader, "close"):
        loader.close()


def interrupted_run(new, cut):
    """Every batch of EPOCHS epochs with a resume at ``cut``, and the state saved."""
    cut_epoch, k = CUTS[cut]
    torch.manual_seed(0)
    loader, seen = new(), []
    for _ in range(cut_epoch):
        seen += list(loader)
    taken = []
    if k is None:
        taken = list(loader)
        state = loader.state_dict()
    else:
        for batch in loader:
            taken.append(batch)
            if len(taken) == k:
                if cut != "after-break":
                    state = loader.state_dict()
                break
        if cut == "after-break":
            state = loader.state_dict()
    state = round_trip(state)
    close(loader)
    del loader
    torch.manual_seed(0)  # the resumed job seeds as the first one did
    resumed = new()
    resumed.load_state_dict(state)
    if k is not None:
        taken += list(resumed)
    seen += taken
    for _ in range(cut_epoch + 1, EPOCHS):
        seen += list(resumed)
    close(resumed)
    return seen


def uninterrupted_run(new):
    torch.manual_seed(0)
    loader = new()
    seen = [batch for _ in range(EPOCHS) for batch in loader]
    close(loader)
    return seen


# Cases a loader does not resume exactly, by (dataset, cut, num_workers, persistent): what
# docs/RESUME.md's table says, each checked as the difference it names: (the first epoch
# that differs, "order" where the samples' order differs, "draws" where only what the
# items drew from their RNG does).
SDL_GAPS = {
    # its RandomSampler with a generator and no workers: the base seed and the order
    # share the generator, and it puts back only the order's part
    **{("map-shuffled-generator", cut, 0, False): (1, "order")
       for cut in ("mid-epoch", "after-break", "between-epochs")},
    ("map-shuffled-generator", "second-epoch", 0, False): (2, "order"),
    # no state of its own, persistent workers: its fast-forward lands elsewhere
    ("iterable-generator", "second-epoch", 2, True): (1, "draws"),
}
BOTH_GAPS = {
    # No generator and no state of its own where the draws happen, resumed after the
    # first epoch: each epoch (the trainer's draws, or fresh workers' seeds) drew from
    # torch's global RNG, and a job that seeds as before has not made the earlier
    # epochs' draws. A generator makes these exact.
    ("iterable-generator", "second-epoch", 0, False): (1, "draws"),
    **{(name, "second-epoch", 2, False): (2, "draws")
       for name in ("map", "iterable-generator")},
}
DPEX_GAPS = {
    # Shuffled from torch's global RNG, resumed after the first epoch, with workers: torch's
    # sampler draws each later epoch's order from the global RNG as the job then has it
    # (StatefulDataLoader's own RandomSampler seeds a generator once: only its draws differ).
    ("map-shuffled-global-rng", "second-epoch", 2, False): (2, "order"),
    ("map-shuffled-global-rng", "second-epoch", 2, True): (2, "order"),
}
SDL_GAPS[("map-shuffled-global-rng", "second-epoch", 2, False)] = (2, "draws")


def difference(expected, got):
    """Where ``got`` first differs from ``expected`` (every batch of EPOCHS epochs, each
    item ``[i, draw]``): (epoch, "order" if the samples differ anywhere from there on,
    else "draws"), or None where they are equal."""
    assert len(got) == len(expected), (len(got), len(expected))
    per_epoch = len(expected) // EPOCHS
    first = next((n for n, (a, b) in enumerate(zip(expected, got, strict=True))
                  if not _same(a, b)), None)
    if first is None:
        return None
    order = any(not torch.equal(_column(a, 0), _column(b, 0))
                for a, b in zip(expected[first:], got[first:], strict=True))
    return first // per_epoch, "order" if order else "draws"


def _column(batch, k):
    return torch.as_tensor(batch)[..., k]


def _same(a, b):
    try:
        assert_same(a, b, "batch")
    except AssertionError:
        return False
    return True


def conforms(cls, dataset, cut, num_workers, persistent, gaps):
    """The loader's resumed run is its uninterrupted one, or differs as ``gaps`` says."""
    def new():
        return make(cls, dataset, num_workers, persistent)

    case = (dataset, cut, num_workers, persistent)
    found = difference(uninterrupted_run(new), interrupted_run(new, cut))
    assert found == gaps.get(case), (cls.__name__, case, found)


def check(dataset, cut, num_workers, persistent):
    conforms(torchdata.StatefulDataLoader, dataset, cut, num_workers, persistent,
             SDL_GAPS | BOTH_GAPS)
    conforms(DpexDataLoader, dataset, cut, num_workers, persistent, DPEX_GAPS | BOTH_GAPS)


@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("dataset", DATASETS)
def test_in_the_trainer_process_a_resume_is_an_uninterrupted_run(dataset, cut):
    """num_workers=0: the dataset runs in the trainer (torch's single-process path)."""
    check(dataset, cut, 0, False)


@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("dataset", DATASETS)
def test_with_dpex_workers_a_resume_is_an_uninterrupted_run(inprocess, dataset, cut,
                                                            persistent):
    """dpex's workers (2; the real task runner, in this process): every case."""
    conforms(DpexDataLoader, dataset, cut, 2, persistent, DPEX_GAPS | BOTH_GAPS)


@pytest.mark.parametrize("dataset, cut, persistent", [
    ("map-shuffled-global-rng", "second-epoch", True), ("map-shuffled-global-rng", "mid-epoch", False),
    ("iterable-stateful", "second-epoch", False), ("iterable-stateful", "mid-epoch", True)])
def test_with_dpex_workers_on_ray_a_resume_is_an_uninterrupted_run(ray_session, dataset, cut,
                                                                   persistent):
    """The same on Ray's workers (processes of their own): both dataset kinds, both
    cuts, fresh and persistent workers, and a gap among them."""
    conforms(DpexDataLoader, dataset, cut, 2, persistent, DPEX_GAPS | BOTH_GAPS)


@pytest.mark.subprocess
@pytest.mark.parametrize("persistent", [False, True])
@pytest.mark.parametrize("cut", CUTS)
@pytest.mark.parametrize("dataset", DATASETS)
def test_with_torchdatas_workers_a_resume_is_an_uninterrupted_run(dataset, cut, persistent):
    """The peer, with its worker processes: the table's other column."""
    conforms(torchdata.StatefulDataLoader, dataset, cut, 2, persistent, SDL_GAPS | BOTH_GAPS)


def same_state(a, b):
    assert_same({k: v for k, v in a.items() if k != "worker_rng"},
                {k: v for k, v in b.items() if k != "worker_rng"}, "state")


@pytest.mark.parametrize("loaded", ["mid-epoch", "between-epochs"])
@pytest.mark.parametrize("num_workers", [0, 2])
def test_a_state_right_after_load_state_dict_is_the_loaded_one(inprocess, num_workers, loaded):
    loader = make(DpexDataLoader, "map-shuffled-generator", num_workers, False)
    if loaded == "between-epochs":
        list(loader)
    it = iter(loader)
    for _ in range(3):
        next(it)
    saved = round_trip(loader.state_dict())
    if loaded == "between-epochs":
        saved = round_trip(make(DpexDataLoader, "map-shuffled-generator", num_workers,
                                False).state_dict())
    for _ in range(2):
        next(it)  # the old iterator is alive, and elsewhere
    loader.load_state_dict(saved)
    same_state(saved, round_trip(loader.state_dict()))
    rest = list(loader)  # the new iterator moves from the loaded position
    assert len(rest) == (7 if loaded == "mid-epoch" else 10)
    del it
    loader.close()


def distributed(epoch=0, **kwargs):
    dataset = dsets.Squares(24, max_sleep=0)
    sampler = DistributedSampler(dataset, num_replicas=kwargs.pop("num_replicas", 2), rank=0,
                                 shuffle=kwargs.pop("shuffle", True), seed=1)
    sampler.set_epoch(epoch)
    return DpexDataLoader(dataset, sampler=sampler, batch_size=kwargs.pop("batch_size", 2),
                          **kwargs)


def mid_epoch_state(loader):
    it = iter(loader)
    next(it)
    return round_trip(loader.state_dict())


@pytest.mark.parametrize("other, named", [
    (lambda: make(DpexDataLoader, "map-shuffled-global-rng", 0, False),
     "sampler 'torch.utils.data.sampler.SequentialSampler' there, "
     "'torch.utils.data.sampler.RandomSampler' here"),
    (lambda: make(DpexDataLoader, "map", 0, False, drop_last=True), "drop_last False there"),
    (lambda: DpexDataLoader(resumable.MapGlobalRng(21), batch_size=2), "dataset_length 20"),
])
def test_a_state_of_another_loader_is_refused_by_name(other, named):
    state = mid_epoch_state(make(DpexDataLoader, "map", 0, False))
    with pytest.raises(ResumeStateError, match=re.escape(named)):
        other().load_state_dict(state)


def test_a_distributed_samplers_state_is_refused_by_another_shuffle_or_epoch():
    state = mid_epoch_state(distributed(epoch=3))
    # (another number of ranks resumes the rest of the epoch: tests/test_reshard.py)
    distributed(epoch=3, num_replicas=3).load_state_dict(state)
    with pytest.raises(ResumeStateError, match="sampler.shuffle True there, False here"):
        distributed(epoch=3, shuffle=False).load_state_dict(state)
    loader = distributed(epoch=0)
    loader.load_state_dict(state)
    it = iter(loader)  # (a framework sets the epoch after iter(): checked at the first next())
    with pytest.raises(ResumeStateError, match=re.escape("call sampler.set_epoch(3)")):
        next(it)
    loader.sampler.set_epoch(3)  # as the saved run did: the plan is still there
    torch.manual_seed(0)
    reference = distributed(epoch=3)
    assert_same(list(reference)[1:], list(loader))


def test_an_autoscaled_loaders_state_is_plain_data():
    from dpex import Autoscale

    loader = DpexDataLoader(resumable.MapGlobalRng(), batch_size=2, distribute_mode=True,
                            num_workers=Autoscale(1, 3))
    state = round_trip(loader.state_dict())  # weights_only=True refused an Autoscale
    assert state["num_workers"] == 1 and type(state["num_workers"]) is int


@pytest.mark.parametrize("persistent", [False, True])
def test_with_four_workers_a_state_right_after_load_state_dict_is_the_loaded_one(
        inprocess, persistent):
    """torchdata's contract (StatefulDataLoader.load_state_dict drops its iterator, and
    state_dict() then describes what was loaded) with an iterator already running: 4
    workers, whose iterator, persistent or not, stands elsewhere when the state is loaded."""
    loader = make(DpexDataLoader, "map-shuffled-generator", 4, persistent)
    it = iter(loader)
    for _ in range(3):
        next(it)
    saved = round_trip(loader.state_dict())
    for _ in range(3):
        next(it)  # the running iterator moves on
    loader.load_state_dict(saved)
    assert_same(saved, round_trip(loader.state_dict()), "state")
    del it  # the running iterator, dropped mid-epoch, must not take the loaded state's place
    gc.collect()
    assert_same(saved, round_trip(loader.state_dict()), "state")
    assert saved["yielded"] == 3
    rest = list(loader)  # the next iterator moves from the loaded position
    assert len(rest) == 7
    loader.close()


@pytest.mark.parametrize("num_workers", [0, pytest.param(4, marks=pytest.mark.subprocess)])
def test_a_state_taken_before_any_iter_loaded_after_batches_is_given_back_as_loaded(
        request, num_workers):
    """Issue 49's contract case, beside StatefulDataLoader on the same script: shuffled
    from torch's global RNG (no generator), ``state0`` taken before any ``iter()``; a
    second loader takes 3 batches (which moves the global RNG), then loads ``state0``:
    its ``state_dict()`` is ``state0`` (it said the sampler's RNG as it was then)."""
    if num_workers:
        request.getfixturevalue("inprocess")  # (dpex's workers here; torchdata's: processes)
    for cls in (torchdata.StatefulDataLoader, DpexDataLoader):
        torch.manual_seed(0)
        state0 = round_trip(make(cls, "map-shuffled-global-rng", num_workers, False).state_dict())
        loader = make(cls, "map-shuffled-global-rng", num_workers, False)
        it = iter(loader)
        for _ in range(3):
            next(it)
        loader.load_state_dict(state0)
        assert_same(state0, round_trip(loader.state_dict()), cls.__name__)
        del it
        close(loader)
