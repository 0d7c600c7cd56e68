"""dpex against torch's DataLoader: same arguments, same seed → same batches, same order.

dpex's workers run in this process (tests/inprocess.py: the real task runner) unless a
test is marked ``ray``: those run on the shared Ray instance, a real case of each kind
(processes, placement, the socket and ring transports, priorities, a worker that
blocks). A test that runs torch's loader with workers beside is marked ``subprocess``
(the e2e tier); the rest need neither Ray nor a process (the fast tier)."""

import os
import time
import warnings

import dsets
import pytest
import torch
from dsets import assert_same, epochs
from torch.utils.data import DataLoader
from torch.utils.data.dataloader import _MultiProcessingDataLoaderIter, _SingleProcessDataLoaderIter

from dpex import DpexDataLoader
from dpex.client._iterator import RayDataLoaderIter

pytestmark = [pytest.mark.timeout(120), pytest.mark.usefixtures("dpex_workers")]
ON_RAY = pytest.mark.ray
TORCH_WORKERS = pytest.mark.subprocess  # (torch's loader with its worker processes beside)


def compare(dataset, n_epochs=1, seed=0, make_kwargs=dict, **kwargs):
    """Run torch and dpex with the same (freshly made) arguments; return dpex's batches."""
    results = []
    for cls, extra in ((dsets.torch_loader, {}), (DpexDataLoader, {"distribute_mode": True})):
        torch.manual_seed(seed)
        loader = cls(dataset, **kwargs, **make_kwargs(), **extra)
        results.append(epochs(loader, n_epochs))
        if isinstance(loader, DpexDataLoader):
            loader.close()
    expected, got = results
    assert sum(map(len, expected)) > 0
    assert_same(expected, got, "epochs")
    return got


def seeded_generator():
    return {"generator": torch.Generator().manual_seed(1234)}


@TORCH_WORKERS
@pytest.mark.parametrize("batch_size, drop_last, shuffle", [
    (1, False, False), pytest.param(7, False, True, marks=ON_RAY), (7, True, True),
    (16, False, False),
])
def test_map_style_matches_torch(batch_size, drop_last, shuffle):
    compare(dsets.Squares(50), batch_size=batch_size, drop_last=drop_last, shuffle=shuffle,
            num_workers=2, make_kwargs=seeded_generator)


@TORCH_WORKERS
def test_several_epochs_shuffled_from_the_global_rng():
    compare(dsets.Squares(40), n_epochs=3, batch_size=6, shuffle=True, num_workers=3)


@ON_RAY
def test_persistent_workers_match_torch_and_are_reused():
    torch.manual_seed(0)
    loader = DpexDataLoader(dsets.Squares(30), batch_size=4, shuffle=True, num_workers=2,
                            persistent_workers=True, distribute_mode=True)
    it = iter(loader)
    first = list(it)
    pids = {w: info["pid"] for w, info in it._ready.items()}
    rest = epochs(loader, 2)
    assert iter(loader) is it and {w: i["pid"] for w, i in it._ready.items()} == pids
    torch.manual_seed(0)
    expected = epochs(dsets.torch_loader(dsets.Squares(30), batch_size=4, shuffle=True, num_workers=2,
                                 persistent_workers=True), 4)
    assert_same(expected[:3], [first, *rest])
    loader.close()


@TORCH_WORKERS
@pytest.mark.parametrize("kwargs", [
    {"sampler": dsets.ReversedSampler(30), "batch_size": 4},
    {"batch_sampler": [[3, 1], [0], [29, 28, 27, 2], [5, 5]]},
    {"batch_size": 5, "collate_fn": dsets.sum_collate},
    {"batch_size": None},
    {"batch_size": None, "shuffle": True},
], ids=["sampler", "batch_sampler", "collate_fn", "batch_size_None", "unbatched_shuffled"])
def test_samplers_and_collate(kwargs):
    compare(dsets.Squares(30), num_workers=2, make_kwargs=seeded_generator, **kwargs)


@TORCH_WORKERS
def test_getitems_is_used_as_torch_uses_it():
    got = compare(dsets.BatchedSquares(20), batch_size=6, num_workers=2)
    assert list(got[0][0][1]) == ["batched"] * 6  # __getitems__'s marker, not __getitem__'s ids


def test_len_matches_torch():
    kw = {"batch_size": 7, "num_workers": 2}
    assert len(DpexDataLoader(dsets.Squares(50), distribute_mode=True, **kw)) == \
        len(DataLoader(dsets.Squares(50), **kw)) == 8
    loader = DpexDataLoader(dsets.Squares(50), distribute_mode=True, drop_last=True, **kw)
    it = iter(loader)
    assert len(it) == 7 and len(list(it)) == 7


@TORCH_WORKERS
@pytest.mark.parametrize("batch_size, drop_last", [
    pytest.param(4, False, marks=ON_RAY), (4, True), (None, False)])
def test_iterable_dataset_round_robin_like_torch(batch_size, drop_last):
    got = compare(dsets.ShardedRange(37), batch_size=batch_size, drop_last=drop_last,
                  num_workers=3)
    flat = torch.cat([b.reshape(-1, 2) for b in got[0]])
    assert set(flat[:, 1].tolist()) == {0, 1, 2}  # every worker contributed


@TORCH_WORKERS
def test_iterable_dataset_with_persistent_workers_over_epochs():
    compare(dsets.ShardedRange(21), n_epochs=2, batch_size=3, num_workers=2,
            persistent_workers=True)


@TORCH_WORKERS
@pytest.mark.parametrize("persistent", [False, pytest.param(True, marks=ON_RAY)])
def test_worker_info_seeds_and_worker_init_fn(persistent):
    got = compare(dsets.SeedProbe(), n_epochs=2, batch_size=2, num_workers=3,
                  worker_init_fn=dsets.mark_init, persistent_workers=persistent,
                  make_kwargs=seeded_generator)
    for batch in got[0]:
        w = batch["worker"][0].item()
        assert batch["num_workers"].tolist() == [3, 3]
        assert batch["same_dataset"].tolist() == [True, True]
        assert (batch["initial_seed"] == batch["seed"]).all()
        assert batch["init_marker"] == [f"{w},"] * 2  # worker_init_fn ran once in this worker


@TORCH_WORKERS
def test_in_order_false_yields_every_batch():
    kw = {"batch_size": 3, "num_workers": 3}
    expected = list(dsets.torch_loader(dsets.Squares(40), **kw))  # any order: sorted below
    got = list(DpexDataLoader(dsets.Squares(40, max_sleep=0.02), distribute_mode=True,
                              in_order=False, **kw))
    key = lambda b: b[1][0].item()  # noqa: E731
    assert_same(sorted(expected, key=key), sorted(got, key=key))


def test_two_loaders_interleaved():
    a = DpexDataLoader(dsets.Squares(20), batch_size=3, num_workers=2, distribute_mode=True)
    b = DpexDataLoader(dsets.Squares(30), batch_size=5, num_workers=1, distribute_mode=True)
    pairs = list(zip(a, b, strict=False))
    assert [x[1].tolist() for x, _ in pairs] == [list(range(i, min(i + 3, 20))) for i in range(0, 18, 3)]
    assert [y[1].tolist() for _, y in pairs] == [list(range(i, i + 5)) for i in range(0, 30, 5)]


@ON_RAY
def test_nine_mib_batches_are_bit_exact():
    got = compare(dsets.Images(192), batch_size=64, num_workers=2)
    assert got[0][0][0].nbytes == 64 * 3 * 224 * 224


def test_run_ahead_is_bounded_by_the_credit_window():
    sampler = dsets.CountingBatchSampler(n=40)
    loader = DpexDataLoader(dsets.Squares(80, max_sleep=0), batch_sampler=sampler,
                            num_workers=2, prefetch_factor=3, distribute_mode=True)
    it = iter(loader)
    window = 3 * 2
    assert sampler.drawn == window
    for taken in range(1, 6):
        next(it)
        time.sleep(0.2)  # a slow consumer: workers are idle, waiting for credit
        assert sampler.drawn == taken + window
        assert it.stats()["credits_in_flight"] <= window
    loader.close()


def test_infinite_sampler_is_read_lazily():
    sampler = dsets.CountingBatchSampler(n=None)
    loader = DpexDataLoader(dsets.Squares(10**6, max_sleep=0), batch_sampler=sampler,
                            num_workers=2, distribute_mode=True)
    for k, (_, ids) in enumerate(loader):
        assert ids.tolist() == [2 * k, 2 * k + 1]
        if k == 9:
            break
    assert sampler.drawn == 10 + 2 * 2


@TORCH_WORKERS
def test_modes_pick_the_right_iterator():
    ds = dsets.Squares(4)
    plain = iter(DpexDataLoader(ds, num_workers=1, multiprocessing_context="forkserver"))
    assert isinstance(plain, _MultiProcessingDataLoaderIter)
    del plain
    assert isinstance(iter(DpexDataLoader(ds, distribute_mode=True)), _SingleProcessDataLoaderIter)
    it = iter(DpexDataLoader(ds, num_workers=1, distribute_mode=True))
    assert isinstance(it, RayDataLoaderIter)
    it._shutdown_workers()


def test_no_distribute_mode_is_torch_itself():
    compare_kw = {"batch_size": 3, "shuffle": True}
    torch.manual_seed(5)
    expected = list(DataLoader(dsets.Squares(12), **compare_kw))
    torch.manual_seed(5)
    assert_same(expected, list(DpexDataLoader(dsets.Squares(12), **compare_kw)))


@pytest.mark.parametrize("kwargs", [
    {"num_workers": -1},
    {"timeout": -1},
    {"prefetch_factor": 2},
    {"persistent_workers": True},
    {"batch_sampler": [[0]], "batch_size": 2},
    {"sampler": [0], "shuffle": True},
    {"batch_size": None, "drop_last": True},
    {"multiprocessing_context": "spawn"},
], ids=lambda kw: ",".join(kw))
def test_constructor_errors_are_torchs(kwargs):
    with pytest.raises(Exception) as theirs:
        DataLoader(dsets.Squares(4), **kwargs)
    with pytest.raises(type(theirs.value)) as ours:
        DpexDataLoader(dsets.Squares(4), distribute_mode=True, **kwargs)
    assert str(ours.value) == str(theirs.value)


def test_dpex_arguments_are_validated_and_stored_under_their_names():
    loader = DpexDataLoader(dsets.Squares(4), distribute_mode=True, head_address="auto",
                            num_workers=1, ray_remote_args={"num_cpus": 0.5})
    assert (loader.distribute_mode, loader.head_address, loader.ray_remote_args) == \
        (True, "auto", {"num_cpus": 0.5})
    with pytest.raises(TypeError, match="torch's arguments in torch's order"):
        DpexDataLoader(dsets.Squares(4), True)
    with pytest.raises(TypeError, match="distribute_mode must be a bool"):
        DpexDataLoader(dsets.Squares(4), distribute_mode="yes")
    with pytest.raises(ValueError, match="max_message_bytes must be an int >= 1024"):
        DpexDataLoader(dsets.Squares(4), max_message_bytes=10)
    assert DpexDataLoader[int] is not None and issubclass(DpexDataLoader, DataLoader)


def test_worker_init_fn_set_after_construction_is_honoured():
    loader = DpexDataLoader(dsets.SeedProbe(), batch_size=4, num_workers=2, distribute_mode=True)
    loader.worker_init_fn = dsets.mark_init  # as Lightning does
    batches = list(loader)
    assert {m for b in batches for m in b["init_marker"]} == {"0,", "1,"}


@TORCH_WORKERS
def test_pin_memory_without_cuda_warns_like_torch_and_still_loads():
    said = []
    for cls, extra in ((dsets.torch_loader, {}), (DpexDataLoader, {"distribute_mode": True})):
        with warnings.catch_warnings(record=True) as caught:
            warnings.simplefilter("always")
            got = list(cls(dsets.Squares(10), batch_size=4, num_workers=1, pin_memory=True,
                           **extra))
        said.append(sorted({str(w.message) for w in caught if "pin_memory" in str(w.message)}))
        assert len(got) == 3
    assert said[0] == said[1]  # whatever this torch says (2.13 warns; a 2.6 CUDA build not)
    if not torch.cuda.is_available():
        assert not got[0][0].is_pinned()


@ON_RAY
@pytest.mark.skipif(os.geteuid() != 0, reason="raising a process's priority needs CAP_SYS_NICE")
def test_workers_run_at_the_trainers_priority_not_rays_niceness_15():
    with DpexDataLoader(dsets.Squares(8), batch_size=4, num_workers=2, distribute_mode=True,
                        persistent_workers=True) as loader:
        list(loader)
        mine = os.getpriority(os.PRIO_PROCESS, 0)
        assert {info["niceness"] for info in loader._iterator._ready.values()} == {mine}


@ON_RAY
def test_in_order_false_does_not_let_a_stuck_worker_hoard_the_window(tmp_path):
    """torch's rule: with in_order=False a worker gets a task only below its share of
    the window, so the others carry the epoch while worker 0 is stuck."""
    flag = str(tmp_path / "release")
    loader = DpexDataLoader(dsets.BlocksWorker0(flag, n=40), batch_size=None, num_workers=4,
                            prefetch_factor=2, in_order=False, timeout=20, distribute_mode=True)
    it = iter(loader)
    first = [int(next(it)) for _ in range(38)]  # all but worker 0's two; it is still stuck
    open(flag, "w").close()
    rest = [int(x) for x in it]
    assert sorted(first + rest) == list(range(40)) and len(rest) == 2


@TORCH_WORKERS
def test_iterdatapipe_shuffles_like_torch_across_epochs():
    from torch.utils.data.datapipes.iter import IterableWrapper

    def pipe():
        return IterableWrapper(range(40)).shuffle().sharding_filter()

    for persistent in (False, True):
        results = []
        for cls, extra in ((dsets.torch_loader, {}), (DpexDataLoader, {"distribute_mode": True})):
            loader = cls(pipe(), batch_size=4, num_workers=2, persistent_workers=persistent,
                         generator=torch.Generator().manual_seed(7), **extra)
            results.append(epochs(loader, 2))
        assert_same(*results, f"persistent={persistent}")
        first, second = ([b.tolist() for b in e] for e in results[1])
        assert first != second  # the shuffle differs between epochs


@TORCH_WORKERS
def test_worker_init_fn_error_is_raised_once_and_persistent_workers_recover_like_torch():
    results = []
    for cls, extra in ((dsets.torch_loader, {}), (DpexDataLoader, {"distribute_mode": True})):
        loader = cls(dsets.Squares(12), batch_size=2, num_workers=2, persistent_workers=True,
                     worker_init_fn=dsets.init_fails_for_worker0, **extra)
        results.append(dsets.outcomes(loader, 2))
        if isinstance(loader, DpexDataLoader):
            loader.close()
    expected, got = results
    assert expected[0][0][0] == "ZeroDivisionError"
    assert_same(expected, got, "outcomes")
