"""Message protocol between a trainer session and its workers.

Every message is a ZeroMQ multipart message::

    [header, mac, body, *buffers]

``header`` is a fixed 52-byte struct (little endian)::

    version:u8  kind:u8  session_id:16s  epoch:u32  seq:i64  worker_id:u16
    incarnation:u32  n_buffers:u32  ready_ns:i64  took_us:u32

``ready_ns`` is the sender's wall clock (``time.time_ns()``) when a batch was
ready (fetched and collated, before it was encoded); 0 in every other message.
The trainer reads the batch's latency from it (``stats()["batch_latency"]``).
``took_us`` is how long the worker's compute thread worked on that batch (from
taking the task to the batch being ready, microseconds, measured on the worker's
own clock); 0 in every other message. It is the workers' time per batch that
the autoscaler and the lost-batch limit use: the trainer reads batches when its
training thread asks for them, so when a batch arrived is not known there.

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

Data plane (worker PUSH → trainer PULL): a batch (``BATCH``, ``RING_BATCH`` or
``MEMORY_BATCH``: the kind names the transport that carried its buffers, see
:mod:`dpex._transport`, which encodes and decodes them), ``ERROR`` (a wrapped
exception in the batch's slot) and ``END`` (an IterableDataset worker is
exhausted; the task's slot holds no batch).

Control plane (trainer ROUTER ⇄ worker DEALER): ``HELLO`` (worker → trainer,
once, carries versions and placement), ``TASKS`` (``(tasks, marks)``: a list of ``(seq, indices)`` and the RESUME and SKIP
sent to the worker this epoch, see :mod:`dpex._epoch_marks`),
``RESUME`` (start epoch ``epoch`` on persistent workers), ``SKIP`` (a replacement
worker passes over the first ``payload`` batches of its IterableDataset shard,
which its predecessor already delivered), ``RNG_QUERY`` (the worker's RNG states right after it computed batch ``payload``
of epoch ``epoch``, for ``DpexDataLoader.state_dict()``; the worker answers
``RNG_STATE`` with ``seq`` = that batch), ``STOP`` and ``PING`` (sent every
``PING_INTERVAL_S`` while the trainer lives; a worker whose session hears nothing
for its session timeout ends that session, so a vanished trainer frees it), and
``PROGRESS`` (worker → trainer, every ``PROGRESS_INTERVAL_S``: ``seq`` is the batch
its compute thread works on, ``IDLE`` or ``LOADING``, and ``payload`` (how many seconds
it has worked on it, the items queued, the report's number in the session: the
trainer takes each number once, in increasing order); a worker that computes is told
from one that is wedged or lost a frame, see :mod:`dpex.client._lost`).

This module frames and authenticates (:meth:`Wire.open`); it unpickles only
in-band payloads (:meth:`Wire.decode`, the control plane). Opening never raises
anything but :class:`~dpex.errors.ProtocolError`, whose ``reason`` names why the
message was rejected.
"""

from __future__ import annotations

import enum
import hashlib
import hmac
import pickle
import secrets
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from dpex.errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "DEFAULT_MAX_MESSAGE_BYTES",
    "Kind",
    "DATA_KINDS",
    "Message",
    "Envelope",
    "Wire",
    "worker_identity",
    "PROGRESS_INTERVAL_S",
    "IDLE",
    "LOADING",
]

def encode_object(obj: Any) -> bytes:
    """Pickle a small control object in-band (cloudpickle, protocol 5)."""
    import cloudpickle  # (a worker host's control plane needs no torch: dpex._codec's does)

    return cloudpickle.dumps(obj, protocol=5)


PROTOCOL_VERSION = 10  # 8: PROGRESS; 9: took_us, batches as layouts (dpex._codec); 10: PROGRESS numbered
_HEADER = struct.Struct("<BB16sIqHIIqI")
HEADER_SIZE = _HEADER.size
MAC_SIZE = 16
KEY_SIZE = 32
DEFAULT_MAX_MESSAGE_BYTES = 2 << 30  # 2 GiB
PING_INTERVAL_S = 1.0
PROGRESS_INTERVAL_S = 1.0
IDLE, LOADING = -1, -2  # PROGRESS's seq when the worker computes no batch / loads its dataset


class Kind(enum.IntEnum):
    BATCH = 1
    ERROR = 2
    END = 3
    RING_BATCH = 4
    MEMORY_BATCH = 5
    HELLO = 10
    TASKS = 11
    RESUME = 12
    STOP = 13
    SKIP = 14
    PING = 15
    RNG_QUERY = 16
    RNG_STATE = 17
    PROGRESS = 18


_KINDS = {int(k): k for k in Kind}  # (a dict lookup: Kind(n) costs µs per message)
# What a worker sends its trainer's data socket: batches (by transport), errors, ENDs.
DATA_KINDS = frozenset({Kind.BATCH, Kind.RING_BATCH, Kind.MEMORY_BATCH, Kind.ERROR, Kind.END})


@dataclass(frozen=True)
class Message:
    kind: Kind
    session_id: bytes
    epoch: int
    seq: int
    worker_id: int
    payload: Any = None
    in_ring: bool = False  # a batch whose buffers (some or all) came through shared memory
    incarnation: int = 0  # the sender's
    received_at: float | None = None  # time.monotonic() when the trainer's loop got it
    ready_ns: int = 0  # the worker's time.time_ns() when the batch was ready (0: not a batch)
    took_us: int = 0  # the worker's time on the batch (0: not a batch, or not measured)


class Envelope:
    """An authenticated message, not unpickled: its header fields, its body and its
    buffer frames (views of the received frames). (A plain class with slots: one is
    made per batch, and a frozen dataclass costs several µs to build.)"""

    __slots__ = ("kind", "session_id", "epoch", "seq", "worker_id", "incarnation", "body",
                 "buffers", "ready_ns", "took_us")

    def __init__(self, kind: Kind, session_id: bytes, epoch: int, seq: int, worker_id: int,
                 incarnation: int, body: memoryview, buffers: list[memoryview],
                 ready_ns: int = 0, took_us: int = 0) -> None:
        self.kind, self.session_id, self.epoch, self.seq = kind, session_id, epoch, seq
        self.worker_id, self.incarnation, self.body = worker_id, incarnation, body
        self.buffers, self.ready_ns, self.took_us = buffers, ready_ns, took_us

    def unpickle(self) -> Any:
        return pickle.loads(self.body)

    def message(self, payload: Any, kind: Kind | None = None, in_ring: bool = False,
                received_at: float | None = None) -> Message:
        return Message(kind or self.kind, self.session_id, self.epoch, self.seq,
                       self.worker_id, payload, in_ring, self.incarnation, received_at,
                       self.ready_ns, self.took_us)


def worker_identity(worker_id: int, incarnation: int, key: bytes) -> bytes:
    """The ZeroMQ identity of one incarnation of a worker, under the session ``key``:
    a replacement never shares its predecessor's route, and nobody without the key
    (which reaches the workers through Ray, never on a dpex port) can name a route in
    advance. The trainer's ROUTER hands a route to whoever connects with its identity
    last, so an identity anyone could name (``w0.0``) let a peer that knew the
    authenticated mode's password take a worker's tasks."""
    tag = hashlib.blake2b(struct.pack("<QQ", worker_id, incarnation), key=key,
                          digest_size=12, person=b"dpex-route").hexdigest()
    return b"w%d.%d.%s" % (worker_id, incarnation, tag.encode())


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

    def seal(self, kind: Kind, epoch: int, seq: int, worker_id: int, body: Any,
             buffers: Sequence[Any] = (), ready_ns: int = 0, took_us: int = 0) -> list[Any]:
        """One message's frames, ``[header, mac, body, *buffers]`` (nothing pickled
        here); :meth:`open` checks them."""
        header = _HEADER.pack(PROTOCOL_VERSION, kind, self.session_id, epoch, seq, worker_id,
                              self.incarnation, len(buffers), ready_ns,
                              min(max(took_us, 0), 0xFFFFFFFF))
        return [header, self._mac(header, body, buffers), body, *buffers]

    def encode(self, kind: Kind, epoch: int = 0, seq: int = -1, worker_id: int = 0,
               payload: Any = None) -> list[Any]:
        """A message whose payload is pickled in-band (control messages, errors, END)."""
        return self.seal(kind, epoch, seq, worker_id, encode_object(payload))

    def open(self, frames: Sequence[Any]) -> Envelope:
        """Check one multipart message (``bytes`` or ``zmq.Frame`` parts) and return it
        unread: frame count, header, version, session, kind, size, then the MAC."""
        if len(frames) < 3:
            raise ProtocolError("frame-count", f"{len(frames)} frames, at least 3 expected")
        head = memoryview(frames[0])
        if head.nbytes != HEADER_SIZE:
            raise ProtocolError("header", f"{head.nbytes} bytes, {HEADER_SIZE} expected")
        (version, kind, sid, epoch, seq, worker_id, incarnation, n, ready_ns,
         took_us) = _HEADER.unpack(head)
        if version != PROTOCOL_VERSION:
            raise ProtocolError("version",
                                f"protocol {version}, this side speaks {PROTOCOL_VERSION}")
        if sid != self.session_id:
            raise ProtocolError("session", "message of another session")
        known = _KINDS.get(kind)
        if known is None:
            raise ProtocolError("kind", f"unknown message kind {kind}")
        kind = known
        if len(frames) != 3 + n:
            raise ProtocolError("frame-count", f"{len(frames)} frames, header says {3 + n}")
        body, buffers = memoryview(frames[2]), [memoryview(f) for f in frames[3:]]
        size = body.nbytes + sum(b.nbytes for b in buffers)
        if size > self.max_message_bytes:
            raise ProtocolError("too-large", f"{size:,} bytes")
        if not hmac.compare_digest(memoryview(frames[1]), self._mac(head, body, buffers)):
            raise ProtocolError("mac", "authentication failed")
        return Envelope(kind, sid, epoch, seq, worker_id, incarnation, body, buffers, ready_ns,
                        took_us)

    def decode(self, frames: Sequence[Any]) -> Message:
        """Check and unpickle one control-plane message (the data plane is
        :class:`dpex._transport.Receiver`'s)."""
        env = self.open(frames)
        if env.kind in DATA_KINDS:
            raise ProtocolError("kind", f"{env.kind.name} on the control plane")
        try:
            return env.message(env.unpickle())
        except Exception as exc:  # authentic, yet it does not unpickle here
            raise ProtocolError("body", f"{type(exc).__name__}: {exc}") from None
