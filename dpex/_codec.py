"""Wire codec: a batch ⇄ one pickled structure plus raw out-of-band buffers.

``encode_batch`` pickles the batch structure with protocol 5 (cloudpickle, so
classes defined in ``__main__`` survive the trip) and lifts the memory of every
CPU tensor and plain ndarray out as a separate buffer that can be sent with
``copy=False``. ``decode_batch`` rebuilds each tensor / array with exactly one
copy into fresh, writable memory, so the received frame can be released at once;
a buffer given as a numpy array (a span of a shared-memory ring, a received ZeroMQ
frame) becomes the tensor's memory as it is, unless it is not aligned for the
tensor's dtype (then it is copied).

The pickle path is :mod:`dpex._pickling`'s (:data:`~dpex._pickling.BATCH`: every CPU
tensor's and plain ndarray's bytes out of band; tensors it does not lift, sparse,
quantized, subclasses, fall back to torch's own pickling; a tensor on a device, CUDA
or another, is refused with a clear error: a worker's batch must be on the CPU).

Batches of known shapes skip pickle. A batch that is only CPU tensors and plain
ndarrays in tuples, lists and dicts with ``str`` keys (what ``default_collate``
makes of most datasets) is encoded as a *layout*: a short template of its tree
(containers, keys, each leaf's dtype and number of dimensions, JSON) and the
leaves' shapes as int64s, then the same out-of-band buffers::

    0x01  template length:u16  template (JSON)  shapes (int64 each dimension)

The template travels with every batch (tens of bytes), so no message depends on an
earlier one: a lost frame or a replaced worker cannot leave the trainer without it.
The trainer parses a template once (:data:`_LAYOUTS`, keyed by its bytes) and
rebuilds each later batch of it from the shapes alone: no unpickling, no
``find_class``, the leaves rebuilt by the same functions as the pickle path's (zero
copy where the buffer is handed over). A pickle begins with 0x80, so the first byte
tells the two apart. Anything else (a string, a number, a namedtuple, a sparse
tensor) takes the pickle path, as before.
"""

from __future__ import annotations

import io
import json
import math
import pickle
import struct
from collections.abc import Sequence
from typing import Any

import numpy as np
import torch

from dpex._pickling import BATCH, OutOfBandPickler, rebuild_ndarray, rebuild_tensor, tensor_bytes

__all__ = ["encode_batch", "decode_batch"]


def encode_batch(obj: Any) -> list[Any]:
    """Return ``[structure, *buffers]``: the structure (a layout for a batch of known
    shapes, else a pickle), then raw buffers.

    The buffers are memoryviews onto the batch's own memory (no copy); they stay
    valid as long as the returned list is alive.
    """
    laid = _encode_layout(obj)
    if laid is not None:
        return laid
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    OutOfBandPickler(out, buffers, BATCH).dump(obj)
    return [out.getbuffer(), *(b.raw() for b in buffers)]


def decode_batch(structure: Any, buffers: Sequence[Any]) -> Any:
    """Inverse of :func:`encode_batch`. Copies each buffer once into fresh memory,
    except ``numpy`` arrays, whose memory the caller hands over to the batch."""
    if structure[0] == _LAYOUT:
        return _decode_layout(memoryview(structure), buffers)
    return pickle.loads(structure, buffers=buffers)


# -- layouts: batches of known shapes, no pickle ------------------------------------------

_LAYOUT = 0x01  # a layout's first byte (a pickle's is 0x80)
_HEAD = struct.Struct("<BH")  # marker, template length
_MAX_LEAVES = 256  # a bigger tree takes the pickle path (its template would be long)
_MAX_LAYOUTS = 256  # templates each side keeps; past that the cache starts again
_TORCH_DTYPES = {str(v): v for v in vars(torch).values() if isinstance(v, torch.dtype)}
_NUMPY_KINDS = frozenset("biufcmM")  # plain dtypes: no objects, fields or subarrays


def _leaf_key(obj: Any, leaves: list) -> Any:
    """The template of ``obj`` as a hashable tuple (its leaves appended to ``leaves``),
    or None if it is not a tree of plain tensors and arrays."""
    kind = type(obj)
    if kind is torch.Tensor:
        if (obj.layout != torch.strided or obj.device.type != "cpu" or obj.is_quantized):
            return None
        leaves.append(obj)
        return ("T", str(obj.dtype), obj.dim(), obj.requires_grad)
    if kind is np.ndarray:
        if obj.dtype.kind not in _NUMPY_KINDS or obj.dtype.fields or obj.dtype.subdtype:
            return None
        leaves.append(obj)
        return ("A", obj.dtype.str, obj.ndim)
    if kind is tuple or kind is list:
        items = obj
        keys = None
    elif kind is dict:
        keys = tuple(obj)
        if not all(type(k) is str for k in keys):
            return None
        items = obj.values()
    else:
        return None
    subs = []
    for item in items:
        sub = _leaf_key(item, leaves)
        if sub is None or len(leaves) > _MAX_LEAVES:
            return None
        subs.append(sub)
    if keys is not None:
        return ("D", keys, tuple(subs))
    return ("U" if kind is tuple else "L", tuple(subs))


_TEMPLATES: dict[Any, bytes] = {}  # (worker) a tree's key -> its encoded template head


def _encode_layout(obj: Any) -> list[Any] | None:
    leaves: list[Any] = []
    key = _leaf_key(obj, leaves)
    if key is None:
        return None
    head = _TEMPLATES.get(key)
    if head is None:
        template = json.dumps(key, separators=(",", ":")).encode()
        if len(template) > 0xFFFF:
            return None
        if len(_TEMPLATES) >= _MAX_LAYOUTS:
            _TEMPLATES.clear()
        head = _TEMPLATES[key] = _HEAD.pack(_LAYOUT, len(template)) + template
    dims = [d for leaf in leaves for d in leaf.shape]
    body = head + struct.pack(f"<{len(dims)}q", *dims)
    return [body, *(tensor_bytes(x) if type(x) is torch.Tensor
                    else np.ascontiguousarray(x).reshape(-1).view(np.uint8) for x in leaves)]


class _Layout:
    """A parsed template (trainer): rebuilds a batch from its shapes and buffers."""

    def __init__(self, template: Any) -> None:
        self.leaves: list[tuple] = []  # (rebuild, dtype, ndim, requires_grad)
        self.tree = self._compile(template)
        self.ndims = sum(leaf[2] for leaf in self.leaves)
        self.dims = struct.Struct(f"<{self.ndims}q")

    def _compile(self, node: Any) -> Any:
        tag = node[0]
        if tag == "T":
            _, dtype, ndim, grad = node
            self.leaves.append((True, _TORCH_DTYPES[dtype], int(ndim), bool(grad)))
            return len(self.leaves) - 1
        if tag == "A":
            _, dtype, ndim = node
            self.leaves.append((False, np.dtype(dtype), int(ndim), False))
            return len(self.leaves) - 1
        if tag == "D":
            _, keys, subs = node
            if len(keys) != len(subs) or not all(isinstance(k, str) for k in keys):
                raise ValueError("layout: dict keys and values differ")
            return ("D", list(keys), [self._compile(s) for s in subs])
        if tag in ("U", "L"):
            return (tag, [self._compile(s) for s in node[1]])
        raise ValueError(f"layout: unknown node {tag!r}")

    def build(self, dims: Sequence[int], buffers: Sequence[Any]) -> Any:
        if len(buffers) != len(self.leaves):
            raise ValueError(f"layout of {len(self.leaves)} leaves, {len(buffers)} buffers")
        built, at = [], 0
        for (tensor, dtype, ndim, grad), buf in zip(self.leaves, buffers, strict=True):
            shape = tuple(dims[at:at + ndim])
            at += ndim
            size = math.prod(shape) * dtype.itemsize  # (allocated only for bytes that came)
            if memoryview(buf).nbytes != size:
                raise ValueError(f"layout: a leaf of shape {shape} ({dtype}) needs {size} "
                                 f"bytes, its buffer holds {memoryview(buf).nbytes}")
            built.append(rebuild_tensor(buf, dtype, shape, grad) if tensor
                         else rebuild_ndarray(buf, dtype, shape))
        return _assemble(self.tree, built)


def _assemble(node: Any, built: list) -> Any:
    if type(node) is int:
        return built[node]
    if node[0] == "D":
        return {k: _assemble(s, built) for k, s in zip(node[1], node[2], strict=True)}
    items = [_assemble(s, built) for s in node[1]]
    return tuple(items) if node[0] == "U" else items


_LAYOUTS: dict[bytes, _Layout] = {}  # (trainer) template bytes -> parsed


def _decode_layout(body: memoryview, buffers: Sequence[Any]) -> Any:
    _, n = _HEAD.unpack_from(body)
    template = body[_HEAD.size:_HEAD.size + n].tobytes()
    layout = _LAYOUTS.get(template)
    if layout is None:
        layout = _Layout(json.loads(template))
        if len(_LAYOUTS) >= _MAX_LAYOUTS:
            _LAYOUTS.clear()
        _LAYOUTS[template] = layout
    rest = len(body) - _HEAD.size - n
    if rest != layout.dims.size:
        raise ValueError(f"layout of {layout.ndims} dimensions, {rest} bytes of shapes")
    dims = layout.dims.unpack_from(body, _HEAD.size + n)
    if dims and min(dims) < 0:
        raise ValueError(f"layout: a negative dimension in {dims}")
    return layout.build(dims, buffers)


