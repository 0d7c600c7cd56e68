"""Which TCP connections a trainer's sockets keep while their handshake runs.

libzmq gives a connection until ``HANDSHAKE_IVL`` (3 s) to finish its handshake, and
refuses in ZAP a peer without the iterator's credentials; until then the connection
holds a descriptor, and libzmq has neither a cap on such connections nor a call to
close one. Its filter of peer addresses (``TCP_ACCEPT_FILTER``) is copied into a
listener when it binds, so it cannot learn a node that joins the cluster later. So
the session's socket monitors tell this gate of each accepted connection (ACCEPTED,
with its descriptor) and of each end (DISCONNECTED), and the gate decides:

- a peer outside the accepted set (:class:`~dpex._addresses.AcceptSet`) is cut at
  once; where the set learns nodes and may look them up now (at most every few
  seconds), its connection waits for that look-up instead, and ZAP waits for it too;
- of the connections still in their handshake, at most ``per_peer`` from one address
  and ``total`` in all are kept: over either, the oldest is cut (first checked: the
  kernel's count of bytes the trainer sent on it tells a connection whose peer proved
  its credentials from one still in the handshake, see ``PRE_AUTH_BYTES``).

A cut is a ``shutdown()`` through a duplicate of the descriptor, after checking that it
is still a connection from that peer to that port (a descriptor number is reused once
libzmq closes it): libzmq then reads the end and closes its own. :class:`HandshakeGate`
holds the rules (no I/O); :class:`ConnectionGate` does the I/O, on the loop thread.
"""

from __future__ import annotations

import asyncio
import collections
import logging
import os
import resource
import socket
import struct
import time
from collections.abc import Callable
from dataclasses import dataclass
from typing import NamedTuple

import zmq

from dpex._addresses import AcceptSet
from dpex._security import HANDSHAKE_IVL_MS, PRE_AUTH_BYTES

__all__ = ["Cut", "HandshakeGate", "ConnectionGate", "caps"]

_log = logging.getLogger("dpex")
_LOOK_UP_TIMEOUT_S = 10.0  # ray.nodes() is one GCS call; a wedged GCS must not hold ZAP
# libzmq has dropped (or admitted) a connection this long after it was accepted.
_WINDOW_S = HANDSHAKE_IVL_MS / 1000 + 1.0


class Cut(NamedTuple):
    """A connection to cut, and why (the ``rejected`` counter it adds to)."""

    fd: int
    port: int
    peer: str
    reason: str  # "address" (not an accepted peer) or "handshake-cap"


@dataclass
class _Pending:
    peer: str
    port: int
    since: float
    awaiting: bool  # its address waits for a look-up of the cluster's nodes


def caps(fd_limit: int) -> tuple[int, int]:
    """(per peer address, in all): connections kept in their handshake. A quarter of
    the descriptors at most, so a flood leaves the training loop descriptors for a
    checkpoint; 64 from one address lets a node's workers start together."""
    total = max(16, min(256, fd_limit // 4))
    return min(64, total), total


class HandshakeGate:
    """The rules (pure). Invariant, after each call: at most ``per_peer`` connections
    from one address and ``total`` in all are pending (accepted, neither ended, found
    past their handshake, nor older than ``window``); connections leave oldest first.
    ``handshaking(fd, entry)`` (the caller's probe) says whether a connection is still
    in its handshake (False too for one that is gone)."""

    def __init__(self, accept: AcceptSet, per_peer: int, total: int,
                 window: float = _WINDOW_S) -> None:
        self.accept = accept
        self.per_peer, self.total, self.window = per_peer, total, window
        self.looking_up = False
        self._pending: dict[int, _Pending] = {}  # by descriptor, oldest first

    def accepted(self, fd: int, peer: str, port: int, now: float,
                 handshaking: Callable[[int, _Pending], bool]) -> tuple[list[Cut], bool]:
        """A connection from ``peer`` was accepted on ``port``: what to cut, and whether
        to look the cluster's nodes up (then call :meth:`looked_up`)."""
        self._expire(now)
        self._pending.pop(fd, None)  # (a reused descriptor whose end was not reported)
        admitted = self.accept.admits(peer)
        look_up = not admitted and self.look_up_due(now)
        if not admitted and not self.looking_up:
            return [Cut(fd, port, peer, "address")], False
        self._pending[fd] = _Pending(peer, port, now, awaiting=not admitted)
        return self._trim(peer, handshaking), look_up

    def look_up_due(self, now: float) -> bool:
        """Whether a look-up should start now (none running, and the set allows one);
        if so it counts as running until :meth:`looked_up`."""
        if self.looking_up or not self.accept.look_up_due(now):
            return False
        self.looking_up = True
        return True

    def looked_up(self) -> list[Cut]:
        """The look-up ended (``accept`` updated, or not if it failed): the waiting
        connections whose address it still does not admit are cut."""
        self.looking_up = False
        cuts = []
        for fd, entry in list(self._pending.items()):
            if entry.awaiting:
                entry.awaiting = False
                if not self.accept.admits(entry.peer):
                    del self._pending[fd]
                    cuts.append(Cut(fd, entry.port, entry.peer, "address"))
        return cuts

    def ended(self, fd: int) -> None:
        self._pending.pop(fd, None)

    def pending(self, peer: str | None = None) -> int:
        return sum(1 for e in self._pending.values() if peer is None or e.peer == peer)

    def _expire(self, now: float) -> None:
        for fd, entry in list(self._pending.items()):
            if entry.since > now - self.window:
                break  # (oldest first)
            del self._pending[fd]

    def _trim(self, peer: str,
              handshaking: Callable[[int, _Pending], bool]) -> list[Cut]:
        cuts = []
        for limit, scope in ((self.per_peer, peer), (self.total, None)):
            members = [fd for fd, e in self._pending.items() if scope in (None, e.peer)]
            for fd in members[:max(0, len(members) - limit)]:
                entry = self._pending.pop(fd)
                if handshaking(fd, entry):  # else through its handshake, or gone
                    cuts.append(Cut(fd, entry.port, entry.peer, "handshake-cap"))
        return cuts


class ConnectionGate:
    """One session's gate (loop thread): the monitors' events in, connections cut and
    counted in ``rejected``; ZAP asks :meth:`admits`."""

    def __init__(self, accept: AcceptSet, rejected: collections.Counter, mode: str) -> None:
        # The hard limit: the session raises the soft one to it when it opens.
        limits = [n for n in resource.getrlimit(resource.RLIMIT_NOFILE)[::-1]
                  if n != resource.RLIM_INFINITY]
        self.rules = HandshakeGate(accept, *caps(limits[0] if limits else 1 << 20))
        self.rejected = rejected
        self._pre_auth = PRE_AUTH_BYTES[mode]
        self._look_up: asyncio.Task | None = None

    def prepare(self, sock: zmq.Socket) -> None:
        """Before ``bind``: IPv6 for a trainer on an IPv6 address; a fixed accepted set
        also in libzmq's filter (closed as soon as accepted, before any event)."""
        sock.setsockopt(zmq.IPV6, int(self.rules.accept.version == 6))
        for peer in self.rules.accept.tcp_filter:
            sock.setsockopt(zmq.TCP_ACCEPT_FILTER, peer.encode())

    def accepted(self, endpoint: bytes, fd: int) -> None:
        """ACCEPTED on the socket bound on ``endpoint`` (``tcp://host:port``):
        descriptor ``fd``."""
        port = int(endpoint.rsplit(b":", 1)[1])
        fd = int(fd)
        conn = _duplicate(fd)
        if conn is None:
            return  # already closed
        try:
            peer = _peer(conn, port)
        finally:
            conn.close()
        if peer is None:
            return
        cuts, look_up = self.rules.accepted(fd, peer, port, time.monotonic(),
                                            self._handshaking)
        self._cut(cuts)
        if look_up:
            self._start_look_up()

    def ended(self, fd: int) -> None:
        """DISCONNECTED: descriptor ``fd`` was closed."""
        self.rules.ended(int(fd))

    async def admits(self, address: str) -> bool:
        """ZAP's check of a peer's address: an unknown one waits for a look-up of the
        cluster's nodes, if one runs or may start now."""
        accept = self.rules.accept
        if not accept.admits(address) and self.rules.look_up_due(time.monotonic()):
            self._start_look_up()
        if not accept.admits(address) and self._look_up is not None:
            await asyncio.wait({self._look_up}, timeout=_LOOK_UP_TIMEOUT_S + 1)
        ok = accept.admits(address)
        if not ok:
            self.rejected["address"] += 1
        return ok

    def close(self) -> None:
        if self._look_up is not None:
            self._look_up.cancel()

    def _start_look_up(self) -> None:
        self._look_up = asyncio.ensure_future(self._run_look_up())

    async def _run_look_up(self) -> None:
        accept = self.rules.accept
        try:
            assert accept.lookup is not None
            nodes = await asyncio.wait_for(
                asyncio.get_running_loop().run_in_executor(None, accept.lookup),
                _LOOK_UP_TIMEOUT_S)
            accept.update(nodes)
        except Exception as exc:  # Ray unreachable, say: the set stays as it was
            _log.debug("dpex: looking up the cluster's nodes failed: %r", exc)
        finally:
            self._cut(self.rules.looked_up())

    def _handshaking(self, fd: int, entry: _Pending) -> bool:
        conn = _duplicate(fd)
        if conn is None:
            return False
        try:
            if _peer(conn, entry.port) != entry.peer:
                return False
            sent = _bytes_acked(conn)
            return sent is None or sent <= self._pre_auth
        finally:
            conn.close()

    def _cut(self, cuts: list[Cut]) -> None:
        for cut in cuts:
            conn = _duplicate(cut.fd)
            if conn is None:
                continue
            try:
                if _peer(conn, cut.port) == cut.peer:
                    conn.shutdown(socket.SHUT_RDWR)
                    self.rejected[cut.reason] += 1
            except OSError:
                pass  # ended meanwhile
            finally:
                conn.close()  # (our duplicate; libzmq closes its descriptor)


def _duplicate(fd: int) -> socket.socket | None:
    """A socket object on a duplicate of ``fd`` (None: closed, or not a socket)."""
    try:
        dup = os.dup(fd)
    except OSError:
        return None
    try:
        return socket.socket(fileno=dup)
    except OSError:
        os.close(dup)
        return None


def _peer(conn: socket.socket, port: int) -> str | None:
    """The peer's address of ``conn`` if it is a TCP connection to local ``port``."""
    try:
        if conn.type != socket.SOCK_STREAM or conn.getsockname()[1] != port:
            return None
        return conn.getpeername()[0].split("%")[0]
    except OSError:
        return None


def _bytes_acked(conn: socket.socket) -> int | None:
    """Bytes this end sent and the peer acknowledged (Linux ``tcp_info``), or None."""
    try:
        info = conn.getsockopt(socket.IPPROTO_TCP, socket.TCP_INFO, 256)
    except (AttributeError, OSError):
        return None
    if len(info) < 128:
        return None
    return struct.unpack_from("<Q", info, 120)[0]  # tcpi_bytes_acked (Linux >= 4.1)
