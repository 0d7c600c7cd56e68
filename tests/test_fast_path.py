"""The same-node fast path end to end: batches through the shared-memory rings are
exactly torch's, however the training loop holds or changes them."""

import dsets
import pytest
from dsets import assert_same

from dpex import DpexDataLoader

on_ray = pytest.mark.usefixtures("ray_session")  # (the rings are a Ray node's)

KW = {"batch_size": 8, "num_workers": 2, "collate_fn": dsets.mixed_collate}


@on_ray
def test_batches_through_the_rings_are_torchs():
    expected = list(dsets.torch_loader(dsets.Mixed(), **KW))
    with DpexDataLoader(dsets.Mixed(), distribute_mode=True, **KW) as loader:
        for got, want in zip(loader, expected, strict=True):
            assert_same(got, want)
        stats = loader.stats()
    assert [w["transport"] for w in stats["workers"].values()] == ["ring", "ring"]
    assert stats["received_in_ring"] == stats["received"] == len(expected)


@on_ray
def test_with_the_fast_path_off_batches_take_the_socket():
    expected = list(dsets.torch_loader(dsets.Mixed(), **KW))
    with DpexDataLoader(dsets.Mixed(), distribute_mode=True, shm_ring_bytes=0, **KW) as loader:
        for got, want in zip(loader, expected, strict=True):
            assert_same(got, want)
        stats = loader.stats()
    assert stats["received_in_ring"] == 0 and stats["received"] == len(expected)
    assert all(w["transport"].startswith("socket") for w in stats["workers"].values())


@on_ray
def test_a_loop_that_keeps_and_overwrites_every_batch_still_gets_torchs():
    # 1 MiB rings, and the loop keeps all 12 batches of 400 kB: the rings fill up and
    # later batches take the socket; each batch is also scribbled over once checked.
    kw = {**KW, "batch_size": 32}
    expected = list(dsets.torch_loader(dsets.Mixed(384), **kw))
    kept = []
    with DpexDataLoader(dsets.Mixed(384), distribute_mode=True, shm_ring_bytes=1 << 20,
                        persistent_workers=True, **kw) as loader:
        for _ in range(2):
            for got, want in zip(loader, expected, strict=True):
                assert_same(got, want)
                got["img"].fill_(-1.0)
                got["arr"].fill(-1.0)
                kept.append(got)
        stats = loader.stats()
    assert 0 < stats["received_in_ring"] < stats["received"], stats


@pytest.mark.parametrize("bad", [-1, 1000, 2.5, True])
def test_a_bad_ring_size_is_refused_by_name(bad):
    with pytest.raises(ValueError, match="shm_ring_bytes"):
        DpexDataLoader(dsets.Mixed(), distribute_mode=True, shm_ring_bytes=bad)
