"""Wire codec: a batch ⇄ one pickled structure plus raw out-of-band buffers.

``encode_batch`` pickles the batch structure with protocol 5 (cloudpickle, so
classes defined in ``__main__`` survive the trip) and lifts the memory of every
CPU tensor and plain ndarray out as a separate buffer that can be sent with
``copy=False``. ``decode_batch`` rebuilds each tensor / array with exactly one
copy into fresh, writable memory, so the received frame can be released at once;
a buffer given as a numpy array (a span of a shared-memory ring, a received ZeroMQ
frame) becomes the tensor's memory as it is, unless it is not aligned for the
tensor's dtype (then it is copied).

Torch pickles a tensor's storage in-band even with protocol 5, which is why
tensors get their own reducer here. Tensors this codec does not lift (sparse,
quantized, subclasses) fall back to torch's own pickling. A tensor on a device
(CUDA, ...) is refused with a clear error: a worker's batch must be on the CPU.
"""

from __future__ import annotations

import io
import pickle
from collections.abc import Sequence
from typing import Any

import cloudpickle
import numpy as np
import torch

__all__ = ["encode_batch", "decode_batch", "encode_object"]


def _tensor_bytes(t: torch.Tensor) -> np.ndarray:
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(torch.uint8).numpy()


def _aligned(buf: np.ndarray, itemsize: int) -> bool:
    return buf.ctypes.data % itemsize == 0


def _rebuild_tensor(buf: Any, dtype: torch.dtype, shape: tuple, requires_grad: bool) -> torch.Tensor:
    handed = torch.from_numpy(buf) if isinstance(buf, np.ndarray) else None
    if handed is not None and handed.data_ptr() % dtype.itemsize == 0:
        # memory the caller hands over (a ring span, a received frame): no copy
        out = handed.view(dtype).reshape(shape)
    else:
        out = torch.empty(shape, dtype=dtype)
        src = np.frombuffer(buf, dtype=np.uint8)
        if src.size:
            np.copyto(out.reshape(-1).view(torch.uint8).numpy(), src)
    if requires_grad:
        out.requires_grad_(True)
    return out


def _rebuild_ndarray(buf: Any, dtype: np.dtype, shape: tuple) -> np.ndarray:
    if isinstance(buf, np.ndarray) and _aligned(buf, dtype.itemsize):  # handed over: no copy
        return buf.view(dtype).reshape(shape)
    return np.frombuffer(buf, dtype=np.uint8).copy().view(dtype).reshape(shape)


class _BatchPickler(cloudpickle.Pickler):
    def reducer_override(self, obj: Any) -> Any:
        if isinstance(obj, torch.Tensor) and obj.device.type != "cpu":
            raise TypeError(
                f"the batch holds a tensor on device {obj.device} (shape {tuple(obj.shape)}); "
                "dpex workers send CPU tensors: return CPU tensors from the dataset and "
                "collate_fn and move batches to the device in the training loop "
                "(pin_memory=True makes that copy faster)")
        if type(obj) is torch.Tensor:
            if obj.layout == torch.strided and obj.device.type == "cpu" and not obj.is_quantized:
                raw = pickle.PickleBuffer(_tensor_bytes(obj))
                return _rebuild_tensor, (raw, obj.dtype, tuple(obj.shape), obj.requires_grad)
        elif type(obj) is np.ndarray and not obj.dtype.hasobject:
            raw = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
            return _rebuild_ndarray, (pickle.PickleBuffer(raw), obj.dtype, obj.shape)
        return super().reducer_override(obj)


def encode_batch(obj: Any) -> list[Any]:
    """Return ``[structure, *buffers]``: the pickled structure, then raw buffers.

    The buffers are memoryviews onto the batch's own memory (no copy); they stay
    valid as long as the returned list is alive.
    """
    buffers: list[pickle.PickleBuffer] = []
    out = io.BytesIO()
    _BatchPickler(out, protocol=5, buffer_callback=buffers.append).dump(obj)
    return [out.getbuffer(), *(b.raw() for b in buffers)]


def decode_batch(structure: Any, buffers: Sequence[Any]) -> Any:
    """Inverse of :func:`encode_batch`. Copies each buffer once into fresh memory,
    except ``numpy`` arrays, whose memory the caller hands over to the batch."""
    return pickle.loads(structure, buffers=buffers)


def encode_object(obj: Any) -> bytes:
    """Pickle a small control object in-band (cloudpickle, protocol 5)."""
    return cloudpickle.dumps(obj, protocol=5)
