"""A worker session's control socket (its DEALER to the trainer's ROUTER) on the
session's event loop: :class:`ControlChannel` reads it from a descriptor callback and
sends without blocking, :class:`ConnectionLog` keeps what happened to its connection for
the error that says why the trainer was never heard from.

pyzmq's asyncio sockets, awaited under ``wait_for``, cost the session's thread about
200 µs of CPU per TASKS message on a busy 2-core node (a future, a task and a timer per
message): more than the rest of the worker's own per-batch path (docs/BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import collections
from collections.abc import Callable
from typing import Any

import zmq
from zmq.utils.monitor import parse_monitor_message

from dpex._addresses import ACCEPT_FROM_ENV, ADVERTISE_ENV, PORT_RANGE_ENV
from dpex._multipart import recv_frames, send_frames
from dpex._spec import WorkerSpec
from dpex.errors import WorkerStartupError

__all__ = ["ControlChannel", "ConnectionLog"]

# (pyzmq's enums cost µs per use)
_POLLIN, _EVENTS, _NOBLOCK = int(zmq.POLLIN), int(zmq.EVENTS), int(zmq.NOBLOCK)


class ControlChannel:
    """A session's control socket (its DEALER to the trainer's ROUTER) on this thread's
    event loop: a plain socket whose messages a callback on its descriptor hands to
    ``on_message`` as they come (:meth:`start`), and :meth:`send`, which never blocks.
    ZeroMQ's descriptor signals that the socket's state may have changed and any call
    may consume that signal, so a drain reads ``EVENTS`` until nothing is left, and a
    send that leaves a message waiting drains again. ``failed`` holds what broke the
    reading (it ends the session)."""

    def __init__(self, sock: zmq.Socket, loop: asyncio.AbstractEventLoop) -> None:
        self.sock, self.loop = sock, loop
        self.failed: asyncio.Future = loop.create_future()
        self._on_message: Callable[[list[bytes]], None] | None = None

    def start(self, on_message: Callable[[list[bytes]], None]) -> None:
        self._on_message = on_message
        self.loop.add_reader(self.sock.FD, self._drain)
        self._drain()  # what came before the reader was there

    def stop(self) -> None:
        if self._on_message is not None and not self.sock.closed:
            self.loop.remove_reader(self.sock.FD)
        self._on_message = None

    def _drain(self) -> None:
        sock, handle = self.sock, self._on_message
        if handle is None or sock.closed:
            return
        try:
            while sock.getsockopt(_EVENTS) & _POLLIN:
                try:
                    frames = recv_frames(sock, _NOBLOCK)
                except zmq.Again:  # woken by a pipe ending, not a message
                    break
                handle(frames)
        except Exception as exc:
            if not self.failed.done():
                self.failed.set_exception(exc)

    def send(self, frames: list[Any]) -> bool:
        """Queue ``frames`` for the trainer; False if ZeroMQ's queue is full (the trainer
        unreachable for long: PROGRESS reports are dropped then, not piled up)."""
        try:
            send_frames(self.sock, frames, _NOBLOCK)
        except zmq.Again:
            return False
        if self._on_message is not None and self.sock.getsockopt(_EVENTS) & _POLLIN:
            self.loop.call_soon(self._drain)
        return True


class ConnectionLog:
    """What happened to the control socket's connection (ZeroMQ's monitor events), for
    the error that says why the trainer was never heard from."""

    def __init__(self, channel: ControlChannel, hello: list | None = None) -> None:
        self.channel = channel
        self.monitor = channel.sock.get_monitor_socket()
        self.events: collections.Counter[str] = collections.Counter()
        self.hello = hello  # sent again on every reconnection

    async def run(self) -> None:
        while True:
            event = parse_monitor_message(await self.monitor.recv_multipart())["event"]
            name = getattr(event, "name", str(event))
            self.events[name] += 1
            if name == "HANDSHAKE_SUCCEEDED" and self.events[name] > 1 and self.hello:
                # A new connection after a lost one (heartbeats closed it, a link cut):
                # announce again, so the trainer sends what it held back meanwhile.
                self.channel.send(self.hello)

    def unreachable(self, spec: WorkerSpec, node: str, waited: float) -> WorkerStartupError:
        seen = ", ".join(f"{name} x{n}" for name, n in self.events.items()) or "none"
        failed = [name for name in self.events if name.startswith("HANDSHAKE_FAILED")]
        why = (f"the security handshake failed ({', '.join(failed)}): do trainer and "
               "workers run the same dpex version?" if failed else
               "the trainer's address or port is not reachable from this node (a firewall, "
               f"or an address of the trainer's host that this node cannot route to): set "
               f"{ADVERTISE_ENV} to an address of the trainer's host that the workers can "
               f"reach, {PORT_RANGE_ENV} (e.g. 50000-50100) to ports the firewall lets "
               f"through, and in the trainer {ACCEPT_FROM_ENV} to the subnets the workers "
               "connect from (the trainer closes any other connection at once)")
        return WorkerStartupError(
            f"dpex worker {spec.worker_id} on node {node} heard nothing from the trainer at "
            f"{spec.control_address} (data: {spec.data_address}) within {waited:g} s; "
            f"{why}. Socket events: {seen}")

    def close(self) -> None:
        self.monitor.close(0)
