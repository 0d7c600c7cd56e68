"""How frameworks copy a loader, without Ray: Lightning's recorded re-instantiation,
pickling (mp.spawn), ``from_loader`` (Accelerate, the HF Trainer) and the warning when
Accelerate is about to drop dpex."""

import pickle
import warnings

import dsets
import pytest
import torch
from torch.utils.data import DataLoader, DistributedSampler

from dpex import DpexDataLoader, DpexDroppedWarning

lightning_data = pytest.importorskip("lightning_fabric.utilities.data")
pl_data = pytest.importorskip("pytorch_lightning.utilities.data")

DPEX_KW = {"distribute_mode": True, "ray_remote_args": {"num_cpus": 0.5},
           "startup_timeout": 7.0, "shm_ring_bytes": 0}


def reinstantiate_for_ddp(loader):
    """What Lightning's DDP set-up does: the same loader, with a DistributedSampler."""
    return pl_data._update_dataloader(loader, DistributedSampler(loader.dataset, 2, 1))


def assert_twin(new, old):
    assert type(new) is DpexDataLoader
    for name in ("distribute_mode", "ray_remote_args", "startup_timeout", "shm_ring_bytes",
                 "batch_size", "num_workers", "dataset"):
        assert getattr(new, name) == getattr(old, name), name
    assert isinstance(new.sampler, DistributedSampler)


def test_lightning_recreates_a_loader_whose_own_init_it_recorded():
    with lightning_data._replace_dunder_methods(DataLoader, "dataset"):
        loader = DpexDataLoader(dsets.Squares(8), batch_size=2, num_workers=2, **DPEX_KW)
    assert_twin(reinstantiate_for_ddp(loader), loader)


def test_lightning_recreates_it_when_only_torchs_init_was_recorded():
    """dpex imported inside a *_dataloader hook: Lightning's wrappers were installed
    before the class existed, so only DataLoader.__init__ records the arguments. This
    used to fail with "multiple values for argument 'sampler'" (positional arguments
    recorded) and, once fixed at that point, to drop distribute_mode silently."""
    with lightning_data._replace_dunder_methods(DataLoader, "dataset"):
        wrapped = DpexDataLoader.__init__
        DpexDataLoader.__init__ = DpexDataLoader.__old__init__  # as if defined just now
        try:
            loader = DpexDataLoader(dsets.Squares(8), batch_size=2, num_workers=2, **DPEX_KW)
        finally:
            DpexDataLoader.__init__ = wrapped
    assert getattr(loader, "__pl_saved_args") == (loader.dataset,)  # recorded by name
    assert_twin(reinstantiate_for_ddp(loader), loader)


def test_a_loader_rebuilt_from_its_attributes_keeps_dpex():
    """A loader passed straight to Trainer.fit: Lightning rebuilds it from attributes."""
    loader = DpexDataLoader(dsets.Squares(8), batch_size=2, num_workers=2, **DPEX_KW)
    assert_twin(reinstantiate_for_ddp(loader), loader)


def test_the_loader_pickles_its_configuration_not_its_iterators():
    loader = DpexDataLoader(dsets.Squares(8), batch_size=2, num_workers=2, **DPEX_KW)
    loader._iterator = object()  # what a live persistent iterator would be: not picklable
    loader._book.ended({"received": 3})  # (what a shut-down iterator reports)
    assert loader.stats() == {"received": 3}
    copy = pickle.loads(pickle.dumps(loader))
    assert copy._iterator is None and copy.stats() == {}
    assert (copy.distribute_mode, copy.ray_remote_args, copy.batch_size) == \
        (True, {"num_cpus": 0.5}, 2)


def test_from_loader_keeps_every_object_that_decides_the_batches():
    gen = torch.Generator().manual_seed(0)
    plain = DataLoader(dsets.Squares(10), batch_size=3, shuffle=True, num_workers=2,
                       generator=gen, worker_init_fn=dsets.mark_init, collate_fn=dsets.sum_collate,
                       persistent_workers=True, prefetch_factor=4, drop_last=True)
    twin = DpexDataLoader.from_loader(plain, distribute_mode=True, startup_timeout=9.0)
    assert twin.batch_sampler is plain.batch_sampler and twin.generator is gen
    assert twin.dataset is plain.dataset and twin.collate_fn is dsets.sum_collate
    assert twin.worker_init_fn is dsets.mark_init and twin.prefetch_factor == 4
    assert twin.persistent_workers and (twin.distribute_mode, twin.startup_timeout) == (True, 9.0)
    # A DpexDataLoader's own dpex arguments carry over unless given anew.
    again = DpexDataLoader.from_loader(twin, startup_timeout=3.0)
    assert (again.distribute_mode, again.startup_timeout) == (True, 3.0)
    # batch_size=None and an IterableDataset: no batch sampler to reuse
    none = DpexDataLoader.from_loader(DataLoader(dsets.Squares(4), batch_size=None))
    assert none.batch_size is None and none.batch_sampler is None
    iterable = DpexDataLoader.from_loader(DataLoader(dsets.ShardedRange(8), batch_size=2))
    assert iterable.batch_size == 2 and len(list(iterable)) == len(list(
        DataLoader(dsets.ShardedRange(8), batch_size=2)))


def test_accelerate_reading_the_prepared_flag_gets_a_loud_warning():
    loader = DpexDataLoader(dsets.Squares(8), batch_size=2, num_workers=2, **DPEX_KW)
    with pytest.warns(DpexDroppedWarning, match="dpex.accelerate.prepare_data_loader"):
        assert getattr(loader, "_is_accelerate_prepared", False) is False
    loader._is_accelerate_prepared = True  # the user's explicit choice: no warning
    with warnings.catch_warnings():
        warnings.simplefilter("error")
        assert loader._is_accelerate_prepared is True
        # and none for torch's own mode, which Accelerate does not change
        plain = DpexDataLoader(dsets.Squares(8), batch_size=2)
        assert plain._is_accelerate_prepared is False
