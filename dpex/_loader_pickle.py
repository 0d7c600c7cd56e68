"""The pickled loader with its large buffers out of band (pickle protocol 5).

Pickling a 256 MiB tensor copied it twice on the trainer (torch pickles a storage
through ``torch.save`` into a ``BytesIO``) and unpickling copied it again in the fork
base: 1.5 s of the first batch, for bytes that need no transformation. Here the
tensors' storages and NumPy's arrays of at least
:data:`~dpex._pickling.OUT_OF_BAND_BYTES` travel as pickle-5 buffers beside the
pickle (pickled by :mod:`dpex._pickling`), in one frame (:class:`PickleParts`):

    MAGIC, header length, header (JSON: the pickle's and each buffer's offset and
    length, and the trainer's state, :mod:`dpex._process_state`), the pickle, then
    each buffer at an offset aligned to :data:`ALIGN`

The trainer's state rides in the header because it must be applied before the
dataset is unpickled (its directory, its environment), and it is never itself
unpickled: :func:`loads` hands it to its ``enter`` first.

The trainer writes the parts straight from the tensors' memory into the memfd
(:mod:`dpex._shipfile`), with no copy of its own. A fork base maps the memfd
copy-on-write and unpickles the buffers as views of the mapping: the dataset's
tensors and arrays are the memfd's pages, shared by the base's forks, and a worker
that writes to its copy gets private pages, as a forked torch worker does. From a
read-only source (Ray's object store, bytes) each buffer is copied once, which is
what unpickling cost before.

Views of one storage travel once (a pickle memo per storage), where ``pickle`` and
torch's own reduction sent each view's storage again.

Change detection (:meth:`PickleParts.digest`): XXH3-128 of every part, ~20 GB/s here
(BLAKE2b of the pickle took 0.33 s for 256 MiB); the digest keys a host's unpickled
copy, so a dataset changed in place between iterators gets another key, never a
stale copy. It is not a MAC: the shipment crosses only to the trainer's own workers,
by a channel they authenticated.
"""

from __future__ import annotations

import json
import pickle
import struct
from collections.abc import Callable, Iterable
from typing import Any

import xxhash

__all__ = ["ALIGN", "LEND_IN_BAND_BYTES", "MAGIC", "PickleParts", "ViewReader", "loads"]

MAGIC = b"DPEXOOB1"
_LENGTH = struct.Struct("<I")
ALIGN = 64  # each buffer's offset in the shipment (and in the memfd's data)
# The largest in-band pickle whose source lends its buffers: a view keeps its whole
# source alive (the memfd, pickle included), so past this the buffers are copied and
# the source can go once unpickled (a list of millions of strings beside an array).
LEND_IN_BAND_BYTES = 16 * 1024 * 1024


class PickleParts:
    """A pickled loader as its parts (bytes-like, not joined) and the Ray object refs
    pickled in it; ``nbytes`` in all, ``out_of_band`` of them its buffers'."""

    __slots__ = ("parts", "nbytes", "refs", "out_of_band", "libraries")

    def __init__(self, parts: Iterable[Any], refs: Iterable[Any] = (),
                 out_of_band: int = 0, libraries: tuple[str, ...] = ()) -> None:
        self.parts = [memoryview(part).cast("B") for part in parts]
        self.nbytes = sum(part.nbytes for part in self.parts)
        self.refs = tuple(refs)
        self.out_of_band = out_of_band
        self.libraries = libraries  # installed libraries its classes and functions are of

    @classmethod
    def framed(cls, data: bytes, buffers: list[Any], refs: Iterable[Any] = (),
               trainer: dict | None = None, libraries: tuple[str, ...] = ()) -> PickleParts:
        """The parts of a shipment: the frame of the pickle ``data``, the ``trainer``'s
        state (JSON-ready, :meth:`~dpex._process_state.TrainerState.head`) and the
        out-of-band ``buffers`` (each a :class:`pickle.PickleBuffer`), padded so that
        every buffer starts at a multiple of :data:`ALIGN`."""
        return cls(_frame(data, buffers, trainer), refs=refs,
                   out_of_band=sum(buffer.raw().nbytes for buffer in buffers),
                   libraries=libraries)

    @property
    def in_band(self) -> int:
        """The bytes that unpickling turns into objects (the rest it maps as they are)."""
        return self.nbytes - self.out_of_band

    def digest(self) -> bytes:
        """16 bytes that change when any byte does (XXH3-128)."""
        h = xxhash.xxh3_128()
        for part in self.parts:
            h.update(part)
        return h.digest()

    def __len__(self) -> int:
        return self.nbytes

    def __bytes__(self) -> bytes:
        return b"".join(self.parts)


def _frame(data: bytes, buffers: list[Any], trainer: dict | None) -> list[Any]:
    """:meth:`PickleParts.framed`'s parts."""
    views = [buffer.raw() for buffer in buffers]
    extra = {} if trainer is None else {"trainer": trainer}
    # The header's length depends on the offsets it lists: lay out with room for it.
    entries: list[list[int]] = []
    head_room = 64 + 48 * (len(views) + 1) + len(json.dumps(extra))
    start = len(MAGIC) + _LENGTH.size + head_room
    at = start + len(data)
    for view in views:
        at += -at % ALIGN
        entries.append([at, view.nbytes])
        at += view.nbytes
    header = json.dumps({"pickle": [start, len(data)], "buffers": entries, **extra}).encode()
    if len(header) > head_room:  # (cannot happen: each entry is under 48 bytes)
        raise ValueError("dpex: the shipment's header outgrew its room")
    header = header.ljust(head_room)
    parts: list[Any] = [MAGIC + _LENGTH.pack(len(header)) + header, data]
    at = start + len(data)
    for (offset, _), view in zip(entries, views, strict=True):
        if offset - at:
            parts.append(bytes(offset - at))
        parts.append(view)
        at = offset + view.nbytes
    return parts


def loads(data: Any, *, lend: bool | None = None,
          unpickler: type[pickle.Unpickler] | None = None,
          enter: Callable[[dict], None] | None = None) -> Any:
    """Unpickle a loader's pickle, framed (see the module's docstring) or plain, after
    handing the trainer's state the frame carries to ``enter`` (a plain pickle carries
    none). A
    writable ``data`` (the memfd mapped copy-on-write) lends its buffers to what is
    rebuilt, where its pickle is at most :data:`LEND_IN_BAND_BYTES` (``lend=True``: at
    any size, for a source kept as long as what is rebuilt from it); otherwise (a
    read-only source, a large pickle) each buffer is copied once. ``unpickler``: a
    ``pickle.Unpickler`` subclass to unpickle with (default: ``pickle.loads``).

    A lent tensor's storage cannot be resized (``resize_()`` raises, as on a tensor
    from ``torch.frombuffer``)."""
    view = memoryview(data).cast("B")
    if bytes(view[:len(MAGIC)]) != MAGIC:
        return _unpickle(view, None, unpickler)
    (n,) = _LENGTH.unpack_from(view, len(MAGIC))
    at = len(MAGIC) + _LENGTH.size
    header = json.loads(bytes(view[at:at + n]))
    if enter is not None and "trainer" in header:
        enter(header["trainer"])
    start, length = header["pickle"]
    buffers = [view[offset:offset + size] for offset, size in header["buffers"]]
    if view.readonly or (length > LEND_IN_BAND_BYTES and not lend):
        buffers = [_writable_copy(buffer) for buffer in buffers]
    return _unpickle(view[start:start + length], buffers, unpickler)


def _unpickle(view: memoryview, buffers: list | None,
              unpickler: type[pickle.Unpickler] | None) -> Any:
    if unpickler is None:
        return pickle.loads(view, buffers=buffers)
    return unpickler(ViewReader(view), buffers=buffers).load()


class ViewReader:
    """A read-only file over a bytes-like object, for ``pickle.Unpickler`` (which takes a
    file; ``io.BytesIO`` would copy the whole pickle first)."""

    def __init__(self, data: Any) -> None:
        self._view = memoryview(data).cast("B")
        self._at = 0

    def read(self, n: int = -1) -> bytes:
        end = len(self._view) if n is None or n < 0 else min(self._at + n, len(self._view))
        data = bytes(self._view[self._at:end])
        self._at = end
        return data

    def readinto(self, buffer: Any) -> int:
        target = memoryview(buffer).cast("B")
        n = min(len(target), len(self._view) - self._at)
        target[:n] = self._view[self._at:self._at + n]
        self._at += n
        return n

    def readline(self) -> bytes:
        rest = self._view[self._at:]
        end = bytes(rest[:4096]).find(b"\n")  # (pickle's text opcodes: short lines)
        if end < 0:
            end = bytes(rest).find(b"\n")
        n = len(rest) if end < 0 else end + 1
        return self.read(n)


def _writable_copy(view: memoryview) -> Any:
    import numpy as np

    copy = np.empty(view.nbytes, dtype=np.uint8)  # (aligned, unlike a bytearray)
    copy[:] = np.frombuffer(view, dtype=np.uint8)
    return copy
