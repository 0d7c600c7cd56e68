"""Message protocol between a trainer session and its workers.

Every message is a ZeroMQ multipart message::

    [header, body, *buffers]

``header`` is a fixed 36-byte struct (little endian)::

    version:u8  kind:u8  session_id:16s  epoch:u32  seq:i64  worker_id:u16  n_buffers:u32

``body`` is a pickle (protocol 5) and ``buffers`` are the out-of-band buffers
it refers to (see ``_codec``); only data messages carry buffers.

Data plane (worker PUSH → trainer PULL): ``BATCH``, ``ERROR`` (a wrapped
exception in the batch's slot) and ``END`` (an IterableDataset worker is
exhausted; the task's slot holds no batch).

Control plane (trainer ROUTER ⇄ worker DEALER): ``HELLO`` (worker → trainer,
once, carries versions and placement), ``TASKS`` (a list of ``(seq, indices)``),
``RESUME`` (start epoch ``epoch`` on persistent workers) and ``STOP``.

Decoding never raises anything but :class:`~dpex.errors.ProtocolError`, whose
``reason`` names why the message was rejected.
"""

from __future__ import annotations

import enum
import pickle
import struct
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from torch._utils import ExceptionWrapper

from dpex._codec import decode_batch, encode_batch, encode_object
from dpex.errors import ProtocolError

__all__ = [
    "PROTOCOL_VERSION",
    "Kind",
    "Message",
    "encode_message",
    "encode_data",
    "decode_message",
]

PROTOCOL_VERSION = 1
_HEADER = struct.Struct("<BB16sIqHI")
HEADER_SIZE = _HEADER.size


class Kind(enum.IntEnum):
    BATCH = 1
    ERROR = 2
    END = 3
    HELLO = 10
    TASKS = 11
    RESUME = 12
    STOP = 13


DATA_KINDS = frozenset({Kind.BATCH, Kind.ERROR, Kind.END})


@dataclass(frozen=True)
class Message:
    kind: Kind
    session_id: bytes
    epoch: int
    seq: int
    worker_id: int
    payload: Any = None


def _header(kind: Kind, session_id: bytes, epoch: int, seq: int, worker_id: int, n: int) -> bytes:
    return _HEADER.pack(PROTOCOL_VERSION, kind, session_id, epoch, seq, worker_id, n)


def encode_message(
    kind: Kind, session_id: bytes, epoch: int = 0, seq: int = -1, worker_id: int = 0,
    payload: Any = None,
) -> list[bytes]:
    """A message whose payload is pickled in-band (control messages, errors, END)."""
    return [_header(kind, session_id, epoch, seq, worker_id, 0), encode_object(payload)]


def encode_data(session_id: bytes, epoch: int, seq: int, worker_id: int, batch: Any) -> list[Any]:
    """A ``BATCH`` message: the structure in-band, tensor memory as separate frames."""
    body, *buffers = encode_batch(batch)
    return [_header(Kind.BATCH, session_id, epoch, seq, worker_id, len(buffers)), body, *buffers]


def decode_message(frames: Sequence[Any], session_id: bytes | None = None) -> Message:
    """Validate and decode one multipart message.

    ``frames`` are bytes or ``zmq.Frame`` objects. With ``session_id`` given, a
    message of another session is rejected before its body is touched.
    """
    if len(frames) < 2:
        raise ProtocolError("frame-count", f"{len(frames)} frames, at least 2 expected")
    head = memoryview(frames[0])
    if head.nbytes != HEADER_SIZE:
        raise ProtocolError("header", f"{head.nbytes} bytes, {HEADER_SIZE} expected")
    version, kind, sid, epoch, seq, worker_id, n = _HEADER.unpack(head)
    if version != PROTOCOL_VERSION:
        raise ProtocolError("version", f"protocol {version}, this side speaks {PROTOCOL_VERSION}")
    if session_id is not None and sid != session_id:
        raise ProtocolError("session", "message of another session")
    try:
        kind = Kind(kind)
    except ValueError:
        raise ProtocolError("kind", f"unknown message kind {kind}") from None
    if len(frames) != 2 + n:
        raise ProtocolError("frame-count", f"{len(frames)} frames, header says {2 + n}")
    body = memoryview(frames[1])
    try:
        if kind is Kind.BATCH:
            payload = decode_batch(body, [memoryview(f) for f in frames[2:]])
        else:
            payload = pickle.loads(body)
    except Exception as exc:  # a body that does not unpickle is a bad message, not a crash
        if kind not in (Kind.BATCH, Kind.ERROR):
            raise ProtocolError("body", f"{type(exc).__name__}: {exc}") from None
        # A batch or a worker error of this session whose contents cannot be rebuilt here
        # (a class this process cannot import, say): the slot gets an error that says so,
        # so the epoch neither hangs nor silently skips it.
        what = "batch" if kind is Kind.BATCH else "worker's exception"
        return Message(Kind.ERROR, sid, epoch, seq, worker_id,
                       undecodable_error(worker_id, seq, what, exc))
    return Message(kind, sid, epoch, seq, worker_id, payload)


def undecodable_error(worker_id: int, seq: int, what: str, exc: BaseException) -> ExceptionWrapper:
    """An ``ExceptionWrapper`` for a data message whose body cannot be unpickled here."""
    wrapper = ExceptionWrapper.__new__(ExceptionWrapper)
    wrapper.exc_type = RuntimeError
    wrapper.exc_msg = (
        f"Traceback unavailable: the {what} of batch {seq} could not be unpickled in "
        f"the trainer ({type(exc).__name__}: {exc})"
    )
    wrapper.where = f"in DataLoader worker process {worker_id}"
    return wrapper
