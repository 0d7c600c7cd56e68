"""dpex._multipart: multipart messages without pyzmq's Python layer, as pyzmq's own do."""

import numpy as np
import pytest
import zmq

from dpex._multipart import recv_frames, send_frames


@pytest.fixture
def pair():
    ctx = zmq.Context()
    a, b = ctx.socket(zmq.PAIR), ctx.socket(zmq.PAIR)
    a.bind("inproc://frames")
    b.connect("inproc://frames")
    yield a, b
    ctx.destroy(0)


def test_a_message_of_any_buffers_arrives_whole_and_in_order(pair):
    a, b = pair
    send_frames(b, [b"x", memoryview(b"yy"), bytearray(b"zzz")], int(zmq.NOBLOCK))
    assert recv_frames(a, int(zmq.NOBLOCK)) == [b"x", b"yy", b"zzz"]
    arr = np.arange(6, dtype=np.uint8)
    send_frames(b, [b"h", arr], copy=False)
    head, body = recv_frames(a, copy=False)  # frames, not copies: as recv_multipart's
    assert isinstance(head, zmq.Frame) and bytes(body) == arr.tobytes()
    b.send_multipart([b"1", b"2"])  # and pyzmq's own read back by it, and the reverse
    assert recv_frames(a) == [b"1", b"2"]
    send_frames(b, [b"3"])
    assert a.recv_multipart() == [b"3"]


def test_nothing_to_read_or_nowhere_to_send_raises_again_and_sends_nothing():
    ctx = zmq.Context()
    try:
        pull = ctx.socket(zmq.PULL)
        pull.bind("inproc://nobody")
        with pytest.raises(zmq.Again):
            recv_frames(pull, int(zmq.NOBLOCK))
        push = ctx.socket(zmq.PUSH)  # no peer: the first frame cannot go
        with pytest.raises(zmq.Again):
            send_frames(push, [b"a", b"b"], int(zmq.NOBLOCK))
        push.connect("inproc://nobody")
        send_frames(push, [b"c"])
        assert recv_frames(pull) == [b"c"]  # nothing of the refused message went first
    finally:
        ctx.destroy(0)
