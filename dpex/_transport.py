"""How a batch travels from a worker to its trainer: the seam between the message layer
(:class:`~dpex._protocol.Wire`: header, MAC, frames) and the memory a batch lives in.

A data message's body is ``descriptor + structure``: the transport's own note of where
the batch's buffers are (empty for the socket), then the batch's pickled structure
(:mod:`dpex._codec`); its buffer frames are what the transport sends inline::

    worker:   encode_batch -> transport.place(buffers) -> (descriptor, inline) -> Wire.seal
    trainer:  Wire.open -> transport.take(worker_id, body, inline) -> (structure, buffers)
              -> decode_batch;  transport.release(worker_id, body) for a message not read

Transports, one data kind each (the header's kind says which one carried a message):

- :class:`SocketTransport` (``BATCH``): the buffers are the message's own frames
  (ZeroMQ, zero-copy on both ends: the batch's tensors are views of the received
  frames, which libzmq allocated for this message alone and frees with the tensors).
- :class:`RingTransport` (``RING_BATCH``): the buffers are in the worker's
  shared-memory ring on the trainer's node (:mod:`dpex._shm`); small ones, or all of
  them when the ring is full, go inline.
- :class:`MemoryTransport` (``MEMORY_BATCH``): sender and receiver in one process,
  buffers handed over by reference; for tests (no Ray, no sockets, no shared memory).

:class:`Receiver` decodes every message of the data plane with the transports it was
given; a data kind it has no transport for is rejected (reason ``kind``). A message
whose transport or contents cannot be read here, though it is authentic, becomes an
error in its batch's slot (:func:`undecodable_error`), so an epoch never hangs on it.
"""

from __future__ import annotations

import itertools
import struct
from collections.abc import Iterable, Mapping, Sequence
from typing import Any, Protocol

import numpy as np
from torch._utils import ExceptionWrapper

from dpex._codec import decode_batch, encode_batch
from dpex._protocol import DATA_KINDS, Kind, Message, Wire
from dpex._shm import INLINE, TrainerRing, WorkerRing, split_descriptor
from dpex.errors import ProtocolError

__all__ = ["Transport", "SocketTransport", "RingTransport", "MemoryTransport", "SOCKET",
           "Receiver", "encode_data", "undecodable_error"]


class Unreadable(ValueError):
    """An authentic data message whose buffers this transport cannot find (its batch's
    slot gets an error saying so)."""


class Transport(Protocol):
    """One way a batch's buffers travel.

    ``place`` runs on the worker; ``take`` and ``release`` on the trainer. ``take``
    returns the structure (the body after the descriptor), the batch's buffers in
    order, and whether any came through shared memory; it raises
    :class:`~dpex.errors.ProtocolError` for a message to drop and count, or
    :class:`Unreadable` for one whose slot gets an error. Every buffer a transport
    lends is its own to reclaim once the batch's tensors are garbage.
    """

    kind: Kind

    def place(self, buffers: Sequence[Any]) -> tuple[bytes, list[Any]]: ...

    def take(self, worker_id: int, body: memoryview,
             inline: list[memoryview]) -> tuple[memoryview, list[Any], bool]: ...

    def release(self, worker_id: int, body: memoryview) -> None: ...


class SocketTransport:
    """The buffers are the message's frames: nothing to describe, nothing to release.

    The frames are handed over to the batch (as arrays, which the codec does not copy):
    a received frame is writable memory of its own, kept alive by the tensors that view
    it, so the trainer spends no copy on a batch (the kernel's copy out of the socket is
    the only one, as with raw ZeroMQ)."""

    kind = Kind.BATCH

    def place(self, buffers: Sequence[Any]) -> tuple[bytes, list[Any]]:
        return b"", list(buffers)

    def take(self, worker_id: int, body: memoryview,
             inline: list[memoryview]) -> tuple[memoryview, list[Any], bool]:
        return body, [_handed_over(b) for b in inline], False

    def release(self, worker_id: int, body: memoryview) -> None:
        pass


def _handed_over(frame: memoryview) -> Any:
    """A received frame as an array the batch may own (no copy); a read-only one (bytes,
    in tests) stays a view, which the codec copies."""
    return frame if frame.readonly else np.frombuffer(frame, dtype=np.uint8)


SOCKET = SocketTransport()


class RingTransport:
    """The worker's shared-memory ring: ``sender`` on the worker (its end of the ring),
    ``rings`` on the trainer (every ring of the session, by id; a retired one is a
    replaced worker's, whose late batches are dropped and redone by its successor)."""

    kind = Kind.RING_BATCH

    def __init__(self, *, sender: WorkerRing | None = None,
                 rings: Mapping[int, TrainerRing] | None = None) -> None:
        self.sender = sender
        self.rings = rings if rings is not None else {}

    def place(self, buffers: Sequence[Any]) -> tuple[bytes, list[Any]]:
        assert self.sender is not None, "place() is the worker's side"
        return self.sender.place(buffers)

    def _find(self, body: memoryview) -> tuple[TrainerRing, list[tuple[int, int, int]],
                                               memoryview]:
        try:
            ring_id, extents, structure = split_descriptor(body)
            return self.rings[ring_id], extents, structure
        except (struct.error, ValueError, KeyError) as exc:
            raise Unreadable(f"ring descriptor: {type(exc).__name__}: {exc}") from None

    def take(self, worker_id: int, body: memoryview,
             inline: list[memoryview]) -> tuple[memoryview, list[Any], bool]:
        ring, extents, structure = self._find(body)
        if ring.retired:  # its worker was replaced, and the replacement redoes the task
            ring.release(extents)
            raise ProtocolError("retired-ring", "a batch from a replaced worker's ring")
        try:
            if ring.worker_id != worker_id:
                raise ValueError(f"ring {ring.ref.ring_id} belongs to worker {ring.worker_id}")
            if [n for pos, n, _ in extents if pos == INLINE] != [b.nbytes for b in inline]:
                raise ValueError("inline frames do not match the descriptor")
            spans = ring.take(extents)
        except ValueError as exc:
            ring.release(extents)
            raise Unreadable(f"ring descriptor: {exc}") from None
        frames = iter(inline)
        buffers = [next(frames) if span is None else span for span in spans]
        # The batch's tensors own the ring spans now: each is freed when its tensor goes.
        return structure, buffers, len(buffers) > len(inline)

    def release(self, worker_id: int, body: memoryview) -> None:
        try:
            ring, extents, _ = self._find(body)
        except Unreadable:
            return
        ring.release(extents)


class MemoryTransport:
    """Sender and receiver in one process: the buffers are handed over by reference,
    parked under a token that the descriptor carries (8 bytes). ``parked`` counts the
    batches placed and not yet taken or released."""

    kind = Kind.MEMORY_BATCH
    _TOKEN = struct.Struct("<Q")

    def __init__(self) -> None:
        self._parked: dict[int, list[Any]] = {}
        self._tokens = itertools.count()

    @property
    def parked(self) -> int:
        return len(self._parked)

    def place(self, buffers: Sequence[Any]) -> tuple[bytes, list[Any]]:
        token = next(self._tokens)
        self._parked[token] = list(buffers)
        return self._TOKEN.pack(token), []

    def take(self, worker_id: int, body: memoryview,
             inline: list[memoryview]) -> tuple[memoryview, list[Any], bool]:
        try:
            (token,) = self._TOKEN.unpack_from(body)
            buffers = self._parked.pop(token)
        except (struct.error, KeyError) as exc:
            raise Unreadable(f"memory descriptor: {type(exc).__name__}: {exc}") from None
        return body[self._TOKEN.size:], buffers, True

    def release(self, worker_id: int, body: memoryview) -> None:
        try:
            self._parked.pop(self._TOKEN.unpack_from(body)[0], None)
        except struct.error:
            pass


def encode_data(wire: Wire, epoch: int, seq: int, worker_id: int, batch: Any,
                transport: Transport = SOCKET, ready_ns: int = 0, took_us: int = 0) -> list[Any]:
    """The frames of one batch message, its buffers placed by ``transport``;
    ``ready_ns``: when the batch was ready (``time.time_ns()``), ``took_us``: how long
    the worker worked on it (the header carries both).

    Raises :class:`~dpex.errors.ProtocolError` (reason ``too-large``) when the batch
    is over ``max_message_bytes``: the receiver would drop it.
    """
    body, *buffers = encode_batch(batch)
    size = memoryview(body).nbytes + sum(memoryview(b).nbytes for b in buffers)
    if size > wire.max_message_bytes:
        raise ProtocolError("too-large", f"batch {seq} is {size:,} bytes, over "
                            f"max_message_bytes={wire.max_message_bytes:,}")
    descriptor, inline = transport.place(buffers)
    if descriptor:
        body = descriptor + bytes(body)
    return wire.seal(transport.kind, epoch, seq, worker_id, body, inline, ready_ns, took_us)


class Receiver:
    """Checks and decodes the trainer's data plane: batches by their transport, errors
    and ENDs in-band. Raises only :class:`~dpex.errors.ProtocolError`."""

    def __init__(self, wire: Wire, transports: Iterable[Transport] = (SOCKET,)) -> None:
        self.wire = wire
        self._transports = {t.kind: t for t in transports}

    def decode(self, frames: Sequence[Any], received_at: float | None = None) -> Message:
        """One data message (``received_at``: when it was read, time.monotonic())."""
        env = self.wire.open(frames)
        if env.kind not in DATA_KINDS:
            raise ProtocolError("kind", f"{env.kind.name} on the data plane")
        if env.kind is Kind.END:
            return env.message(None, received_at=received_at)
        if env.kind is Kind.ERROR:
            try:
                return env.message(env.unpickle(), received_at=received_at)
            except Exception as exc:  # a class this process cannot import, say
                return env.message(undecodable_error(env.worker_id, env.seq,
                                                     "worker's exception", exc), Kind.ERROR,
                                   received_at=received_at)
        transport = self._transports.get(env.kind)
        if transport is None:
            raise ProtocolError("kind", f"{env.kind.name}: no such transport here")
        try:
            structure, buffers, shared = transport.take(env.worker_id, env.body, env.buffers)
        except Unreadable as exc:  # authentic, so a worker sent it: an error, not a hang
            return env.message(undecodable_error(env.worker_id, env.seq, "transport", exc),
                               Kind.ERROR, received_at=received_at)
        try:
            payload = decode_batch(structure, buffers)
        except Exception as exc:  # authentic, yet it does not rebuild here
            return env.message(undecodable_error(env.worker_id, env.seq, "batch", exc),
                               Kind.ERROR, received_at=received_at)
        finally:
            del buffers  # the batch's tensors hold what they need of them
        return env.message(payload, Kind.BATCH, in_ring=shared, received_at=received_at)


def undecodable_error(worker_id: int, seq: int, what: str, exc: BaseException) -> ExceptionWrapper:
    """torch's ``ExceptionWrapper`` for a data message whose contents cannot be rebuilt
    here: raised in the training loop in the batch's slot, as torch raises a worker's."""
    wrapper = ExceptionWrapper.__new__(ExceptionWrapper)
    wrapper.exc_type = RuntimeError
    wrapper.exc_msg = (
        f"Traceback unavailable: the {what} of batch {seq} could not be rebuilt in "
        f"the trainer ({type(exc).__name__}: {exc})"
    )
    wrapper.where = f"in DataLoader worker process {worker_id}"
    return wrapper
