import collections
import pickle

import numpy as np
import pytest
import torch

from dpex._codec import decode_batch, encode_batch

Point = collections.namedtuple("Point", "x y")

# Every dtype this torch has (uint16/32/64 came with torch 2.3, float8 with 2.1).
ALL_DTYPES = [getattr(torch, name) for name in (
    "float32", "float64", "float16", "bfloat16", "complex64", "complex128", "uint8", "int8",
    "int16", "int32", "int64", "bool", "uint16", "uint32", "uint64", "float8_e4m3fn",
) if hasattr(torch, name)]


def roundtrip(obj):
    structure, *buffers = encode_batch(obj)
    # What the wire does: every frame becomes independent bytes.
    return decode_batch(bytes(structure), [bytes(b) for b in buffers]), len(buffers)


def assert_same(a, b):
    assert type(a) is type(b)
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape
        assert torch.equal(a, b)
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape
        np.testing.assert_array_equal(a, b)
    elif isinstance(a, dict):
        assert a.keys() == b.keys()
        for k in a:
            assert_same(a[k], b[k])
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b)
        for x, y in zip(a, b, strict=True):
            assert_same(x, y)
    else:
        assert a == b


@pytest.mark.parametrize("dtype", ALL_DTYPES, ids=str)
def test_every_dtype_roundtrips_out_of_band(dtype):
    t = torch.arange(24, dtype=torch.float64).reshape(2, 3, 4).to(dtype)
    out, nbuf = roundtrip(t)
    assert nbuf == 1
    assert out.dtype == dtype and out.shape == t.shape
    assert torch.equal(out.view(torch.uint8), t.view(torch.uint8))


@pytest.mark.parametrize("make", [
    lambda: torch.arange(12.).reshape(3, 4).t(),               # transposed
    lambda: torch.arange(20.)[::3],                              # strided
    lambda: torch.arange(24.).reshape(2, 3, 4)[:, 1:, ::2],      # sliced
    lambda: torch.empty(0, 5),                                   # zero-size
    lambda: torch.tensor(3.5),                                   # 0-dim
    lambda: torch.randn(3, dtype=torch.complex64).conj(),        # conjugate bit
    lambda: torch.arange(6.).neg().reshape(2, 3)[:, 1],
], ids=["transposed", "strided", "sliced", "zero-size", "0-dim", "conj", "neg-view"])
def test_non_contiguous_and_special_tensors(make):
    t = make()
    out, _ = roundtrip(t)
    assert out.shape == t.shape and out.dtype == t.dtype
    assert torch.equal(out, t.resolve_conj().resolve_neg())
    assert out.is_contiguous()


def test_nested_structures_keep_their_types():
    batch = {
        "img": torch.rand(2, 3, 4, 4),
        "meta": [Point(torch.tensor([1, 2]), "a"), (None, 3.5, "text")],
        "arr": np.arange(10, dtype=np.int16).reshape(2, 5),
        "farr": np.asfortranarray(np.arange(6.0).reshape(2, 3)),
        "empty": np.zeros((0, 3), np.float32),
        "obj": np.array(["a", None], dtype=object),
        "s": "string",
        "n": None,
    }
    out, nbuf = roundtrip(batch)
    assert nbuf == 5  # img, meta tensor, arr, farr, empty; the object array stays in-band
    assert_same(batch, out)
    assert isinstance(out["meta"][0], Point)


def test_received_tensors_and_arrays_are_writable_and_own_their_memory():
    structure, *buffers = encode_batch((torch.zeros(4), np.zeros(3)))
    frames = [bytearray(b) for b in buffers]
    t, a = decode_batch(bytes(structure), frames)
    t += 1
    a += 1
    frames[0][:] = b"\xff" * len(frames[0])  # the frame is reused: the batch must not change
    assert torch.equal(t, torch.ones(4)) and a.tolist() == [1.0, 1.0, 1.0]


def test_requires_grad_survives():
    t = torch.ones(3, requires_grad=True)
    out, _ = roundtrip(t)
    assert out.requires_grad


def test_tensor_memory_is_not_pickled_in_band():
    big = torch.zeros(1 << 20, dtype=torch.uint8)
    structure, *buffers = encode_batch(big)
    assert len(bytes(structure)) < 1024
    assert sum(memoryview(b).nbytes for b in buffers) == 1 << 20


def test_unsupported_tensor_kinds_fall_back_to_torch_pickling():
    sp = torch.eye(3).to_sparse()
    out, _ = roundtrip(sp)
    assert out.is_sparse and torch.equal(out.to_dense(), torch.eye(3))


def test_structure_is_standard_pickle():
    structure, *buffers = encode_batch({"a": 1})
    assert pickle.loads(bytes(structure)) == {"a": 1} and buffers == []


def test_a_tensor_on_a_device_is_refused_with_a_clear_error():
    with pytest.raises(TypeError, match=r"tensor on device meta .*return CPU tensors"):
        encode_batch({"x": torch.empty(2, 3, device="meta")})


# -- layouts: batches of known shapes skip pickle -------------------------------------------

def test_structure_is_standard_pickle_for_anything_but_plain_tensors_and_arrays():
    for batch in ({"a": torch.zeros(2), "name": ["x", "y"]}, Point(torch.zeros(1), torch.ones(1)),
                  [torch.zeros(2), 3], torch.eye(3).to_sparse()):
        structure, *_ = encode_batch(batch)
        assert bytes(structure)[:1] == b"\x80", batch  # a pickle


COLLATED = [
    torch.arange(12, dtype=torch.float32).reshape(3, 4),
    (torch.zeros(4, 3, 2, dtype=torch.uint8), torch.arange(4)),
    {"input_ids": torch.ones(2, 7, dtype=torch.int64), "mask": torch.ones(2, 7, dtype=torch.bool),
     "pixel": [np.arange(6, dtype=np.float16).reshape(2, 3), np.zeros((0, 2), "<i4")]},
    [torch.tensor(3.5), torch.empty(0, 5), torch.arange(6.).reshape(2, 3).t()],
    {"": torch.ones(1, requires_grad=True), "nested": {"deep": (np.asfortranarray(
        np.arange(6.0).reshape(2, 3)), np.array([1, 2], dtype=">i2"))}},
    torch.randn(3, dtype=torch.complex64).conj(),
]


@pytest.mark.parametrize("batch", COLLATED, ids=["tensor", "tuple", "dict", "list", "odd",
                                                 "conj"])
def test_a_batch_of_tensors_and_arrays_travels_as_a_layout_without_pickle(batch, monkeypatch):
    structure, *buffers = encode_batch(batch)
    assert bytes(structure)[:1] == b"\x01"
    import dpex._codec as codec

    codec._LAYOUTS.clear()  # a trainer that never saw this structure: the template comes along

    def no_pickle(*a, **k):
        raise AssertionError("unpickled")

    monkeypatch.setattr(codec.pickle, "loads", no_pickle)
    for _ in range(2):  # parsed once, then from the cache
        out = decode_batch(bytes(structure), [bytes(b) for b in buffers])
        expected = batch.resolve_conj() if isinstance(batch, torch.Tensor) else batch
        assert_same(expected, out)
    assert len(codec._LAYOUTS) == 1


def test_a_layout_carries_each_batchs_own_shapes_and_grad():
    a, *_ = encode_batch(torch.zeros(32, 3))
    b, *bufs = encode_batch(torch.zeros(7, 3, requires_grad=True))  # a last, smaller batch
    out = decode_batch(bytes(b), bufs)
    assert out.shape == (7, 3) and out.requires_grad
    assert bytes(a)[:20] != bytes(b)[:20]  # (another template: requires_grad differs)


def test_layout_tensors_are_zero_copy_views_of_handed_over_frames_and_writable():
    structure, *buffers = encode_batch({"x": torch.arange(8, dtype=torch.int32)})
    frame = np.frombuffer(bytearray(bytes(buffers[0])), dtype=np.uint8)
    out = decode_batch(bytes(structure), [frame])
    assert out["x"].data_ptr() == frame.ctypes.data  # the frame is the tensor's memory
    out["x"].add_(1)
    assert out["x"].tolist() == list(range(1, 9))


@pytest.mark.parametrize("tamper, error", [
    (lambda s, b: (s[:-8], b), "dimensions"),                         # a shape cut short
    (lambda s, b: (s, b + [b"\0" * 4]), "buffers"),                   # a buffer too many
    (lambda s, b: (s[:-8] + (-1).to_bytes(8, "little", signed=True), b), "negative"),
    (lambda s, b: (s.replace(b"float32", b"floatXX"), b), "floatXX"),  # no such dtype
    (lambda s, b: (s, [b[0][:-4]]), "shape"),                          # sizes disagree
])
def test_a_layout_that_does_not_add_up_is_refused_with_an_error_not_a_wrong_batch(tamper, error):
    structure, *buffers = encode_batch(torch.zeros(2, 3))
    s, b = tamper(bytes(structure), [bytes(x) for x in buffers])
    with pytest.raises((ValueError, KeyError, RuntimeError), match=error):
        decode_batch(s, b)


@pytest.mark.parametrize("came", [0, 1], ids=["no-bytes", "one-byte"])
@pytest.mark.parametrize("leaf", [torch.zeros(2, 3), np.zeros((2, 3), dtype=np.float32)],
                         ids=["tensor", "ndarray"])
def test_a_layout_claiming_more_than_its_buffer_holds_allocates_nothing(came, leaf):
    """(issue 48) The shape a message claims is checked against the bytes that came
    before anything is allocated: 2**40 elements is 4 TiB, 0 or 1 byte came."""
    structure, *_ = encode_batch(leaf)
    claimed = bytes(structure)[:-16] + (1 << 20).to_bytes(8, "little") \
        + (1 << 20).to_bytes(8, "little")
    with pytest.raises(ValueError, match=rf"needs 4398046511104 bytes, its buffer holds {came}"):
        decode_batch(claimed, [np.zeros(came, dtype=np.uint8)])
