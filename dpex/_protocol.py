"""Message protocol between a trainer session and its workers.

Every message is a ZeroMQ multipart message::

    [header, mac, body, *buffers]

``header`` is a fixed 40-byte struct (little endian)::

    version:u8  kind:u8  session_id:16s  epoch:u32  seq:i64  worker_id:u16
    incarnation:u32  n_buffers:u32

``incarnation`` is the sender's (0 for a worker id's first process, +1 per
replacement; 0 from the trainer): a batch a replaced worker sent late is
recognised by it on every transport.

``seq`` is a data message's batch number; in a control message from the trainer it
numbers the messages sent to one worker incarnation (0, 1, 2, ...), and the worker
accepts each number once, in increasing order (``_security.ControlFreshness``).

``mac`` is a keyed BLAKE2b digest (16 bytes) over the header, the body and the
size of every buffer, under the session key that the trainer gives its workers
through Ray (never on a ZeroMQ port). ``body`` is a pickle (protocol 5) and
``buffers`` are the raw out-of-band buffers it refers to (see ``_codec``); only
data messages carry buffers.

Decoding checks, in this order and before anything is unpickled: the frame
count, the header, the protocol version, the session id, the kind, the total
size against ``max_message_bytes``, then the MAC. A buffer's bytes are not
hashed (a MAC over gigabytes would cost more than the copy); they are only ever
copied into tensors and arrays, never unpickled, and the MAC pins their sizes.

Data plane (worker PUSH → trainer PULL): ``BATCH``, ``RING_BATCH``, ``ERROR``
(a wrapped exception in the batch's slot) and ``END`` (an IterableDataset worker
is exhausted; the task's slot holds no batch). A ``RING_BATCH`` is a batch whose
buffers a worker on the trainer's node wrote into its shared-memory ring (see
``_shm``): its body is the ring descriptor followed by the pickled structure,
and it has no buffer frames; it decodes to a ``BATCH``.

Control plane (trainer ROUTER ⇄ worker DEALER): ``HELLO`` (worker → trainer,
once, carries versions and placement), ``TASKS`` (a list of ``(seq, indices)``),
``RESUME`` (start epoch ``epoch`` on persistent workers), ``SKIP`` (a replacement
worker passes over the first ``payload`` batches of its IterableDataset shard,
which its predecessor already delivered), ``STOP`` and ``PING`` (sent every
``PING_INTERVAL_S`` while the trainer lives; a worker whose session hears nothing
for its session timeout ends that session, so a vanished trainer frees it).

Decoding never raises anything but :class:`~dpex.errors.ProtocolError`, whose
``reason`` names why the message was rejected.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import pickle
import secrets
import struct
from collections.abc import Mapping, Sequence
from dataclasses import dataclass, replace
from typing import Any

from torch._utils import ExceptionWrapper

from dpex._codec import decode_batch, encode_batch, encode_object
from dpex._shm import INLINE, TrainerRing, WorkerRing, split_descriptor
from dpex.errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Kind",
    "Message",
    "Wire",
    "worker_identity",
]

PROTOCOL_VERSION = 4
_HEADER = struct.Struct("<BB16sIqHII")
HEADER_SIZE = _HEADER.size
MAC_SIZE = 16
KEY_SIZE = 32
DEFAULT_MAX_MESSAGE_BYTES = 2 << 30  # 2 GiB
PING_INTERVAL_S = 1.0


class Kind(enum.IntEnum):
    BATCH = 1
    ERROR = 2
    END = 3
    RING_BATCH = 4
    HELLO = 10
    TASKS = 11
    RESUME = 12
    STOP = 13
    SKIP = 14
    PING = 15


@dataclass(frozen=True)
class Message:
    kind: Kind
    session_id: bytes
    epoch: int
    seq: int
    worker_id: int
    payload: Any = None
    in_ring: bool = False  # a batch whose buffers (some or all) came through the ring
    incarnation: int = 0  # the sender's


def worker_identity(worker_id: int, incarnation: int) -> bytes:
    """The ZeroMQ identity of one incarnation of a worker: a replacement never
    shares its predecessor's route."""
    return b"w%d.%d" % (worker_id, incarnation)


def _nbytes(frame: Any) -> int:
    return memoryview(frame).nbytes


@dataclass(frozen=True)
class Wire:
    """Encodes and checks the messages of one session: its id, its key, its size limit.

    Pure (no I/O); the same object serves the trainer and its workers.
    """

    session_id: bytes
    key: bytes
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    incarnation: int = 0  # what this side writes in its headers (a worker's own)

    @classmethod
    def new(cls, max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES) -> Wire:
        """A fresh session: random id and key."""
        return cls(secrets.token_bytes(16), secrets.token_bytes(KEY_SIZE), max_message_bytes)

    def _mac(self, header: Any, body: Any, buffers: Sequence[Any]) -> bytes:
        mac = hashlib.blake2b(key=self.key, digest_size=MAC_SIZE)
        mac.update(header)
        mac.update(struct.pack(f"<Q{len(buffers)}Q", _nbytes(body),
                               *(_nbytes(b) for b in buffers)))
        mac.update(body)
        return mac.digest()

    def _frames(self, kind: Kind, epoch: int, seq: int, worker_id: int, body: Any,
                buffers: Sequence[Any]) -> list[Any]:
        header = _HEADER.pack(PROTOCOL_VERSION, kind, self.session_id, epoch, seq, worker_id,
                              self.incarnation, len(buffers))
        return [header, self._mac(header, body, buffers), body, *buffers]

    def encode(self, kind: Kind, epoch: int = 0, seq: int = -1, worker_id: int = 0,
               payload: Any = None) -> list[Any]:
        """A message whose payload is pickled in-band (control messages, errors, END)."""
        return self._frames(kind, epoch, seq, worker_id, encode_object(payload), [])

    def encode_data(self, epoch: int, seq: int, worker_id: int, batch: Any,
                    ring: WorkerRing | None = None) -> list[Any]:
        """A ``BATCH`` message: the structure in-band, tensor memory as separate frames;
        or, given the worker's ``ring``, a ``RING_BATCH`` whose buffers are in the ring
        where they fit (see ``WorkerRing.place``) and inline frames otherwise.

        Raises :class:`ProtocolError` (reason ``too-large``) when the message would
        exceed ``max_message_bytes``: the receiver would drop it.
        """
        body, *buffers = encode_batch(batch)
        size = _nbytes(body) + sum(_nbytes(b) for b in buffers)
        if size > self.max_message_bytes:
            raise ProtocolError("too-large", f"batch {seq} is {size:,} bytes, over "
                                f"max_message_bytes={self.max_message_bytes:,}")
        if ring is not None:
            descriptor, inline = ring.place(buffers)
            return self._frames(Kind.RING_BATCH, epoch, seq, worker_id,
                                descriptor + bytes(body), inline)
        return self._frames(Kind.BATCH, epoch, seq, worker_id, body, buffers)

    def decode(self, frames: Sequence[Any],
               rings: Mapping[int, TrainerRing] | None = None) -> Message:
        """Check and decode one multipart message (``bytes`` or ``zmq.Frame`` parts).

        ``rings`` are the session's shared-memory rings, by id; a ``RING_BATCH`` is
        copied out of its ring, whose space is then released.
        """
        if len(frames) < 3:
            raise ProtocolError("frame-count", f"{len(frames)} frames, at least 3 expected")
        head = memoryview(frames[0])
        if head.nbytes != HEADER_SIZE:
            raise ProtocolError("header", f"{head.nbytes} bytes, {HEADER_SIZE} expected")
        version, kind, sid, epoch, seq, worker_id, incarnation, n = _HEADER.unpack(head)
        if version != PROTOCOL_VERSION:
            raise ProtocolError("version",
                                f"protocol {version}, this side speaks {PROTOCOL_VERSION}")
        if sid != self.session_id:
            raise ProtocolError("session", "message of another session")
        try:
            kind = Kind(kind)
        except ValueError:
            raise ProtocolError("kind", f"unknown message kind {kind}") from None
        if len(frames) != 3 + n:
            raise ProtocolError("frame-count", f"{len(frames)} frames, header says {3 + n}")
        body, buffers = memoryview(frames[2]), [memoryview(f) for f in frames[3:]]
        size = body.nbytes + sum(b.nbytes for b in buffers)
        if size > self.max_message_bytes:
            raise ProtocolError("too-large", f"{size:,} bytes")
        if not hmac.compare_digest(memoryview(frames[1]).tobytes(), self._mac(head, body, buffers)):
            raise ProtocolError("mac", "authentication failed")
        if kind is Kind.RING_BATCH:
            return replace(self._decode_ring(body, buffers, rings or {}, sid, epoch, seq,
                                             worker_id), incarnation=incarnation)
        try:
            if kind is Kind.BATCH:
                payload = decode_batch(body, buffers)
            else:
                payload = pickle.loads(body)
        except Exception as exc:  # authentic, yet it does not unpickle here
            if kind not in (Kind.BATCH, Kind.ERROR):
                raise ProtocolError("body", f"{type(exc).__name__}: {exc}") from None
            # A batch or a worker error whose contents cannot be rebuilt here (a class
            # this process cannot import, say): the slot gets an error that says so,
            # so the epoch neither hangs nor silently skips it.
            what = "batch" if kind is Kind.BATCH else "worker's exception"
            return Message(Kind.ERROR, sid, epoch, seq, worker_id,
                           undecodable_error(worker_id, seq, what, exc), incarnation=incarnation)
        return Message(kind, sid, epoch, seq, worker_id, payload, incarnation=incarnation)

    def _decode_ring(self, body: memoryview, inline: list[memoryview],
                     rings: Mapping[int, TrainerRing], sid: bytes, epoch: int, seq: int,
                     worker_id: int) -> Message:
        try:
            ring_id, extents, structure = split_descriptor(body)
            ring = rings[ring_id]
        except (struct.error, ValueError, KeyError) as exc:
            # Authentic, so a worker sent it: an error in the batch's slot, not a hang.
            return Message(Kind.ERROR, sid, epoch, seq, worker_id,
                           undecodable_error(worker_id, seq, "ring descriptor", exc))
        if ring.retired:  # its worker was replaced, and the replacement redoes the task
            ring.release(extents)
            raise ProtocolError("retired-ring", f"batch {seq} from a replaced worker's ring")
        try:
            if ring.worker_id != worker_id:
                raise ValueError(f"ring {ring_id} belongs to worker {ring.worker_id}")
            if [n for pos, n, _ in extents if pos == INLINE] != [b.nbytes for b in inline]:
                raise ValueError("inline frames do not match the descriptor")
            spans = ring.take(extents)
        except ValueError as exc:
            ring.release(extents)
            return Message(Kind.ERROR, sid, epoch, seq, worker_id,
                           undecodable_error(worker_id, seq, "ring descriptor", exc))
        frames = iter(inline)
        buffers = [next(frames) if span is None else span for span in spans]
        in_ring = len(buffers) > len(inline)
        del spans  # the batch's tensors own the ring spans now: freed when they go
        try:
            payload = decode_batch(structure, buffers)
        except Exception as exc:
            return Message(Kind.ERROR, sid, epoch, seq, worker_id,
                           undecodable_error(worker_id, seq, "batch", exc))
        return Message(Kind.BATCH, sid, epoch, seq, worker_id, payload, in_ring)


def undecodable_error(worker_id: int, seq: int, what: str, exc: BaseException) -> ExceptionWrapper:
    """An ``ExceptionWrapper`` for a data message whose body cannot be unpickled here."""
    wrapper = ExceptionWrapper.__new__(ExceptionWrapper)
    wrapper.exc_type = RuntimeError
    wrapper.exc_msg = (
        f"Traceback unavailable: the {what} of batch {seq} could not be rebuilt in "
        f"the trainer ({type(exc).__name__}: {exc})"
    )
    wrapper.where = f"in DataLoader worker process {worker_id}"
    return wrapper
