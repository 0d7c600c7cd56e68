"""Forged, garbage, oversized and raw bytes at a loader's ports during an epoch."""

import os
import pickle
import socket
import time

import dsets
import pytest
import torch
import zmq
from dsets import assert_same

from dpex import DpexDataLoader
from dpex._protocol import Kind, Wire

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(120)]


class Evil:
    def __init__(self, path):
        self.path = path

    def __reduce__(self):
        return (os.system, (f"touch {self.path}",))


def attack(data_address, control_address, session_id, marker, keys=None):
    """Everything a peer who knew the session id could send, on both ports; ``keys``:
    the workers' credentials (a peer without them is refused in the handshake)."""
    ctx = zmq.Context()
    forger = Wire(session_id, os.urandom(32))  # right session, wrong key
    push = ctx.socket(zmq.PUSH)
    dealer = ctx.socket(zmq.DEALER)
    for s in (push, dealer):
        s.setsockopt(zmq.LINGER, 5000)  # closing waits (at most 5 s) until all is delivered
        s.setsockopt(zmq.SNDTIMEO, 5000 if keys is not None else 200)
        if keys is not None:
            keys.apply(s)
    dealer.setsockopt(zmq.IDENTITY, b"w0")
    push.connect(data_address)
    dealer.connect(control_address)

    def send(sock, frames):
        try:
            sock.send_multipart(frames)
        except zmq.Again:
            # A stranger's connection is dropped in the handshake; once libzmq has
            # dropped it, the socket has no peer and a send waits out SNDTIMEO.
            if keys is not None:
                raise

    try:
        for seq in range(4):
            frames = forger.encode(Kind.BATCH, 1, seq, seq % 2)
            frames[2] = pickle.dumps(Evil(marker))
            send(push, frames)
            send(dealer, forger.encode(Kind.HELLO, 0, -1, 0, Evil(marker)))
        send(push, [b"garbage"])
        send(push, [b"x" * 36, b"y" * 16, b"z"])
        send(push, [bytes(2 << 20)])  # over max_message_bytes: dropped by ZeroMQ
    finally:
        push.close(0 if keys is None else 5000)
        dealer.close(0 if keys is None else 5000)
        ctx.term()
    for address in (data_address, control_address):
        host, port = address.removeprefix("tcp://").rsplit(":", 1)
        with socket.create_connection((host, int(port)), timeout=5) as raw:
            # Not even ZMTP (libzmq parses it as legacy ZMTP/1.0 frames; all are refused).
            raw.sendall(os.urandom(4096))


@pytest.mark.parametrize("encryption", [False, True], ids=["authenticated", "encrypted"])
@pytest.mark.parametrize("peer", ["stranger", "holder of the workers' credentials"])
def test_attacks_during_an_epoch_change_nothing(tmp_path, peer, encryption):
    marker = tmp_path / "pwned"
    kw = {"batch_size": 3, "shuffle": True, "num_workers": 2}
    torch.manual_seed(5)
    expected = list(dsets.torch_loader(dsets.Squares(60, max_sleep=0.01), **kw))
    torch.manual_seed(5)
    loader = DpexDataLoader(dsets.Squares(60, max_sleep=0.01), distribute_mode=True,
                            max_message_bytes=1 << 20, timeout=30, encryption=encryption,
                            **kw)
    it = iter(loader)
    got = [next(it)]
    insider = peer != "stranger"
    attack(it._driver.session.data_address, it._driver.session.control_address, it._driver.session.session_id,
           marker, it._driver.session.keys.client if insider else None)
    got += list(it)
    assert_same(expected, got, "epoch")
    time.sleep(0.2)
    assert not marker.exists()
    rejected = it.stats()["rejected"]
    assert it.stats()["security"] == ("encrypted" if encryption else "authenticated")
    if not insider:  # its two sockets failed the handshake
        assert rejected.get("handshake", 0) >= 2, rejected
    else:  # past the handshake, the MAC and the checks before it still stop everything
        assert rejected.get("mac", 0) >= 4, rejected  # all data forgeries, at least
        assert rejected.get("frame-count", 0) >= 1, rejected
    assert loader.stats()["rejected"] == rejected  # the loader reports its newest iterator
    assert DpexDataLoader(dsets.Squares(2), distribute_mode=True).stats() == {}
