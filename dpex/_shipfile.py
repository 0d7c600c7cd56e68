"""The pickled loader on its way to the worker hosts: through an anonymous memfd for
those on the trainer's node, through Ray's object store for the others.

Ray's object store keeps the pages of an object once written, for the life of the
Ray instance (freeing the object gives them back to the store, not to the node), and
the trainer that put it counts them in its RSS: a 256 MiB dataset cost the node a
second copy for good, and the trainer 256 MiB. On the trainer's own node there is no
need for it: the trainer writes the pickle into a memfd (:class:`ShipmentFile`), each
host's fork base reads it once (``/proc/<trainer pid>/fd/<fd>``, checked by a random
nonce at its start, as the shared-memory rings are: :mod:`dpex._shm`), and the
trainer closes it once every worker of the iterator has started
(:meth:`Delivery.release_local`). The trainer writes the shipment's parts
(:class:`~dpex._loader_pickle.PickleParts`: the pickle, and its tensors' and arrays' buffers
straight from their memory) and keeps no copy; a base maps the memfd copy-on-write
(:func:`map_shipment`), so the dataset it unpickles is the memfd's pages, which live
as long as the base maps them and no longer.

Since a base maps the memfd, its pages are the dataset's own wherever the shipment is
mostly buffers (tensors, arrays, :class:`~dpex.PackedStrings`): keeping the memfd open
then costs the node nothing more. So a delivery whose in-band pickle is at most
:data:`KEEP_IN_BAND_BYTES` keeps it until the iterator ends (:attr:`Delivery.kept`),
and every worker later started on a host on this node (a replacement, an added
worker, a new host after one was killed) takes it from there, with no pickling and
nothing put in Ray's object store. (Not where no host was given it, nor for bytes this
process shipped before, a later iterator's or a rebuilt loader's: their hosts fork
from the base the first made, which maps that one's memfd, so a new memfd is closed
once the first workers started, as a large pickle's is.) One with a larger pickle (a list of millions of
strings: the memfd would be a second copy beside the objects the base made of it) is
closed once every first worker has started, as before.

A worker that cannot use the memfd (another node, or after it was closed) gets the
object store's copy, put when first needed: from the memfd while it is open, else
pickled again (:class:`Delivery`; a dataset changed since ``iter()`` is logged, and
the workers that start from it see it as it is now).

The host wing's processes, what each holds and when it ends: NOTE [ The worker
host's processes ] in :mod:`dpex.server._fork_base`.
"""

from __future__ import annotations

import fcntl
import logging
import mmap
import os
import secrets
import threading
import weakref
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from dpex._loader_pickle import LEND_IN_BAND_BYTES

__all__ = ["KEEP_IN_BAND_BYTES", "ShipmentRef", "ShipmentFile", "ShipmentUnavailable",
           "Delivery", "map_shipment"]

logger = logging.getLogger("dpex")

_NONCE_BYTES = 16
SEALS = fcntl.F_SEAL_SHRINK | fcntl.F_SEAL_GROW | fcntl.F_SEAL_WRITE | fcntl.F_SEAL_SEAL
_DATA_AT = 64  # the shipment's offset in the memfd (its buffers stay 64-byte aligned)
# The most in-band pickle a delivery keeps its memfd open for (see the docstring): a
# reader lends its buffers up to the same size (dpex._loader_pickle), so those pages are its.
KEEP_IN_BAND_BYTES = LEND_IN_BAND_BYTES


class ShipmentUnavailable(OSError):
    """The trainer's memfd cannot be read here (closed, its number reused, another node,
    mount or PID namespace): the worker's start is not its own failure, and the trainer
    starts it again with the object store's copy (:meth:`Delivery.refuse_local`)."""


@dataclass(frozen=True)
class ShipmentRef:
    """How a host on the trainer's node finds the pickled loader (in its ``WorkerSpec``)."""

    node_id: str  # the trainer's Ray node
    pid: int
    fd: int
    nonce: bytes
    size: int


class ShipmentFile:
    """The trainer's memfd holding one pickled loader; closed by :meth:`close` (or when
    dropped)."""

    def __init__(self, data: Any, node_id: str) -> None:
        """``data``: a :class:`~dpex._loader_pickle.PickleParts` (its parts written in turn) or
        bytes."""
        fd = os.memfd_create(f"dpex-shipment-{os.getpid()}",
                             os.MFD_CLOEXEC | os.MFD_ALLOW_SEALING)
        self._finalizer = weakref.finalize(self, os.close, fd)
        nonce = secrets.token_bytes(_NONCE_BYTES)
        size = 0
        for part in getattr(data, "parts", (data,)):
            view = memoryview(part).cast("B")
            size += view.nbytes
            while view:  # (write() may take less than asked)
                view = view[os.pwrite(fd, view, _DATA_AT + size - view.nbytes):]
        os.pwrite(fd, nonce, 0)
        # A mapping of it never finds the file shorter (SIGBUS) or longer, and nobody
        # writes it again: any process of the trainer's user may open it by its /proc
        # path, and every later worker's dataset is its bytes (a base still maps it
        # copy-on-write: the write seal refuses only shared writable mappings, on every
        # kernel with memfds, 3.17 on). No further seal can be added or removed.
        fcntl.fcntl(fd, fcntl.F_ADD_SEALS, SEALS)
        self.ref = ShipmentRef(node_id, os.getpid(), fd, nonce, size)

    @property
    def open(self) -> bool:
        return self._finalizer.alive

    def read(self) -> bytes:
        """The pickled loader (a copy), while open."""
        return os.pread(self.ref.fd, self.ref.size, _DATA_AT)

    def close(self) -> None:
        self._finalizer()


def _open(ref: ShipmentRef) -> int:
    try:
        fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDONLY | os.O_CLOEXEC)
    except OSError as exc:
        raise ShipmentUnavailable(
            f"cannot open the trainer's copy of the dataset (pid {ref.pid}, fd {ref.fd}): "
            f"{exc}") from exc
    try:
        if os.pread(fd, _NONCE_BYTES, 0) != ref.nonce:
            raise ShipmentUnavailable("the trainer's copy of the dataset is gone (nonce)")
        if fcntl.fcntl(fd, fcntl.F_GET_SEALS) & SEALS != SEALS:
            raise ShipmentUnavailable("the trainer's copy of the dataset is not sealed")
        if os.fstat(fd).st_size != _DATA_AT + ref.size:
            raise ShipmentUnavailable(f"the trainer's copy of the dataset holds "
                                      f"{os.fstat(fd).st_size - _DATA_AT} bytes, not "
                                      f"{ref.size}")
    except OSError as exc:
        os.close(fd)
        if isinstance(exc, ShipmentUnavailable):
            raise
        raise ShipmentUnavailable(f"cannot read the trainer's copy of the dataset: {exc}") from exc
    except BaseException:
        os.close(fd)
        raise
    return fd


def map_shipment(ref: ShipmentRef) -> memoryview:
    """The trainer's pickled loader as a writable copy-on-write mapping of its memfd
    (no copy: what is unpickled from it shares its pages; a write makes a private
    page). The mapping lives as long as a view of it does."""
    fd = _open(ref)
    try:
        mapped = mmap.mmap(fd, _DATA_AT + ref.size, flags=mmap.MAP_PRIVATE,
                           prot=mmap.PROT_READ | mmap.PROT_WRITE)
    except OSError as exc:
        raise ShipmentUnavailable(f"cannot map the trainer's copy of the dataset: {exc}") from exc
    finally:
        os.close(fd)
    return memoryview(mapped)[_DATA_AT:]


class Delivery:
    """One iterator's shipped loader (see the module's docstring). Thread-safe."""

    def __init__(self, data: Any, node_id: str, digest: bytes, *, stored: Any = None,
                 put: Callable[[Any, tuple], Any], repickle: Callable[[], Any],
                 on_stored: Callable[[Any], None] = lambda ref: None,
                 keep: bool = True) -> None:
        """``stored``: the object store's copy of the same bytes, if the loader has one;
        ``put(data, refs)``: stores the bytes with the Ray refs pickled in them
        (:class:`~dpex._spec.PickledLoader` in ``ray.put``); ``repickle()``: the loader
        pickled again, once the memfd
        is closed; ``on_stored(ref)``: told of a copy put here (the loader keeps it for
        its next iterator); ``keep``: the memfd may be kept (not for bytes this
        process shipped before: its hosts' bases map the memfd they were made from, and
        this one would be a second copy)."""
        self.node_id = node_id
        self.digest = digest
        self._refs = tuple(getattr(data, "refs", ()))  # the Ray refs pickled in it
        in_band = getattr(data, "in_band", None)
        # The memfd stays open until the iterator ends (:meth:`close`), if lent.
        self.kept = keep and in_band is not None and in_band <= KEEP_IN_BAND_BYTES
        self._lent = False  # a worker on a host was handed the memfd (:meth:`lend`)
        self._refused = False  # a host could not use it: no worker is handed it again
        self.fallbacks = 0  # worker starts that had to take the object store's copy
        self._file: ShipmentFile | None = ShipmentFile(data, node_id)
        self._stored = stored
        self._put, self._repickle, self._on_stored = put, repickle, on_stored
        self._lock = threading.Lock()

    @property
    def local(self) -> ShipmentRef | None:
        """The memfd, for a host on the trainer's node (None once released)."""
        file = self._file
        return file.ref if file is not None and file.open else None

    def lend(self) -> ShipmentRef | None:
        """:attr:`local`, for a worker on a host: a kept memfd stays open only if a
        host was given it (no host, or workers of their own actors: nobody maps it).
        None once a host could not use it (:meth:`refuse_local`)."""
        ref = None if self._refused else self.local
        if ref is not None:
            self._lent = True
        return ref

    def refuse_local(self) -> None:
        """A host on this node could not use the memfd (gone before its base mapped it,
        another mount or PID namespace): that worker starts again with the object
        store's copy, and so does every later one (counted in :attr:`fallbacks`)."""
        self._refused = True
        self.fallbacks += 1

    def object_ref(self) -> Any:
        """The object store's copy (put now if there is none)."""
        with self._lock:
            if self._stored is None:
                file = self._file
                data = file.read() if file is not None and file.open else self._again()
                self._stored = self._put(data, self._refs)
                self._on_stored(self._stored)
            return self._stored

    def _again(self) -> Any:
        data = self._repickle()
        if data.digest() != self.digest:
            logger.warning(
                "dpex: the dataset changed since this iterator started; the workers "
                "started from now on (replacements, added workers) see it as it is now")
        return data

    def release_local(self) -> None:
        """Close the memfd: every first worker has read it (unless :attr:`kept` and
        lent to a host)."""
        if not (self.kept and self._lent):
            self.close()

    def closer(self) -> Callable[[], None]:
        """:meth:`close`, as a callable that holds only the memfd (not this delivery,
        whose callbacks reach its loader: the iterator's runtime keeps it)."""
        file = self._file
        return file.close if file is not None else (lambda: None)

    def close(self) -> None:
        """Close the memfd, kept or not: the iterator ended (no worker will start)."""
        with self._lock:
            file, self._file = self._file, None
        if file is not None:
            file.close()
