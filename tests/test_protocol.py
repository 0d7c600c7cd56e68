import pytest
import torch
from torch._utils import ExceptionWrapper

from dpex._protocol import HEADER_SIZE, Kind, decode_message, encode_data, encode_message
from dpex.errors import ProtocolError

SID = b"s" * 16


def frames_bytes(frames):
    return [bytes(f) for f in frames]


def test_batch_message_roundtrip():
    frames = encode_data(SID, epoch=3, seq=41, worker_id=2, batch={"x": torch.arange(5)})
    assert len(bytes(frames[0])) == HEADER_SIZE and len(frames) == 3
    msg = decode_message(frames_bytes(frames), SID)
    assert (msg.kind, msg.epoch, msg.seq, msg.worker_id) == (Kind.BATCH, 3, 41, 2)
    assert torch.equal(msg.payload["x"], torch.arange(5))


def test_control_message_roundtrip():
    msg = decode_message(encode_message(Kind.TASKS, SID, 1, -1, 0, [(0, [1, 2])]), SID)
    assert msg.kind is Kind.TASKS and msg.payload == [(0, [1, 2])]


def test_other_session_is_rejected_before_the_body_is_read():
    frames = encode_message(Kind.END, b"x" * 16)
    frames[1] = b"not a pickle"
    with pytest.raises(ProtocolError) as err:
        decode_message(frames, SID)
    assert err.value.reason == "session"


@pytest.mark.parametrize("mutate, reason", [
    (lambda f: f[:1], "frame-count"),
    (lambda f: [f[0][:-1], *f[1:]], "header"),
    (lambda f: [bytes([99]) + f[0][1:], *f[1:]], "version"),
    (lambda f: [f[0][:1] + bytes([77]) + f[0][2:], *f[1:]], "kind"),
    (lambda f: [*f, b"extra"], "frame-count"),
    (lambda f: [f[0], b"\x80\x05garbage"], "body"),
])
def test_malformed_messages_are_rejected_with_a_reason(mutate, reason):
    frames = frames_bytes(encode_message(Kind.END, SID, 1, 0, 0))
    with pytest.raises(ProtocolError) as err:
        decode_message(mutate(frames), SID)
    assert err.value.reason == reason


def test_error_whose_type_cannot_be_unpickled_keeps_its_slot():
    try:
        raise ValueError("x")
    except ValueError:
        wrapper = ExceptionWrapper(where="in DataLoader worker process 1")
    frames = frames_bytes(encode_message(Kind.ERROR, SID, 1, 5, 1, wrapper))
    frames[1] = frames[1].replace(b"ValueError", b"NoSuchErrr")  # same length, unknown name
    msg = decode_message(frames, SID)
    assert msg.kind is Kind.ERROR and msg.seq == 5
    with pytest.raises(RuntimeError, match="could not be unpickled"):
        msg.payload.reraise()


def test_worker_error_reraises_with_torch_rules():
    try:
        raise KeyError("missing")
    except KeyError:
        wrapper = ExceptionWrapper(where="in DataLoader worker process 0")
    msg = decode_message(frames_bytes(encode_message(Kind.ERROR, SID, 1, 0, 0, wrapper)), SID)
    with pytest.raises(KeyError, match="Caught KeyError in DataLoader worker process 0"):
        msg.payload.reraise()


class _OnlyHere:
    """A class the receiving side pretends not to know (see the test below)."""

    def __init__(self, v):
        self.v = v


def test_batch_whose_contents_cannot_be_unpickled_becomes_an_error_in_its_slot(monkeypatch):
    frames = frames_bytes(encode_data(SID, 2, 9, 1, {"x": torch.arange(3), "o": _OnlyHere(1)}))
    monkeypatch.delattr(__import__(__name__), "_OnlyHere")  # the trainer lacks the class
    msg = decode_message(frames, SID)
    assert (msg.kind, msg.seq, msg.worker_id) == (Kind.ERROR, 9, 1)
    with pytest.raises(RuntimeError, match="batch 9 could not be unpickled"):
        msg.payload.reraise()
