"""Object refs inside a shipped dataset (issue 39, item 3): they live as long as the
shipment that carries them (the loader's, its iterators', the sessions serving it),
then go, as they do without dpex; they used to stay pinned for the trainer's life."""

import gc
import sys
import time

import cloudpickle
import numpy as np
import pytest
from torch.utils.data import Dataset

import dpex
from dpex import DpexDataLoader
from dpex._spec import ShippedLoader
from dpex.client._shipping import ship_loader

_MIB = 1 << 20

# The dataset below is defined here, which Ray workers cannot import: ship by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class HoldsAnArray(Dataset):
    """A dataset that holds an object ref to a large array and reads rows of it."""

    def __init__(self, ref) -> None:
        self.ref = ref

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> float:
        import ray

        return float(ray.get(self.ref, timeout=30)[i])


def _owned(hex_id: str) -> bool:
    """Whether this process (the ref's owner) still counts a reference to it: it keeps
    the object in the store while it does."""
    import ray

    counts = ray._private.worker.global_worker.core_worker.get_all_reference_counts()
    return hex_id.encode() in counts  # keyed by the hex id, as bytes


def _wait_gone(hex_id: str, limit: float) -> float:
    deadline = time.monotonic() + limit
    while _owned(hex_id):
        if time.monotonic() > deadline:
            return -1.0
        gc.collect()
        time.sleep(0.1)
    return limit - (deadline - time.monotonic())


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(300)
def test_a_ref_in_a_shipped_dataset_is_freed_once_everything_is_dropped():
    import ray

    ref = ray.put(np.arange(24 * _MIB // 8, dtype=np.float64))  # 24 MiB
    hex_id = ref.hex()
    dataset = HoldsAnArray(ref)
    loader = DpexDataLoader(dataset, batch_size=2, num_workers=1, distribute_mode=True,
                            timeout=60)
    assert [b.tolist() for b in loader] == [[0.0, 1.0], [2.0, 3.0]]
    del loader, dataset, ref
    gc.collect()
    dpex.release_warm_workers()
    waited = _wait_gone(hex_id, limit=30)
    assert waited >= 0, "the object is still held 30 s after everything was dropped"


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(120)
def test_pickling_a_dataset_without_shipping_it_pins_nothing():
    """A pickle that never reaches the object store (a reused shipment's, an error
    report's) holds nothing once dropped."""
    import ray

    ref = ray.put(np.zeros(1024))
    hex_id = ref.hex()
    shipped = ship_loader(ShippedLoader(dataset=HoldsAnArray(ref), dataset_kind=0,
                                        auto_collation=True, collate_fn=None,
                                        drop_last=False, worker_init_fn=None))
    assert len(shipped) > 0
    del shipped, ref
    assert _wait_gone(hex_id, limit=10) >= 0
