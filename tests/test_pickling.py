"""One out-of-band pickler for batches and the shipped loader (dpex._pickling): what
each policy lifts out of the pickle, from what size, and what comes back."""

import io
import pickle

import numpy as np
import pytest
import torch

from dpex._pickling import BATCH, OUT_OF_BAND_BYTES, SHIPMENT, OutOfBandPickler


def dump(obj, policy):
    buffers = []
    out = io.BytesIO()
    OutOfBandPickler(out, buffers, policy).dump(obj)
    return out.getvalue(), buffers


def roundtrip(obj, policy):
    data, buffers = dump(obj, policy)
    return pickle.loads(data, buffers=[b.raw() for b in buffers]), buffers


def test_a_batch_sends_a_views_own_bytes_the_shipment_its_storage_once():
    whole = torch.arange(100_000, dtype=torch.float32)
    views = {"a": whole[:10], "b": whole[10:20]}
    out, buffers = roundtrip(views, BATCH)
    assert [b.raw().nbytes for b in buffers] == [40, 40]  # each view's part, not the storage
    assert torch.equal(out["a"], whole[:10]) and torch.equal(out["b"], whole[10:20])
    out, buffers = roundtrip(views, SHIPMENT)
    assert [b.raw().nbytes for b in buffers] == [whole.nbytes]  # the storage, once
    assert out["a"].untyped_storage().data_ptr() == out["b"].untyped_storage().data_ptr()
    assert torch.equal(out["b"], whole[10:20])


def test_the_shipment_keeps_small_buffers_in_band_a_batch_lifts_all():
    small = np.arange(10, dtype=np.int64)
    large = np.zeros(OUT_OF_BAND_BYTES // 8, dtype=np.int64)
    for policy, lifted in ((SHIPMENT, [large.nbytes]), (BATCH, [small.nbytes, large.nbytes])):
        out, buffers = roundtrip([small, large], policy)
        assert [b.raw().nbytes for b in buffers] == lifted
        assert np.array_equal(out[0], small) and np.array_equal(out[1], large)


def test_a_batch_refuses_a_tensor_on_a_device_the_shipment_leaves_it_to_torch():
    on_device = torch.empty(3, device="meta")
    with pytest.raises(TypeError, match="on device meta.*CPU tensors"):
        dump([on_device], BATCH)
    assert dump([on_device], SHIPMENT)[1] == []  # torch's own reduction, in band


def test_what_neither_policy_lifts_travels_as_torch_pickles_it():
    sparse = torch.eye(3).to_sparse()  # (its indices and values are plain tensors)
    for policy in (BATCH, SHIPMENT):
        out, _ = roundtrip(sparse, policy)
        assert out.is_sparse and torch.equal(out.to_dense(), torch.eye(3))
