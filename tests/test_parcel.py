"""The pickled loader is held once per node, not once per worker (issue 40, first step):
a worker gets a view of the object store's buffer, and keeps no bytes once it has
unpickled them. Without Ray: Ray hands a pickle-5 buffer, as pickle does here."""

import pickle

import cloudpickle
import pytest
from torch.utils.data._utils.collate import default_collate
from torch.utils.data.dataloader import _DatasetKind

from dpex._protocol import Wire
from dpex._security import SessionKeys
from dpex._shipfile import ShipmentFile, ShipmentUnavailable
from dpex._spec import PRELOADED, Parcel, PickledLoader, ShippedLoader, WorkerSpec
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


# -- one type in every form (issue 47: ``shipped`` is a Parcel at every signature) -------


def test_a_parcel_of_the_trainers_memfd_is_mapped_where_it_is_read_and_kept_nowhere_else():
    data = bytes(shipped_bytes(list(range(10))))
    file = ShipmentFile(data, "node-a")
    try:
        parcel = Parcel.delivered(None, file.ref, "node-a")
        assert parcel.ref == file.ref and parcel.view() is None  # not mapped yet
        assert len(parcel) == file.ref.size
        sent = pickle.loads(pickle.dumps(parcel))  # to a session's own process: the ref
        sent.map_now()
        assert sent.ref is None and bytes(sent.view()) == data
        assert bytes(parcel.take()) == data and parcel.take() is None
    finally:
        file.close()


def test_a_parcel_of_a_memfd_on_another_node_is_refused_as_undelivered():
    file = ShipmentFile(b"x" * 64, "node-a")
    try:
        with pytest.raises(ShipmentUnavailable, match="on node node-a"):
            Parcel.delivered(None, file.ref, "node-b")
        stored = Parcel(b"abc")  # the object store's copy wins wherever it was sent
        assert Parcel.delivered(stored, file.ref, "node-b") is stored
    finally:
        file.close()


def test_a_gone_memfd_raises_when_read_not_when_handed():
    file = ShipmentFile(b"x" * 64, "node-a")
    parcel = Parcel.delivered(None, file.ref, "node-a")
    file.close()
    with pytest.raises(ShipmentUnavailable):
        parcel.map_now()


def test_preloaded_survives_the_trip_to_a_forked_session_and_holds_nothing():
    sent = pickle.loads(pickle.dumps(PRELOADED))
    assert sent.preloaded and sent.empty and len(sent) == 0


def test_a_dropped_parcel_keeps_nothing():
    parcel = Parcel(b"abc")
    parcel.drop()
    assert parcel.empty and parcel.take() is None
