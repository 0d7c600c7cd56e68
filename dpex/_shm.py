"""Same-node fast path: one shared-memory ring per worker, written by that worker.

The trainer creates each ring as an anonymous ``memfd``. It has no name, so no
file in ``/dev/shm`` can outlive a crash: the kernel frees the memory when the
last process that maps it exits. A worker on the trainer's own Ray node maps it
through ``/proc/<trainer pid>/fd/<fd>`` and checks a random nonce at its start,
so a recycled pid or another pid namespace cannot pass for the trainer.

Layout: the nonce at offset 0, one "freed" byte per ticket slot from offset
1024, and ``capacity`` data bytes from offset 4096.

Copies: the worker's collate writes each batch tensor straight into the ring
(:func:`collating_into`), and the trainer's tensors are views of the ring, so a
batch is copied neither when it is sent nor when it is received. A buffer that
is not in the ring is copied into it (``place``), or sent inline when it is
small or the ring is full: the ring never makes anything wait.

Reuse: each buffer sent through the ring carries a ticket, one of ``TICKETS``
slots, whose byte the trainer sets once the tensor it made from that buffer is
garbage. The worker allocates next-fit around the regions still busy: alive in
the worker, or referred to by a ticket not freed yet. So neither side's tensors
are ever overwritten, and a tensor the training loop keeps (say, a batch's
labels) only takes its own region out of use, not its batch's or the ring's.

Who can read a ring: any process that may open ``/proc/<trainer pid>/fd/<n>``, that
is, of the trainer's uid (or root). That is a read-mode ptrace check, which Yama's
``ptrace_scope`` (1 or 2) does not restrict, although it stops the same process from
attaching a debugger; so on a node where tenants share a uid, each can read and
alter the others' batches in their rings. ``DPEX_SHM_RING=0`` in the environment of
the trainer or of the node's Ray workers turns the rings off there (:func:`rings_off`):
batches then take the authenticated socket, as from other nodes.
"""

from __future__ import annotations

import contextlib
import itertools
import mmap
import os
import secrets
import struct
import threading
import weakref
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any

import numpy as np
import torch

__all__ = ["RingRef", "TrainerRing", "WorkerRing", "RingUnavailable", "RingsOff",
           "DEFAULT_RING_BYTES", "INLINE", "RING_ENV", "rings_off", "collating_into",
           "pack_descriptor", "split_descriptor"]

RING_ENV = "DPEX_SHM_RING"  # "0": no same-node rings in this process (see above)

DEFAULT_RING_BYTES = 64 << 20
# Below this many bytes a buffer that is not in the ring already goes inline: the
# socket copy of a small buffer costs less than the ring's bookkeeping.
MIN_COPY_BYTES = 64 << 10
INLINE = (1 << 64) - 1  # an extent's position for "the next inline frame"
_NONCE = slice(0, 16)
_FLAGS = 1024  # one byte per ticket slot: 1 = the trainer freed that buffer
TICKETS = 3072
_DATA = 4096
_PAGE = mmap.PAGESIZE
_ALIGN = 64
_HEAD = struct.Struct("<II")  # ring_id, n_buffers; then n × _EXTENT
_EXTENT = struct.Struct("<QQQ")  # offset in the ring (or INLINE), size, ticket


class RingUnavailable(Exception):
    """This worker cannot use the trainer's ring; ``str()`` says why (it sends inline)."""


class RingsOff(RingUnavailable, OSError):
    """Rings are turned off in this process (``DPEX_SHM_RING=0``). Also an ``OSError``:
    the trainer treats it as a node without memfd, and that worker uses the socket."""


def rings_off(environ: dict | None = None) -> str | None:
    """Why this process must not use a same-node ring (``DPEX_SHM_RING=0``, for nodes
    where tenants share a uid), or ``None``."""
    value = (os.environ if environ is None else environ).get(RING_ENV, "").strip().lower()
    if value in ("0", "off", "false", "no"):
        return (f"{RING_ENV}={value} here: same-node rings are off (any process of this "
                "uid could open them)")
    return None


@dataclass(frozen=True)
class RingRef:
    """How a worker finds its ring (travels in its ``WorkerSpec``)."""

    ring_id: int
    node_id: str  # the trainer's Ray node: locality is decided by node id only
    pid: int
    fd: int
    nonce: bytes
    capacity: int


def _align(n: int) -> int:
    return max(_ALIGN, (n + _ALIGN - 1) // _ALIGN * _ALIGN)


def pack_descriptor(ring_id: int, extents: Sequence[tuple[int, int, int]]) -> bytes:
    return _HEAD.pack(ring_id, len(extents)) + b"".join(_EXTENT.pack(*e) for e in extents)


def split_descriptor(body: memoryview) -> tuple[int, list[tuple[int, int, int]], memoryview]:
    """A ring message's body → ring id, extents ``(offset, size, ticket)``, and the
    pickled structure."""
    ring_id, n = _HEAD.unpack_from(body)
    at = _HEAD.size + n * _EXTENT.size
    if body.nbytes < at:
        raise ValueError(f"descriptor of {n} buffers truncated")
    extents = [_EXTENT.unpack_from(body, _HEAD.size + i * _EXTENT.size) for i in range(n)]
    return ring_id, extents, body[at:]


class TrainerRing:
    """The trainer's end of one ring: owns the memfd and its mapping.

    ``take`` runs on the loop thread; frees come from whichever thread drops a
    batch's last tensor (one byte write each).
    """

    def __init__(self, ring_id: int, capacity: int, node_id: str, worker_id: int = 0) -> None:
        off = rings_off()
        if off is not None:
            raise RingsOff(off)
        self.capacity = capacity
        self.worker_id = worker_id  # the only worker whose messages may refer to it
        self.retired = False  # its worker was replaced: late messages are dropped
        self._fd = os.memfd_create(f"dpex-ring-{os.getpid()}-{ring_id}", os.MFD_CLOEXEC)
        try:
            os.ftruncate(self._fd, _DATA + capacity)
            self._map: mmap.mmap | None = mmap.mmap(self._fd, _DATA + capacity)
        except BaseException:
            os.close(self._fd)
            raise
        nonce = secrets.token_bytes(16)
        self._map[_NONCE] = nonce
        self._map[_FLAGS:_FLAGS + TICKETS] = b"\x01" * TICKETS  # every ticket slot free
        self._lock = threading.Lock()
        self.ref = RingRef(ring_id, node_id, os.getpid(), self._fd, nonce, capacity)
        self._live: dict[int, tuple[int, int]] = {}  # id -> (pos, size) of viewed spans
        self._span_ids = itertools.count()
        # After close: the mapping, alive only as long as some batch views it.
        self._after_close: weakref.ref[mmap.mmap] | None = None

    def take(self, extents: Sequence[tuple[int, int, int]]) -> list[np.ndarray | None]:
        """Arrays over one message's ring buffers (``None`` for inline ones). Each
        buffer's ticket is freed once its array is garbage. Raises ``ValueError`` for
        a span outside the ring (the caller then releases the tickets)."""
        if any(pos != INLINE and pos + size > self.capacity for pos, size, _ in extents):
            raise ValueError(f"a span of {list(extents)} is outside the ring")
        out: list[np.ndarray | None] = []
        for pos, size, ticket in extents:
            if pos == INLINE:
                out.append(None)
                continue
            arr = np.frombuffer(self._map, np.uint8, size, _DATA + pos)
            span = next(self._span_ids)
            with self._lock:
                self._live[span] = (pos, size)
            weakref.finalize(arr, self._free, ticket, span)
            out.append(arr)
        return out

    def release(self, extents: Sequence[tuple[int, int, int]]) -> None:
        """Free the tickets of a message that will not be read (a bad descriptor)."""
        for pos, _, ticket in extents:
            if pos != INLINE:
                self._free(ticket)

    def _free(self, ticket: int, span: int | None = None) -> None:
        with self._lock:
            where = self._live.pop(span, None) if span is not None else None
            if self._map is not None:
                self._map[_FLAGS + ticket % TICKETS] = 1
            elif where is not None and self._after_close is not None:
                mapping = self._after_close()
                if mapping is not None:
                    self._punch(mapping, *where)  # closed: give its pages back

    def _punch(self, mapping: mmap.mmap, pos: int, size: int) -> None:
        """Give the whole pages inside ``[pos, pos + size)`` (data offsets) back to the
        OS (MADV_REMOVE frees a memfd's pages). Spans never overlap, so no live view
        touches a page wholly inside a free one. Lock held."""
        start = (_DATA + pos + _PAGE - 1) // _PAGE * _PAGE
        end = (_DATA + pos + size) // _PAGE * _PAGE
        if end > start:
            try:
                mapping.madvise(mmap.MADV_REMOVE, start, end - start)
            except (OSError, ValueError, AttributeError):
                pass  # not supported here: the memory goes with the last view

    def close(self) -> None:
        """Close the fd and unmap (idempotent). Batches still alive keep the mapping
        until they are garbage, but only the pages they view keep their memory: the
        rest of the ring is given back now, and each view's pages when it goes."""
        if self._fd < 0:
            return
        os.close(self._fd)
        self._fd = -1
        with self._lock:
            mapping, self._map = self._map, None
            if self._live:
                self._after_close = weakref.ref(mapping)
                # Free everything outside the live views: between them, page by page.
                edges = sorted(self._live.values())
                at = 0
                for pos, size in edges + [(self.capacity, 0)]:
                    if pos > at:
                        self._punch(mapping, at, pos - at)
                    at = max(at, pos + size)
        try:  # outside the lock: a collection here may run a finalizer that takes it
            mapping.close()
        except BufferError:
            pass  # a batch still views it: the mapping (and its fd) go with the batch


class _Region:
    __slots__ = ("start", "end", "alive", "tickets")

    def __init__(self, start: int, end: int) -> None:
        self.start, self.end, self.alive, self.tickets = start, end, True, []


class WorkerRing:
    """The worker's end: maps the trainer's memfd and allocates from it. One thread."""

    def __init__(self, ref: RingRef, node_id: str) -> None:
        off = rings_off()
        if off is not None:  # the node's operator turned them off: not the trainer's choice
            raise RingsOff(off)
        if ref.node_id != node_id:
            raise RingUnavailable("the worker runs on another Ray node than the trainer")
        try:
            fd = os.open(f"/proc/{ref.pid}/fd/{ref.fd}", os.O_RDWR)
        except OSError as exc:
            raise RingUnavailable(f"cannot open the trainer's ring: {exc}") from None
        try:
            if os.fstat(fd).st_size != _DATA + ref.capacity:
                raise RingUnavailable("the trainer's ring has an unexpected size")
            self._map = mmap.mmap(fd, _DATA + ref.capacity)
        finally:
            os.close(fd)  # the mapping keeps the memory
        if self._map[_NONCE] != ref.nonce:
            self._map.close()
            raise RingUnavailable("the ring's nonce does not match (another process?)")
        self.ref = ref
        self.capacity = ref.capacity
        self._next = 0  # next-fit: where the previous allocation ended
        self._ticket = 0
        self._data = np.frombuffer(self._map, np.uint8, ref.capacity, _DATA)
        self._base = self._data.ctypes.data
        self._regions: list[_Region] = []

    def _busy(self, region: _Region) -> bool:
        if region.alive:
            return True
        tickets = region.tickets
        while tickets and self._map[_FLAGS + tickets[-1] % TICKETS]:
            tickets.pop()
        return bool(tickets)

    def allocate(self, nbytes: int) -> np.ndarray | None:
        """A ``uint8`` array of ``nbytes`` in the ring, or ``None`` if there is no room
        now. Its space is not reused while the array (or a view of it) lives here, or
        while a message that referred to it has not been freed by the trainer."""
        size = _align(nbytes)
        if size > self.capacity:
            return None
        self._regions = [r for r in self._regions if self._busy(r)]
        start = self._fit(size, sorted((r.start, r.end) for r in self._regions))
        if start is None:
            return None
        arr = self._data[start:start + nbytes]
        region = _Region(start, start + size)
        self._regions.append(region)
        weakref.finalize(arr, setattr, region, "alive", False)
        self._next = start + size
        return arr

    def _fit(self, size: int, busy: list[tuple[int, int]]) -> int | None:
        """Next fit: the first gap of ``size`` bytes at or after ``_next``, wrapping once."""
        for origin in (self._next, 0):
            pos = origin
            for start, end in busy:
                if end <= pos:
                    continue
                if pos + size <= start:
                    break
                pos = end
            if pos + size <= self.capacity:
                return pos
        return None

    def _region_of(self, buf: Any) -> tuple[_Region, int] | None:
        view = np.frombuffer(buf, np.uint8)
        offset = view.ctypes.data - self._base
        if not 0 <= offset < self.capacity:
            return None
        for region in self._regions:
            if region.alive and region.start <= offset and offset + view.nbytes <= region.end:
                return region, offset
        return None

    def _next_ticket(self) -> int | None:
        """A ticket whose slot the trainer has freed, or ``None`` (a few tries: a slot
        stays taken while the trainer keeps that buffer)."""
        for _ in range(8):
            ticket, self._ticket = self._ticket, self._ticket + 1
            if self._map[_FLAGS + ticket % TICKETS]:
                return ticket
        return None

    def place(self, buffers: Sequence[Any]) -> tuple[bytes, list[Any]]:
        """The descriptor of a message carrying ``buffers``, and the buffers that
        still go inline. Buffers in the ring already are referenced; big ones are
        copied in if there is room. Each buffer in the ring gets its own ticket."""
        extents, inline, copies = [], [], []
        for buf in buffers:
            n = memoryview(buf).nbytes
            found = self._region_of(buf) if n else None
            if found is None and n >= MIN_COPY_BYTES:
                arr = self.allocate(n)
                if arr is not None:
                    copies.append(arr)  # alive until its ticket protects it
                    np.copyto(arr, np.frombuffer(buf, np.uint8))
                    found = self._region_of(arr)
            ticket = self._next_ticket() if found is not None else None
            if ticket is None:
                inline.append(buf)
                extents.append((INLINE, n, 0))
                continue
            region, offset = found
            self._map[_FLAGS + ticket % TICKETS] = 0
            region.tickets.insert(0, ticket)  # newest first; freed from the end
            extents.append((offset, n, ticket))
        return pack_descriptor(self.ref.ring_id, extents), inline

    def close(self) -> None:
        """Unmap (idempotent)."""
        if self._map is None:
            return
        self._regions.clear()
        del self._data
        try:
            self._map.close()
        except BufferError:
            pass  # a batch the dataset kept still views it; unmapped when it goes
        self._map = None


# -- collate straight into the ring ---------------------------------------------------

_active = threading.local()
_torch_new_shared = getattr(torch.UntypedStorage, "_new_shared", None)


def _new_shared(cls: type, size: int, *, device: Any = "cpu") -> Any:
    # torch's default_collate asks for shared memory when it runs in a worker; in a
    # dpex worker that memory is the ring (or, when the ring is full, plain memory:
    # a fresh shared-memory segment per batch costs more than the batch itself).
    if not getattr(_active, "on", False) or torch.device(device).type != "cpu":
        return _torch_new_shared.__func__(cls, size, device=device)
    ring = _active.ring
    arr = ring.allocate(size) if ring is not None and size else None
    if arr is None:
        return cls(size)
    return torch.frombuffer(arr, dtype=torch.uint8).untyped_storage()


@contextlib.contextmanager
def collating_into(ring: WorkerRing | None) -> Iterator[None]:
    """Within this block, on this thread, the shared memory torch's collate asks for
    is allocated in ``ring``, or in plain memory when it is ``None`` or full (the
    batch then goes over the socket, which needs no shared memory)."""
    if _torch_new_shared is None:  # a torch without this hook: its own shared memory
        yield
        return
    if torch.UntypedStorage.__dict__.get("_new_shared") is not _PATCH:
        torch.UntypedStorage._new_shared = _PATCH  # this process is a dpex worker
    _active.ring, _active.on = ring, True
    try:
        yield
    finally:
        _active.ring, _active.on = None, False


_PATCH = classmethod(_new_shared)
