import pytest
import torch
from torch._utils import ExceptionWrapper

from dpex import _transport
from dpex._protocol import DATA_KINDS, HEADER_SIZE, Kind, Wire
from dpex._transport import Receiver
from dpex.errors import ProtocolError

WIRE = Wire.new()
SID = WIRE.session_id
encode_message = WIRE.encode


def encode_data(epoch, seq, worker_id, batch, wire=WIRE):
    return _transport.encode_data(wire, epoch, seq, worker_id, batch)


def decode(frames, wire=WIRE):
    """What the trainer does with a message: the data plane's kinds through its
    receiver (socket transport), the others as control messages."""
    env = wire.open(frames)
    return Receiver(wire).decode(frames) if env.kind in DATA_KINDS else wire.decode(frames)


def frames_bytes(frames):
    return [bytes(f) for f in frames]


def test_batch_message_roundtrip():
    frames = encode_data(epoch=3, seq=41, worker_id=2, batch={"x": torch.arange(5)})
    assert len(bytes(frames[0])) == HEADER_SIZE and len(frames) == 4
    msg = decode(frames_bytes(frames))
    assert (msg.kind, msg.epoch, msg.seq, msg.worker_id) == (Kind.BATCH, 3, 41, 2)
    assert torch.equal(msg.payload["x"], torch.arange(5))


def test_every_message_carries_its_senders_incarnation_under_the_mac():
    import dataclasses

    sender = dataclasses.replace(WIRE, incarnation=3)
    batch = decode(frames_bytes(encode_data(1, 0, 2, torch.zeros(2), sender)))
    end = decode(sender.encode(Kind.END, 1, 1, 2))
    assert batch.incarnation == end.incarnation == 3 and decode(encode_message(Kind.END)).incarnation == 0
    forged = frames_bytes(sender.encode(Kind.END, 1, 1, 2))
    forged[0] = forged[0][:32] + (0).to_bytes(4, "little") + forged[0][36:]  # claim 0
    with pytest.raises(ProtocolError) as err:
        decode(forged)
    assert err.value.reason == "mac"


def test_a_batch_carries_how_long_its_worker_took_under_the_mac():
    frames = frames_bytes(_transport.encode_data(WIRE, 1, 0, 2, torch.zeros(2), took_us=4321))
    assert decode(frames).took_us == 4321
    assert decode(encode_message(Kind.END)).took_us == 0
    huge = frames_bytes(_transport.encode_data(WIRE, 1, 0, 2, torch.zeros(2), took_us=1 << 40))
    assert decode(huge).took_us == 0xFFFFFFFF  # (a batch of 71 minutes and more says so)
    frames[0] = frames[0][:-4] + (1).to_bytes(4, "little")  # claim another time
    with pytest.raises(ProtocolError) as err:
        decode(frames)
    assert err.value.reason == "mac"


def test_a_batch_carries_when_it_was_ready_under_the_mac():
    frames = frames_bytes(_transport.encode_data(WIRE, 1, 0, 2, torch.zeros(2), ready_ns=123456789))
    assert decode(frames).ready_ns == 123456789
    assert decode(encode_message(Kind.END)).ready_ns == 0
    frames[0] = frames[0][:-12] + (1).to_bytes(8, "little") + frames[0][-4:]  # another time
    with pytest.raises(ProtocolError) as err:
        decode(frames)
    assert err.value.reason == "mac"


def test_control_message_roundtrip():
    msg = decode(encode_message(Kind.TASKS, 1, -1, 0, [(0, [1, 2])]))
    assert msg.kind is Kind.TASKS and msg.payload == [(0, [1, 2])]


def test_other_session_is_rejected_before_the_body_is_read():
    other = Wire(b"x" * 16, WIRE.key)
    frames = other.encode(Kind.END)
    frames[2] = b"not a pickle"
    with pytest.raises(ProtocolError) as err:
        decode(frames)
    assert err.value.reason == "session"


@pytest.mark.parametrize("mutate, reason", [
    (lambda f: f[:2], "frame-count"),
    (lambda f: [f[0][:-1], *f[1:]], "header"),
    (lambda f: [bytes([99]) + f[0][1:], *f[1:]], "version"),
    (lambda f: [f[0][:1] + bytes([77]) + f[0][2:], *f[1:]], "kind"),
    (lambda f: [*f, b"extra"], "frame-count"),
    (lambda f: [f[0], f[1], b"\x80\x05garbage"], "mac"),  # forged body
    (lambda f: [f[0][:18] + bytes([9]) + f[0][19:], *f[1:]], "mac"),  # epoch rewritten
    (lambda f: [f[0], bytes(16), f[2]], "mac"),
    (lambda f: [f[0], f[1][:-1], f[2]], "mac"),  # truncated MAC
])
def test_malformed_and_forged_messages_are_rejected_with_a_reason(mutate, reason):
    frames = frames_bytes(encode_message(Kind.END, 1, 0, 0))
    with pytest.raises(ProtocolError) as err:
        decode(mutate(frames))
    assert err.value.reason == reason


def test_mac_covers_buffer_sizes_and_another_key_is_refused():
    frames = frames_bytes(encode_data(1, 0, 0, torch.arange(8)))
    with pytest.raises(ProtocolError, match="mac"):
        decode([*frames[:3], frames[3][:-8]])  # a truncated tensor buffer
    with pytest.raises(ProtocolError, match="mac"):
        Wire(SID, bytes(32)).decode(frames)  # same session id, wrong key


def test_a_forged_pickle_is_never_unpickled(tmp_path):
    import os
    import pickle

    marker = tmp_path / "pwned"

    class Evil:
        def __reduce__(self):
            return (os.system, (f"touch {marker}",))

    frames = frames_bytes(encode_message(Kind.END, 1, 0, 0))
    frames[2] = pickle.dumps(Evil())
    with pytest.raises(ProtocolError, match="mac"):
        decode(frames)
    assert not marker.exists()


def test_oversized_messages_are_refused_on_both_sides():
    small = Wire(SID, WIRE.key, max_message_bytes=4096)
    with pytest.raises(ProtocolError, match="too-large"):
        encode_data(1, 0, 0, torch.zeros(2048), small)
    big = frames_bytes(encode_data(1, 0, 0, torch.zeros(2048)))
    with pytest.raises(ProtocolError, match="too-large"):
        small.open(big)  # checked before the MAC is computed


def test_error_whose_type_cannot_be_unpickled_keeps_its_slot():
    try:
        raise ValueError("x")
    except ValueError:
        wrapper = ExceptionWrapper(where="in DataLoader worker process 1")
    frames = frames_bytes(encode_message(Kind.ERROR, 1, 5, 1, wrapper))
    frames[2] = frames[2].replace(b"ValueError", b"NoSuchErrr")  # same length, unknown name
    frames[1] = WIRE._mac(frames[0], frames[2], [])  # an authentic sender
    msg = decode(frames)
    assert msg.kind is Kind.ERROR and msg.seq == 5
    with pytest.raises(RuntimeError, match="could not be rebuilt"):
        msg.payload.reraise()


def test_worker_error_reraises_with_torch_rules():
    try:
        raise KeyError("missing")
    except KeyError:
        wrapper = ExceptionWrapper(where="in DataLoader worker process 0")
    msg = decode(frames_bytes(encode_message(Kind.ERROR, 1, 0, 0, wrapper)))
    with pytest.raises(KeyError, match="Caught KeyError in DataLoader worker process 0"):
        msg.payload.reraise()


class _OnlyHere:
    """A class the receiving side pretends not to know (see the test below)."""

    def __init__(self, v):
        self.v = v


def test_batch_whose_contents_cannot_be_unpickled_becomes_an_error_in_its_slot(monkeypatch):
    frames = frames_bytes(encode_data(2, 9, 1, {"x": torch.arange(3), "o": _OnlyHere(1)}))
    monkeypatch.delattr(__import__(__name__), "_OnlyHere")  # the trainer lacks the class
    msg = decode(frames)
    assert (msg.kind, msg.seq, msg.worker_id) == (Kind.ERROR, 9, 1)
    with pytest.raises(RuntimeError, match="batch 9 could not be rebuilt"):
        msg.payload.reraise()
