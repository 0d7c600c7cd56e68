"""The pickled loader is held once per node, not once per worker (issue 40, first step):
a worker gets a view of the object store's buffer, and keeps no bytes once it has
unpickled them. Without Ray: Ray hands a pickle-5 buffer, as pickle does here."""

import pickle

import cloudpickle
from torch.utils.data._utils.collate import default_collate
from torch.utils.data.dataloader import _DatasetKind

from dpex._protocol import Wire
from dpex._security import SessionKeys
from dpex._spec import Parcel, PickledLoader, ShippedLoader, WorkerSpec
from dpex.server._task_runner import TaskRunner


def shipped_bytes(dataset):
    return PickledLoader(cloudpickle.dumps(ShippedLoader(
        dataset=dataset, dataset_kind=_DatasetKind.Map, auto_collation=True,
        collate_fn=default_collate, drop_last=False, worker_init_fn=None)))


def test_a_worker_gets_a_view_of_the_stored_buffer_not_a_copy():
    stored = shipped_bytes(list(range(1000)))
    buffers = []
    in_band = pickle.dumps(stored, protocol=5, buffer_callback=buffers.append)
    store = bytearray(buffers[0].raw())  # the object store's copy
    parcel = pickle.loads(in_band, buffers=[store])
    assert isinstance(parcel, Parcel) and len(parcel) == len(stored)
    view = parcel.take()
    assert isinstance(view, memoryview) and view.readonly
    store[0] ^= 0xFF  # the same memory: no copy was made
    assert view[0] == store[0]


def test_a_worker_keeps_no_bytes_once_it_has_unpickled_them():
    parcel = Parcel(bytes(shipped_bytes(list(range(10)))))
    spec = WorkerSpec(wire=Wire.new(), worker_id=0, num_workers=1, base_seed=1,
                      data_address="", control_address="", keys=SessionKeys.new().client)
    runner = TaskRunner(spec, parcel)
    assert runner.loader.dataset == list(range(10))
    assert len(parcel) == 0 and parcel.take() is None


def test_a_parcel_sent_to_a_sessions_own_process_carries_its_bytes():
    parcel = pickle.loads(pickle.dumps(Parcel(memoryview(b"abc"))))
    assert parcel.take() == b"abc"
