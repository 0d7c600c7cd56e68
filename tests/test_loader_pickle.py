"""The shipped loader's large buffers out of band (dpex._loader_pickle; no Ray): what travels
in the pickle, where the buffers lie, what is rebuilt from a mapping and from
read-only bytes, and the digest."""

import gc
import pickle

import numpy as np
import pytest
import torch
from dsets import open_memfds

from dpex import _loader_pickle
from dpex._loader_pickle import ALIGN, PickleParts
from dpex._pickling import OUT_OF_BAND_BYTES
from dpex._shipfile import ShipmentFile, map_shipment
from dpex._spec import ShippedLoader
from dpex.client._shipping import ship_loader
from dpex.server._task_runner import load_pickled
from dpex.server._trainer_state import leave_trainer_state

NODE = "a" * 56


def shipped(dataset) -> PickleParts:
    return ship_loader(ShippedLoader(dataset=dataset, dataset_kind=0, auto_collation=True,
                                     collate_fn=None, drop_last=False,
                                     worker_init_fn=None))


def unpickled(data):
    try:
        return load_pickled(data).dataset
    finally:
        leave_trainer_state()


def pickle_part(shipment: PickleParts) -> int:
    """The bytes of the shipment that are not its out-of-band buffers."""
    view = memoryview(bytes(shipment))
    at = view.tobytes().index(_loader_pickle.MAGIC)
    header = _loader_pickle.json.loads(view[at + 12:at + 12 + _loader_pickle._LENGTH.unpack_from(
        view, at + 8)[0]].tobytes())
    return header["pickle"][1]


def big():
    return {"tensor": torch.arange(300_000, dtype=torch.float32).reshape(-1, 3),
            "array": np.arange(200_000, dtype=np.float64),
            "half": torch.ones(70_000, dtype=torch.float16),
            "small": torch.ones(5), "text": ["a", "b"]}


def test_tensors_and_arrays_travel_beside_the_pickle_not_in_it():
    data = big()
    shipment = shipped(data)
    buffers = 1_200_000 + 1_600_000 + 140_000
    assert shipment.nbytes >= buffers
    assert pickle_part(shipment) < 8_000  # the small tensor, the list, the structure
    # torch's own reduction puts each storage in the pickle (through torch.save)
    assert len(pickle.dumps(data, protocol=5)) > buffers


def test_every_buffer_starts_aligned_in_the_shipment_whatever_the_header_holds():
    parts = PickleParts.framed(b"p" * 7, [pickle.PickleBuffer(bytearray(n))
                                          for n in (100, 70_001, 3)],
                               trainer={"cwd": "/d", "set": {"A": "x" * 13}, "unset": []}).parts
    whole = b"".join(bytes(part) for part in parts)
    at = whole.index(_loader_pickle.MAGIC)
    n = _loader_pickle._LENGTH.unpack_from(whole, at + 8)[0]
    header = _loader_pickle.json.loads(whole[at + 12:at + 12 + n])
    offsets = [at + offset for offset, _ in header["buffers"]]
    assert [o % ALIGN for o in offsets] == [0, 0, 0]
    assert [size for _, size in header["buffers"]] == [100, 70_001, 3]
    assert whole[at + header["pickle"][0]:][:7] == b"p" * 7
    assert header["trainer"]["set"] == {"A": "x" * 13}


def test_a_writable_source_lends_its_pages_and_a_read_only_one_is_copied():
    data = big()
    whole = bytearray(bytes(shipped(data)))
    out = unpickled(whole)
    lo = np.frombuffer(whole, dtype=np.uint8).ctypes.data
    ptr = out["tensor"].untyped_storage().data_ptr()
    assert lo <= ptr < lo + len(whole)  # a view of the source, no copy
    assert out["array"].ctypes.data >= lo and out["array"].flags.writeable
    for key in ("tensor", "array", "half", "small"):
        assert np.array_equal(np.asarray(out[key]), np.asarray(data[key]))
    out["tensor"][0, 0] = 7.0  # the view writes into its source, as a mapping's COW page
    assert whole != bytes(shipped(data))

    frozen = bytes(shipped(data))
    copy = unpickled(frozen)
    assert copy["array"].flags.writeable  # not a read-only view of the bytes
    copy["tensor"][0, 0] = 9.0  # a private copy: writing must not fault
    copy["array"][0] = 9.0
    assert torch.equal(copy["tensor"][1:], data["tensor"][1:])


def test_a_large_pickle_does_not_lend_its_buffers(monkeypatch):
    """A view keeps its whole source alive (the memfd, pickle included): past
    LEND_IN_BAND_BYTES of pickle the buffers are copied, so the source can go."""
    monkeypatch.setattr(_loader_pickle, "LEND_IN_BAND_BYTES", 100)  # (this pickle is larger)
    whole = bytearray(bytes(shipped(big())))
    before = bytes(whole)
    out = unpickled(whole)
    lo = np.frombuffer(whole, dtype=np.uint8).ctypes.data
    assert not lo <= out["tensor"].untyped_storage().data_ptr() < lo + len(whole)
    assert not lo <= out["array"].ctypes.data < lo + len(whole)
    out["tensor"][0, 0] = 7.0
    assert bytes(whole) == before  # its source untouched


def test_views_of_one_storage_travel_once_and_come_back_sharing_it():
    base = torch.arange(500_000, dtype=torch.float32)
    views = {"all": base, "head": base[:10], "tail": base[-100_000:],
             "again": base.view(-1, 10)}
    shipment = shipped(views)
    assert shipment.nbytes < base.nbytes + 64 * 1024  # not once per view
    out = unpickled(bytearray(bytes(shipment)))
    assert {out[k].untyped_storage().data_ptr() for k in views} == \
        {out["all"].untyped_storage().data_ptr()}
    for key, view in views.items():
        assert torch.equal(out[key], view)


def test_small_buffers_stay_in_the_pickle_and_the_frame_lists_none():
    shipment = shipped({"t": torch.ones(10), "a": np.zeros(OUT_OF_BAND_BYTES // 8 - 1)})
    whole = bytes(shipment)
    n = _loader_pickle._LENGTH.unpack_from(whole, 8)[0]
    assert _loader_pickle.json.loads(whole[12:12 + n])["buffers"] == []
    assert shipment.out_of_band == 0 and whole.count(_loader_pickle.MAGIC) == 1
    assert torch.equal(unpickled(bytes(shipment))["t"], torch.ones(10))


def test_the_digest_sees_one_changed_element_of_a_buffer():
    data = big()
    first = shipped(data).digest()
    assert shipped(data).digest() == first
    data["tensor"][-1, -1] += 1  # changed in place, between two iterators
    assert shipped(data).digest() != first
    assert len(first) == 16


def test_a_host_maps_the_memfd_copy_on_write_and_the_trainer_keeps_its_tensor():
    data = big()
    before = len(open_memfds("dpex-shipment"))
    file = ShipmentFile(shipped(data), NODE)
    view = map_shipment(file.ref)
    assert not view.readonly and bytes(view) == file.read()
    out = unpickled(view)
    lo = np.frombuffer(view, dtype=np.uint8).ctypes.data
    assert lo <= out["tensor"].untyped_storage().data_ptr() < lo + len(view)
    file.close()  # the trainer closes it; the mapping keeps the pages (and Python's
    assert len(open_memfds("dpex-shipment")) == before + 1  # mmap keeps a descriptor)
    assert torch.equal(out["tensor"], data["tensor"])
    out["tensor"][0, 0] = -1.0  # private to this process's mapping
    assert data["tensor"][0, 0] == 0.0
    del out, view
    gc.collect()
    assert len(open_memfds("dpex-shipment")) == before  # gone with what was rebuilt


def test_a_memfd_of_another_size_is_refused_before_it_is_mapped():
    file = ShipmentFile(PickleParts([b"abc"]), NODE)
    longer = file.ref.__class__(NODE, file.ref.pid, file.ref.fd, file.ref.nonce, 4)
    with pytest.raises(OSError, match="holds 3 bytes, not 4"):
        map_shipment(longer)  # a mapping past the file's end would fault on access
    file.close()


def test_a_shipment_names_the_installed_libraries_its_classes_and_functions_are_of():
    """What a host's library base imports before the dataset's base forks from it: an
    installed library's function or class (pluggy's, standing for Lightning's
    worker_init_fn), not the standard library's, torch's (every forkserver has it) or
    the script's own."""
    import colorsys
    import functools

    import pluggy

    def own(worker_id):  # (the script's own: travels by value)
        pass

    parts = ship_loader(ShippedLoader(
        dataset=[pluggy.HookimplMarker("x"), colorsys.rgb_to_hsv, torch.ones(3)],
        dataset_kind=0, auto_collation=True, collate_fn=None, drop_last=False,
        worker_init_fn=functools.partial(own)))
    assert set(parts.libraries) == {pluggy.HookimplMarker.__module__}  # (pluggy._decorators)
    assert shipped(torch.arange(10)).libraries == ()  # (no host pays a library base)
