"""Who may talk to a trainer's sockets, and whether the bytes they send are encrypted.

Two modes, both admitting exactly this iterator's workers through a ZAP handler on the
session's own context, in the ZeroMQ handshake: a peer without the credentials is
refused before libzmq reads a single message from it, so it can neither make the
trainer buffer data nor claim a worker's route. The credentials are made per iterator
and reach the workers through Ray (``WorkerSpec.keys``), never on a ZeroMQ port.

- ``authenticated`` (the default): ZeroMQ PLAIN with a random per-iterator password.
  Frames then travel unencrypted, as NCCL's, Gloo's and Ray's own object transfers do
  on a cluster network; every message's header and body still carry a MAC under a key
  that never crosses a dpex port (it reaches the workers in Ray's RPC: ``_protocol.Wire``),
  so a peer that learned the
  password by watching the wire can connect but cannot forge a message, nor name a
  worker's route whose handshake it did not read (``_protocol.worker_identity``).
- ``encrypted``: ZeroMQ CURVE with per-iterator key pairs (the trainer's secret never
  leaves the trainer): every frame is encrypted and authenticated with per-connection
  nonces, so a frame captured on the wire can be neither read, replayed nor altered.
  On by itself when Ray runs with TLS (``RAY_USE_TLS``); ``DpexDataLoader(encryption=True)``
  asks for it. It costs the trainer about 1 ms of CPU per MiB received more than the
  same bytes in clear (measured in docs/FAULTS_AND_SECURITY.md).

Control messages are also numbered per worker incarnation (``ControlFreshness``),
so a control message delivered twice or out of order is rejected and counted
whatever the transport.
"""

from __future__ import annotations

import hmac
import os
import secrets
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any

import zmq
from zmq.auth.asyncio import AsyncioAuthenticator
from zmq.utils import z85

__all__ = ["ClientKeys", "SessionKeys", "Admission", "ControlFreshness", "ZAP_DOMAIN",
           "AUTHENTICATED", "ENCRYPTED", "wire_security", "ray_uses_tls",
           "keep_alive", "connect_promptly", "PRE_AUTH_BYTES"]

ZAP_DOMAIN = "dpex"
AUTHENTICATED = "authenticated"  # PLAIN + ZAP: a per-iterator password, frames in clear
ENCRYPTED = "encrypted"  # CURVE + ZAP: per-iterator keys, every frame encrypted
_USER = "dpex-worker"
# An unauthenticated connection is dropped if its handshake has not finished by then
# (a genuine worker's takes milliseconds; a failed one is simply retried).
HANDSHAKE_IVL_MS = 3_000


def ray_uses_tls() -> bool:
    """Whether this process's Ray runs with TLS (Ray reads the same variable)."""
    return os.environ.get("RAY_USE_TLS", "0").strip().lower() in ("1", "true")


def wire_security(encryption: bool | None) -> str:
    """The mode of an iterator's sockets: ``encryption`` as given, or, for None, encrypted
    exactly when Ray itself runs with TLS (an operator who encrypts Ray's traffic expects
    the batches encrypted too)."""
    if encryption is None:
        encryption = ray_uses_tls()
    return ENCRYPTED if encryption else AUTHENTICATED


@dataclass(frozen=True)
class ClientKeys:
    """What a worker needs to connect: in ``encrypted`` mode the trainer's public key and
    the workers' CURVE pair, in ``authenticated`` mode the iterator's password."""

    mode: str
    server_public: bytes = b""
    public: bytes = b""
    secret: bytes = field(default=b"", repr=False)
    password: bytes = field(default=b"", repr=False)

    def apply(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before ``connect``) a client of the trainer in this mode."""
        if self.mode == ENCRYPTED:
            sock.setsockopt(zmq.CURVE_SERVERKEY, self.server_public)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        else:
            sock.setsockopt(zmq.PLAIN_USERNAME, _USER.encode())
            sock.setsockopt(zmq.PLAIN_PASSWORD, self.password)


@dataclass(frozen=True)
class SessionKeys:
    """One iterator's credentials: in ``encrypted`` mode the trainer's CURVE pair, and
    the workers' ``client`` keys in either mode."""

    mode: str
    client: ClientKeys = field(repr=False)
    public: bytes = b""
    secret: bytes = field(default=b"", repr=False)

    @classmethod
    def new(cls, mode: str = AUTHENTICATED) -> SessionKeys:
        if mode == AUTHENTICATED:
            # Text: ZAP hands the handler the password decoded.
            password = secrets.token_urlsafe(32).encode()
            return cls(mode, ClientKeys(mode, password=password))
        if mode != ENCRYPTED:
            raise ValueError(f"unknown wire security mode {mode!r}")
        if not zmq.has("curve"):  # pyzmq's wheels have it; a custom libzmq may not
            raise RuntimeError("dpex needs a libzmq built with CURVE security for "
                               "encryption=True (zmq.has('curve') is False): install "
                               "pyzmq's wheel")
        public, secret = zmq.curve_keypair()
        worker_public, worker_secret = zmq.curve_keypair()
        return cls(mode, ClientKeys(mode, public, worker_public, worker_secret), public, secret)

    def serve(self, sock: zmq.Socket) -> None:
        """Make ``sock`` (before ``bind``) a server of this mode that asks ZAP who may
        connect."""
        if self.mode == ENCRYPTED:
            sock.setsockopt(zmq.CURVE_SERVER, 1)
            sock.setsockopt(zmq.CURVE_PUBLICKEY, self.public)
            sock.setsockopt(zmq.CURVE_SECRETKEY, self.secret)
        else:
            sock.setsockopt(zmq.PLAIN_SERVER, 1)
        sock.setsockopt(zmq.ZAP_DOMAIN, ZAP_DOMAIN.encode())
        sock.setsockopt(zmq.HANDSHAKE_IVL, HANDSHAKE_IVL_MS)


HEARTBEAT_ENV = "DPEX_HEARTBEAT_TIMEOUT_S"


def keep_alive(sock: zmq.Socket, *, receives_data: bool = False) -> None:
    """ZeroMQ heartbeats on a trainer socket: a connection silent for the timeout
    (``$DPEX_HEARTBEAT_TIMEOUT_S``, default 20 s) is closed, so the worker reconnects
    instead of waiting on a dead flow (a NAT that dropped it, a cut link). What was
    queued in it is lost: the iterator's lost-batch rules recompute it.

    On the data socket (``receives_data``) only the worker's end judges: the trainer
    pings and the worker closes the connection when the pings stop coming (their TTL),
    but the trainer never waits for the answer. libzmq restarts that wait only when a
    whole frame has arrived, and the worker's answer queues behind the batch frame it
    is sending: a frame slower to cross than the timeout (a large batch, a slow link)
    was cut every time, recomputed and cut again. Pings to the worker are never queued
    behind data (nothing else flows that way), so its judgement stays prompt."""
    timeout_s = float(os.environ.get(HEARTBEAT_ENV) or 20.0)
    if not timeout_s > 0:
        raise ValueError(f"{HEARTBEAT_ENV} must be a number of seconds > 0")
    ms = int(timeout_s * 1000)
    sock.setsockopt(zmq.HEARTBEAT_IVL, max(100, ms // 4))
    sock.setsockopt(zmq.HEARTBEAT_TIMEOUT, _NEVER_MS if receives_data else ms)
    sock.setsockopt(zmq.HEARTBEAT_TTL, min(ms, _TTL_MAX_MS))  # the worker's end judges


_NEVER_MS = 2**31 - 1  # libzmq's option is a C int of milliseconds (24 days)
_TTL_MAX_MS = 6_553_500  # libzmq sends the TTL in deciseconds, 16 bits


def connect_promptly(sock: zmq.Socket) -> None:
    """A worker socket's connection attempt gives up after 5 s and is retried, instead
    of waiting out TCP's SYN back-off (a minute and more) when its first SYNs went
    into a cut link. It may dial an IPv6 address (a trainer bound on one)."""
    sock.setsockopt(zmq.CONNECT_TIMEOUT, 5000)
    sock.setsockopt(zmq.IPV6, 1)


# What a trainer socket sends before it knows that the peer holds the credentials: the
# ZMTP greeting (64 bytes), and in CURVE the WELCOME too (170); a handshake that went on
# has sent more (its READY: 117 bytes in all in PLAIN, 301 in CURVE, measured).
PRE_AUTH_BYTES = {AUTHENTICATED: 64, ENCRYPTED: 64 + 170}


class _OnlyOurWorkers:
    """ZAP credentials check: the iterator's worker key or password, nothing else
    (compared in constant time)."""

    def __init__(self, client: ClientKeys) -> None:
        self.client = client
        self.denied = 0

    def curve(self, domain: str, key: bytes) -> bool:
        # ZAP gives the raw 32-byte key; zmq.curve_keypair() gave it Z85-encoded
        return self._count(domain == ZAP_DOMAIN and hmac.compare_digest(
            z85.encode(key), self.client.public))

    def plain(self, domain: str, username: str, password: str) -> bool:
        return self._count(domain == ZAP_DOMAIN and username == _USER and hmac.compare_digest(
            password.encode(errors="replace"), self.client.password))

    def _count(self, ok: bool) -> bool:
        self.denied += not ok
        return ok


class _Authenticator(AsyncioAuthenticator):
    """pyzmq's ZAP handler with dpex's checks for both mechanisms (pyzmq's compares
    passwords with ``==`` from a table; ours is one credential, compared in constant
    time), after the peer's address (``admits``, if given). A mechanism the session's
    sockets do not serve never reaches it."""

    def __init__(self, context: zmq.Context, check: _OnlyOurWorkers,
                 admits: Callable[[str], Awaitable[bool]] | None = None) -> None:
        super().__init__(context, log=_QUIET)
        self._check = check
        self._admits = admits

    async def handle_zap_message(self, msg: list[bytes]) -> None:
        # A request's fourth frame is the peer's address: the accepted peers may have
        # grown since the sockets were bound (a node that joined), which no filter in
        # libzmq can follow.
        if self._admits is not None and len(msg) >= 6 and not await self._admits(
                msg[3].decode(errors="replace")):
            self._send_zap_reply(msg[1], b"400", b"Address not accepted")
            return
        await super().handle_zap_message(msg)

    def _authenticate_plain(self, domain: str, username: str,
                            password: str) -> tuple[bool, bytes]:
        ok = self._check.plain(domain, username, password)
        return ok, b"OK" if ok else b"Invalid credentials"

    async def _authenticate_curve(self, domain: str, client_key: bytes) -> tuple[bool, bytes]:
        ok = self._check.curve(domain, client_key)
        return ok, b"OK" if ok else b"Unknown key"


class Admission:
    """The ZAP handler of one session's context (runs on that context's asyncio loop)."""

    def __init__(self, context: zmq.Context, keys: SessionKeys,
                 admits: Callable[[str], Awaitable[bool]] | None = None) -> None:
        """``admits(address)``: whether a peer at that address may go on to the
        credentials check (None: any)."""
        self._check = _OnlyOurWorkers(keys.client)
        self._auth = _Authenticator(context, self._check, admits)

    @property
    def denied(self) -> int:
        """Handshakes refused because the client's key or password was not the workers'."""
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


class ProgressFreshness:
    """The trainer's side of numbered PROGRESS reports: per worker id, the incarnation
    and the last number taken. A report is taken once, in increasing order, from the
    current incarnation or a newer one (a replacement numbers from 0 again); a report
    of an older incarnation is left to the scheduler, which drops it."""

    def __init__(self) -> None:
        self._last: dict[int, tuple[int, int]] = {}  # worker id -> (incarnation, number)

    def accept(self, worker_id: int, incarnation: int, number: int) -> bool:
        last = self._last.get(worker_id)
        if last is not None and (incarnation, number) <= last:
            return False
        self._last[worker_id] = (incarnation, number)
        return True


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
