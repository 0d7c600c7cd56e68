"""Pickle protocol 5 with the large buffers out of band: one pickler for the batches a
worker sends (:mod:`dpex._codec`) and for the loader the trainer ships
(:mod:`dpex.client._shipping`, framed by :mod:`dpex._loader_pickle`).

cloudpickle (so what the training script defines travels by value), with the memory
of tensors and NumPy arrays handed to ``buffer_callback`` instead of copied into the
pickle. The two uses differ only in what they lift and from what size
(:class:`OutOfBand`):

- **a batch** (:data:`BATCH`): every CPU tensor's own bytes (a view of a larger
  storage sends its part, never the storage) and every plain ndarray, whatever its
  size, rebuilt by :func:`rebuild_tensor` / :func:`rebuild_ndarray` with one copy, or
  none where the receiver hands the buffer over; a tensor on a device is refused (a
  worker's batch must be on the CPU).
- **the shipped loader** (:data:`SHIPMENT`): torch's CPU storages, each once (views
  of one storage still share it after the trip: a pickle memo per storage, where
  torch's own reduction sends each view's storage again, through ``torch.save``), and
  NumPy's arrays by their own protocol-5 reduction, from :data:`OUT_OF_BAND_BYTES`
  on; smaller buffers stay in the pickle.

Torch pickles a tensor's storage in band even with protocol 5, which is why tensors
and storages get reducers here. Tensors neither policy lifts (sparse, quantized,
subclasses) fall back to torch's own pickling.
"""

from __future__ import annotations

import pickle
import sys
from dataclasses import dataclass
from typing import Any

import cloudpickle

__all__ = ["BATCH", "OUT_OF_BAND_BYTES", "SHIPMENT", "OutOfBand", "OutOfBandPickler",
           "rebuild_ndarray", "rebuild_tensor", "storage_buffer", "typed_storage", "the",
           "untyped_storage"]

OUT_OF_BAND_BYTES = 64 * 1024  # the shipped loader's smaller buffers stay in the pickle


@dataclass(frozen=True)
class OutOfBand:
    """What a pickler lifts out of band: each tensor's storage, each once (``storages``),
    else each tensor's and plain ndarray's own bytes (a batch's: a tensor on a device
    is refused); buffers from ``threshold`` bytes on."""

    storages: bool
    threshold: int


BATCH = OutOfBand(storages=False, threshold=0)
SHIPMENT = OutOfBand(storages=True, threshold=OUT_OF_BAND_BYTES)


class OutOfBandPickler(cloudpickle.Pickler):
    """cloudpickle at protocol 5, the buffers ``policy`` lifts appended to ``buffers``
    (each a :class:`pickle.PickleBuffer`, a view of the object's memory: no copy)."""

    def __init__(self, file: Any, buffers: list, policy: OutOfBand) -> None:
        super().__init__(file, protocol=5, buffer_callback=self._out_of_band)
        self.buffers = buffers
        self.policy = policy
        self._storages: dict[tuple[int, int], Any] = {}  # (data_ptr, nbytes) -> first

    def _out_of_band(self, buffer: pickle.PickleBuffer) -> bool:
        """False (out of band, into ``buffers``) from the threshold on; True keeps it in."""
        if buffer.raw().nbytes < self.policy.threshold:
            return True
        self.buffers.append(buffer)
        return False

    def reducer_override(self, obj: Any) -> Any:
        reduced = (self._storage(obj) if self.policy.storages else self._batch_leaf(obj))
        return reduced if reduced is not None else super().reducer_override(obj)

    def _batch_leaf(self, obj: Any) -> tuple | None:
        """A batch's CPU tensor or plain ndarray as its bytes; None for anything else."""
        torch = sys.modules.get("torch")
        if torch is not None and isinstance(obj, torch.Tensor):
            if obj.device.type != "cpu":
                raise TypeError(
                    f"the batch holds a tensor on device {obj.device} (shape "
                    f"{tuple(obj.shape)}); dpex workers send CPU tensors: return CPU tensors "
                    "from the dataset and collate_fn and move batches to the device in the "
                    "training loop (pin_memory=True makes that copy faster)")
            if type(obj) is torch.Tensor and obj.layout == torch.strided \
                    and obj.device.type == "cpu" and not obj.is_quantized:
                raw = pickle.PickleBuffer(tensor_bytes(obj))
                return rebuild_tensor, (raw, obj.dtype, tuple(obj.shape), obj.requires_grad)
            return None
        np = sys.modules.get("numpy")
        if np is not None and type(obj) is np.ndarray and not obj.dtype.hasobject:
            raw = np.ascontiguousarray(obj).reshape(-1).view(np.uint8)
            return rebuild_ndarray, (pickle.PickleBuffer(raw), obj.dtype, obj.shape)
        return None

    def _storage(self, obj: Any) -> tuple | None:
        """A large CPU storage as a pickle buffer, each once (torch's own reduction
        copies it through ``torch.save``); None for anything else."""
        torch = sys.modules.get("torch")
        if torch is None:
            return None
        if isinstance(obj, torch.storage.TypedStorage):  # (its own calls warn)
            untyped = obj._untyped_storage
            if untyped.device.type != "cpu" or untyped.nbytes() < self.policy.threshold:
                return None
            return typed_storage, (untyped, obj.dtype)
        if not isinstance(obj, torch.UntypedStorage) or obj.device.type != "cpu" \
                or obj.nbytes() < self.policy.threshold:
            return None
        first = self._storages.setdefault((obj.data_ptr(), obj.nbytes()), obj)
        if first is not obj:  # another Python object of a storage sent already
            return the, (first,)
        return untyped_storage, (storage_buffer(obj),)


# --- a batch's leaves ----------------------------------------------------------------


def tensor_bytes(t: Any) -> Any:
    """A CPU tensor's own bytes, contiguous, as a uint8 ndarray (a view where it can)."""
    t = t.detach().resolve_conj().resolve_neg()
    if not t.is_contiguous():
        t = t.contiguous()
    return t.reshape(-1).view(sys.modules["torch"].uint8).numpy()


def _aligned(buf: Any, itemsize: int) -> bool:
    return buf.ctypes.data % itemsize == 0


def rebuild_tensor(buf: Any, dtype: Any, shape: tuple, requires_grad: bool) -> Any:
    """A batch's tensor from its bytes: ``buf`` itself where it is an ndarray the
    caller hands over (a ring span, a received frame) and aligned, else one copy."""
    import numpy as np
    import torch

    handed = torch.from_numpy(buf) if isinstance(buf, np.ndarray) else None
    if handed is not None and handed.data_ptr() % dtype.itemsize == 0:
        out = handed.view(dtype).reshape(shape)  # handed over: no copy
    else:
        out = torch.empty(shape, dtype=dtype)
        src = np.frombuffer(buf, dtype=np.uint8)
        if src.size:
            np.copyto(out.reshape(-1).view(torch.uint8).numpy(), src)
    if requires_grad:
        out.requires_grad_(True)
    return out


def rebuild_ndarray(buf: Any, dtype: Any, shape: tuple) -> Any:
    """A batch's ndarray from its bytes (as :func:`rebuild_tensor`)."""
    import numpy as np

    if isinstance(buf, np.ndarray) and _aligned(buf, dtype.itemsize):  # handed over: no copy
        return buf.view(dtype).reshape(shape)
    return np.frombuffer(buf, dtype=np.uint8).copy().view(dtype).reshape(shape)


# --- the shipped loader's storages ----------------------------------------------------


def storage_buffer(storage: Any) -> pickle.PickleBuffer:
    """A CPU ``torch.UntypedStorage``'s bytes as a pickle buffer (no copy)."""
    import torch

    return pickle.PickleBuffer(torch.empty(0, dtype=torch.uint8).set_(storage).numpy())


def untyped_storage(buffer: Any) -> Any:
    """An ``UntypedStorage`` over ``buffer`` (a view of the shipment, or a copy)."""
    import torch

    return torch.frombuffer(buffer, dtype=torch.uint8).untyped_storage()


def typed_storage(untyped: Any, dtype: Any) -> Any:
    import torch

    return torch.storage.TypedStorage(wrap_storage=untyped, dtype=dtype, _internal=True)


def the(obj: Any) -> Any:
    """``obj`` itself: what a second Python object of an already pickled storage
    becomes (the memo holds the first)."""
    return obj
