"""Who may talk to a trainer's sockets: ZeroMQ CURVE with per-iterator keys.

Every iterator makes two CURVE key pairs: the trainer's (its secret never leaves
the trainer) and one for its workers. The workers get theirs, with the trainer's
public key, through Ray (``WorkerSpec.keys``), never on a ZeroMQ port. The
trainer's PULL and ROUTER sockets are CURVE servers, and a ZAP handler on the
session's own context admits exactly the workers' public key: a peer without it
fails the handshake, before libzmq reads a single message from it, so it can
neither make the trainer buffer data nor claim a worker's route. After the
handshake every frame is encrypted and authenticated by CURVE (per-connection
nonces: a frame captured on the wire cannot be replayed or altered).

Control messages are also numbered per worker incarnation (``ControlFreshness``),
so a control message delivered twice or out of order is rejected and counted
whatever the transport.
"""

from __future__ import annotations

import hmac
import os
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.auth.asyncio import AsyncioAuthenticator

__all__ = ["ClientKeys", "SessionKeys", "Admission", "ControlFreshness", "ZAP_DOMAIN",
           "keep_alive", "connect_promptly"]

ZAP_DOMAIN = "dpex"
# An unauthenticated connection is dropped if its handshake has not finished by then.
HANDSHAKE_IVL_MS = 10_000


@dataclass(frozen=True)
class ClientKeys:
    """What a worker needs to connect: the trainer's public key and the workers' pair."""

    server_public: bytes
    public: bytes
    secret: bytes = field(repr=False)

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before ``connect``) a CURVE client of the trainer."""
        sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)


@dataclass(frozen=True)
class SessionKeys:
    """One iterator's keys: the trainer's pair and the workers' ``client`` keys."""

    public: bytes
    secret: bytes = field(repr=False)
    client: ClientKeys = field(repr=False)

    @classmethod
    def new(cls) -> SessionKeys:
        if not zmq.has("curve"):  # pyzmq's wheels have it; a custom libzmq may not
            raise RuntimeError("dpex needs a libzmq built with CURVE security "
                               "(zmq.has('curve') is False): install pyzmq's wheel")
        public, secret = zmq.curve_keypair()
        worker_public, worker_secret = zmq.curve_keypair()
        return cls(public, secret, ClientKeys(public, worker_public, worker_secret))

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before ``bind``) a CURVE server that asks ZAP who may connect."""
        sock.setsockopt(zmq.CURVE_SERVER, 1)
        sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
        sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)


HEARTBEAT_ENV = "DPEX_HEARTBEAT_TIMEOUT_S"


def keep_alive(sock: zmq.Socket) -> None:
    """ZeroMQ heartbeats on a trainer socket: a connection silent for the timeout
    (``$DPEX_HEARTBEAT_TIMEOUT_S``, default 20 s) is closed on both ends, so the worker
    reconnects instead of waiting on a dead flow (a NAT that dropped it, a cut link).
    What was queued in it is lost: the iterator's lost-batch rules recompute it."""
    timeout_s = float(os.environ.get(HEARTBEAT_ENV) or 20.0)
    if not timeout_s > 0:
        raise ValueError(f"{HEARTBEAT_ENV} must be a number of seconds > 0")
    ms = int(timeout_s * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(100, ms // 4))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, ms)  # the worker's end closes it too


def connect_promptly(sock: zmq.Socket) -> None:
    """A worker socket's connection attempt gives up after 5 s and is retried, instead
    of waiting out TCP's SYN back-off (a minute and more) when its first SYNs went
    into a cut link."""
    sock.setsockopt(zmq.CONNECT_TIMEOUT, 5000)


class _OnlyOurWorkers:
    """ZAP credentials check: the iterator's worker key, nothing else."""

    def __init__(self, allowed: bytes) -> None:
        self.allowed = allowed  # Z85-encoded, as zmq.curve_keypair() gives it
        self.denied = 0

    def callback(self, domain: str, key: bytes) -> bool:
        ok = domain == ZAP_DOMAIN and hmac.compare_digest(key, self.allowed)
        self.denied += not ok
        return ok


class Admission:
    """The ZAP handler of one session's context (runs on that context's asyncio loop)."""

    def __init__(self, context: zmq.Context, keys: SessionKeys) -> None:
        self._check = _OnlyOurWorkers(keys.client.public)
        self._auth = AsyncioAuthenticator(context, log=_QUIET)
        self._auth.configure_curve_callback(ZAP_DOMAIN, self._check)

    @property
    def denied(self) -> int:
        """CURVE handshakes refused because the client's key was not the workers'."""
        return self._check.denied

    def start(self) -> None:
        self._auth.start()

    def stop(self) -> None:
        self._auth.stop()


class _Quiet:
    """pyzmq's authenticator logs every verdict; a refused stranger is counted instead."""

    def __getattr__(self, name: str) -> Any:
        return lambda *args, **kwargs: None


_QUIET: Any = _Quiet()


class ControlFreshness:
    """Accepts control messages of one worker incarnation only in increasing ``seq``
    order (gaps allowed: a message lost with a connection is not waited for)."""

    def __init__(self) -> None:
        self.last = -1
        self.rejected = 0

    def accept(self, seq: int) -> bool:
        if seq <= self.last:
            self.rejected += 1
            return False
        self.last = seq
        return True
