"""The trainer's side of one session: its two sockets, and who uses them.

It owns the two sockets of one iterator: a bound PULL socket where workers push
data messages, and a bound ROUTER socket that carries tasks and control
messages to each worker's DEALER. Both are PLAIN (``authenticated``) or CURVE
(``encrypted``) servers on a context of the session's own, whose ZAP handler admits
only this iterator's workers (see ``_security``).

One hop per batch: the **training thread** reads the data socket itself
(:meth:`TrainerSession.receive`, :meth:`TrainerSession.wait`, which also wakes for
the ``handoff`` of events) and sends the tasks its credits draw
(:meth:`TrainerSession.send_all`): no batch and no task crosses to another Python
thread. The **loop thread** keeps the rest of the control plane: HELLOs, PROGRESS
and RNG answers (read by a callback on the control socket's descriptor and put on
the ``handoff``), pings, the monitors and the gate. The control socket is used by
both threads, never at once (``_ctrl_lock``, which also guards the routes); the
data socket and the rings by the training thread, and by the loop thread only to
close them (``_data_lock``, which a wait gives up at once when woken).

ZeroMQ's descriptor signals that the socket's state may have changed, and any call on
the socket may consume that signal: so a drain reads ``EVENTS`` until no message is
left, and every send on the control socket is followed by a look at ``EVENTS``; if a
message waits, the loop thread is asked to drain (pyzmq's asyncio sockets cost several
hundred microseconds per message here: docs/BENCHMARKS.md).
"""

from __future__ import annotations

import asyncio
import collections
import dataclasses
import os
import threading
import time
from typing import Any

import zmq
import zmq.asyncio
from zmq.utils.monitor import parse_monitor_message

from dpex._addresses import AcceptSet, accept_set, port_range, raise_fd_limit, tcp_endpoint
from dpex._multipart import recv_frames, send_frames
from dpex._protocol import PING_INTERVAL_S, Kind, Message, Wire
from dpex._security import AUTHENTICATED, Admission, ProgressFreshness, SessionKeys, keep_alive
from dpex._shm import RingRef, TrainerRing
from dpex._transport import SOCKET, Receiver, RingTransport
from dpex.client._events import Handoff, LoopFailure, RngReply, WorkerHello, WorkerProgress
from dpex.client._gate import ConnectionGate
from dpex.client._interrupts import held
from dpex.client._routes import ControlRoutes
from dpex.errors import EventLoopError, ProtocolError

__all__ = ["TrainerSession"]

_MAX_BURST = 64  # data messages handed to the training thread at once, at most
# (pyzmq's enums cost µs per use)
_POLLIN, _EVENTS, _NOBLOCK = int(zmq.POLLIN), int(zmq.EVENTS), int(zmq.NOBLOCK)
_HANDSHAKE_FAILED = (zmq.EVENT_HANDSHAKE_FAILED_NO_DETAIL | zmq.EVENT_HANDSHAKE_FAILED_PROTOCOL
                     | zmq.EVENT_HANDSHAKE_FAILED_AUTH)


def io_threads() -> int:
    """libzmq I/O threads for one session's sockets (``$DPEX_IO_THREADS``, else one per 8
    cores, 1 to 4). Each worker connection is served by one of them, so where the
    trainer has cores to spare, receiving (and decrypting) spreads over several; on a
    small node one keeps the cores for the training loop."""
    given = os.environ.get("DPEX_IO_THREADS")
    if given:
        n = int(given)
        if n < 1:
            raise ValueError(f"DPEX_IO_THREADS must be >= 1, got {given!r}")
        return n
    return max(1, min(4, len(os.sched_getaffinity(0)) // 8))


@dataclasses.dataclass
class SessionCounts:
    """What one session received and refused (loop thread)."""

    received: int = 0
    received_in_ring: int = 0
    cuts: int = 0  # admitted data connections that ended (see _count_refused)
    rejected: collections.Counter[str] = dataclasses.field(default_factory=collections.Counter)


class TrainerSession:
    """Sockets, hello handling and task sending of one iterator (threads: see the
    module's docstring)."""

    def __init__(self, wire: Wire, host: str, handoff: Handoff,
                 security: str = AUTHENTICATED, accept: AcceptSet | None = None) -> None:
        """``accept``: the peers to accept connections from (default: see
        :func:`~dpex._addresses.accept_set`; it asks Ray)."""
        self.wire = wire
        self.accept = accept_set(host) if accept is None else accept
        self.host = host
        self.handoff = handoff
        self.counts = SessionCounts()
        self.gate = ConnectionGate(self.accept, self.counts.rejected, security)
        self.rings: dict[int, TrainerRing] = {}
        self.receiver = Receiver(wire, [SOCKET, RingTransport(rings=self.rings)])
        self.routes = ControlRoutes(wire)
        self._progress_fresh = ProgressFreshness()  # (loop thread: PROGRESS is read there)
        self.keys = SessionKeys.new(security)
        self._ctx: zmq.asyncio.Context | None = None
        self._admission: Admission | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        self._data: zmq.Socket | None = None
        self._ctrl: zmq.Socket | None = None
        self._ctrl_lock = threading.RLock()  # the control socket and the routes
        self._data_lock = threading.Lock()  # the data socket and the rings
        self._closing = False
        self._pid = os.getpid()  # a forked child's copy must not touch the sockets
        self._poller: zmq.Poller | None = None
        self._tasks: list[asyncio.Task] = []
        self.data_address = ""
        self.control_address = ""

    @property
    def session_id(self) -> bytes:
        return self.wire.session_id

    async def open(self) -> None:
        """Bind both sockets on ``host`` (random ports) and start receiving."""
        # A context of its own: its ZAP handler answers for this session's sockets only.
        self._ctx = zmq.asyncio.Context(io_threads=io_threads())
        self._admission = Admission(self._ctx, self.keys, self.gate.admits)
        self._admission.start()
        self._loop = asyncio.get_running_loop()
        # Plain sockets on the session's context (its ZAP handler admits their peers),
        # read by the descriptor callbacks below.
        self._data = zmq.Socket(self._ctx, zmq.PULL)
        self._ctrl = zmq.Socket(self._ctx, zmq.ROUTER)
        for sock in (self._data, self._ctrl):
            sock.setsockopt(zmq.LINGER, 0)
            self.keys.serve(sock)
            keep_alive(sock, receives_data=sock is self._data)
        self._poller = zmq.Poller()  # the training thread's wait: batches, or an event
        self._poller.register(self._data, zmq.POLLIN)
        self._poller.register(self.handoff.fileno(), zmq.POLLIN)
        self._ctrl.setsockopt(zmq.ROUTER_MANDATORY, 1)
        # Only a holder of the workers' key gets this far, so a worker that reconnects
        # (after a link cut) takes its route over at once instead of being refused
        # until the old connection times out.
        self._ctrl.setsockopt(zmq.ROUTER_HANDOVER, 1)
        # No frame bigger than a whole valid message is even buffered.
        for sock in (self._data, self._ctrl):
            sock.setsockopt(zmq.MAXMSGSIZE, self.wire.max_message_bytes)
        # Control traffic is bounded by the credit window, so no high-water mark can be hit
        # and a send never fails with EAGAIN (which would lose a task).
        self._ctrl.setsockopt(zmq.SNDHWM, 0)
        # A connection from elsewhere is closed as soon as it is seen (the gate).
        for sock in (self._data, self._ctrl):
            self.gate.prepare(sock)
        raise_fd_limit()
        low, high = port_range()
        port = self._data.bind_to_random_port(tcp_endpoint(self.host), low, high + 1)
        self.data_address = tcp_endpoint(self.host, port)
        port = self._ctrl.bind_to_random_port(tcp_endpoint(self.host), low, high + 1)
        self.control_address = tcp_endpoint(self.host, port)
        self._loop.add_reader(self._ctrl.FD, self._on_control)
        self._tasks = [
            asyncio.ensure_future(self._guard(self._ping())),
            *(asyncio.ensure_future(self._guard(self._count_refused(sock)))
              for sock in (self._data, self._ctrl)),
        ]

    async def _count_refused(self, sock: zmq.asyncio.Socket) -> None:
        """Count the connections whose handshake failed (no or a wrong key, another
        protocol): they were dropped before libzmq read any message from them; and on the
        data socket, the admitted connections that were cut (a heartbeat timeout, a
        worker's death; ``cuts``). The gate hears of every connection accepted and ended."""
        monitor = sock.get_monitor_socket(
            _HANDSHAKE_FAILED | zmq.EVENT_DISCONNECTED | zmq.EVENT_ACCEPTED)
        refused = 0  # failed handshakes whose DISCONNECTED is still to come
        try:
            while True:
                message = parse_monitor_message(await monitor.recv_multipart())
                event = message["event"]
                if event == zmq.EVENT_ACCEPTED:
                    self.gate.accepted(message["endpoint"], message["value"])
                    continue
                if event == zmq.EVENT_DISCONNECTED:
                    self.gate.ended(message["value"])
                if event & _HANDSHAKE_FAILED:
                    self.counts.rejected["handshake"] += 1
                    refused += 1
                elif refused:
                    refused -= 1
                elif sock is self._data:
                    self.counts.cuts += 1
        finally:
            monitor.close(0)

    async def _guard(self, coro: Any) -> None:
        try:
            await coro
        except asyncio.CancelledError:
            raise
        except BaseException as exc:
            self.handoff.put(LoopFailure(exc))

    def _owned(self) -> None:
        """Raise in a forked child: its copies of the sockets are the parent's (ZeroMQ
        sockets do not survive a fork), and so may be the locks' states."""
        if os.getpid() != self._pid:
            raise EventLoopError(f"this dpex iterator belongs to process {self._pid}; a "
                                 "forked child cannot use it (iterate the loader anew there)")

    def receive(self) -> list[Message]:
        """The data messages that have arrived (a burst at most), checked and decoded:
        the training thread's, with no other thread between the socket and it."""
        ready: list[Message] = []
        self._owned()
        with self._data_lock:
            sock = self._data
            if sock is None or sock.closed:
                return ready
            while len(ready) < _MAX_BURST and sock.getsockopt(_EVENTS) & _POLLIN:
                try:
                    frames = recv_frames(sock, _NOBLOCK, copy=False)
                except zmq.Again:  # a pipe ending woke the socket, not a message
                    break
                self._accept(frames, ready)
        return ready

    def wait(self, timeout: float) -> None:
        """Wait up to ``timeout`` seconds for a data message or an event on the
        ``handoff`` (training thread). Returns at once when the session is closing."""
        self._owned()
        with self._data_lock:
            sock = self._data
            if sock is None or sock.closed or self._closing:
                time.sleep(min(timeout, 0.05))  # (closed under the caller: it finds out)
                return
            self._poller.poll(max(0, int(timeout * 1000)))
        self.handoff.clear()

    def _accept(self, frames: list[Any], ready: list[Message]) -> None:
        try:
            # (when it was read: the training thread reads when it asks for a batch, so
            # a batch that waited through a step is stamped late; the worker's own
            # time per batch comes in its header, took_us)
            msg = self.receiver.decode(frames, time.monotonic())
        except ProtocolError as exc:
            self.counts.rejected[exc.reason] += 1
            return
        self.counts.received += 1
        self.counts.received_in_ring += msg.in_ring
        ready.append(msg)

    async def _ping(self) -> None:
        """Tell every ready worker this trainer lives (a fleet worker frees a session
        that stays silent for its session timeout)."""
        while True:
            await asyncio.sleep(PING_INTERVAL_S)
            with self._ctrl_lock:
                for worker_id in list(self.routes.ready):
                    self.send(worker_id, Kind.PING, 0)

    def _on_control(self) -> None:
        """The control socket may have messages (HELLO, RNG_STATE, PROGRESS): take them
        all (loop thread)."""
        try:
            with self._ctrl_lock:
                sock = self._ctrl
                if sock is None or sock.closed:
                    return  # a call scheduled before close()
                while sock.getsockopt(_EVENTS) & _POLLIN:
                    try:
                        identity, *frames = recv_frames(sock, _NOBLOCK)
                    except zmq.Again:  # woken by a pipe ending, not a message (as above)
                        break
                    self._on_control_message(identity, frames)
        except Exception as exc:
            self.handoff.put(LoopFailure(exc))

    def _on_control_message(self, identity: bytes, frames: list[bytes]) -> None:
        try:
            msg = self.wire.decode(frames)
        except ProtocolError as exc:
            self.counts.rejected[exc.reason] += 1
            return
        if msg.kind not in (Kind.HELLO, Kind.RNG_STATE, Kind.PROGRESS) or (
                identity != self.routes.identity(msg.worker_id)):
            self.counts.rejected["kind"] += 1
            return
        if msg.kind is Kind.PROGRESS:
            working_s, queued, number = msg.payload
            if not self._progress_fresh.accept(msg.worker_id, msg.incarnation, number):
                self.counts.rejected["replayed"] += 1  # (read off the wire, sent again)
                return
            self.handoff.put(WorkerProgress(msg.worker_id, msg.incarnation, msg.epoch, msg.seq,
                                            float(working_s), int(queued)))
            return
        if msg.kind is Kind.RNG_STATE:
            self.handoff.put(RngReply(msg.worker_id, msg.epoch, msg.seq, msg.payload))
            return
        for frames_out in self.routes.hello(msg.worker_id):
            self._send(msg.worker_id, frames_out)
        self.handoff.put(WorkerHello(msg.worker_id, msg.payload))

    def new_ring(self, capacity: int, node_id: str, worker_id: int) -> RingRef:
        """A shared-memory ring for one worker incarnation (training thread, which
        reads it)."""
        self._owned()
        with self._data_lock:
            ring = TrainerRing(len(self.rings), capacity, node_id, worker_id)
            self.rings[ring.ref.ring_id] = ring
        return ring.ref

    def retire_ring(self, ring_id: int) -> None:
        """The ring's worker was replaced: unmap it (its memory goes once the batches
        that view it do) and drop its late messages, whose tasks the replacement redoes."""
        self._owned()
        with self._data_lock:
            ring = self.rings[ring_id]
            ring.retired = True
            ring.close()

    def expect(self, worker_id: int, incarnation: int) -> None:
        """A replacement for ``worker_id`` is starting: hold its messages until its HELLO."""
        self._owned()
        with self._ctrl_lock:
            self.routes.expect(worker_id, incarnation)

    def forget(self, worker_id: int) -> None:
        """A retired worker: no more pings, nothing held for it."""
        self._owned()
        with self._ctrl_lock:
            self.routes.forget(worker_id)

    def _send(self, worker_id: int, frames: list[bytes]) -> None:
        assert self._ctrl is not None and self._loop is not None
        try:
            send_frames(self._ctrl, [self.routes.identity(worker_id), *frames], _NOBLOCK)
        except zmq.ZMQError as exc:
            if exc.errno != zmq.EHOSTUNREACH:
                raise
            # No connection to the worker now: it died (Ray reports that, and the
            # iterator replaces it) or its connection was lost and it reconnects. Hold
            # this and later messages until it announces itself again (a new HELLO).
            self.routes.hold(worker_id, frames, lost=True)

    def _sent(self) -> None:
        """After a run of sends: a send may consume the control socket's readiness
        signal while a HELLO waits, so look; if one does, the loop thread drains."""
        sock, loop = self._ctrl, self._loop
        if (sock is not None and loop is not None and not sock.closed
                and sock.getsockopt(_EVENTS) & _POLLIN):
            loop.call_soon_threadsafe(self._on_control)

    def send(self, worker_id: int, kind: Kind, epoch: int, payload: Any = None) -> None:
        """Send a control message to one worker, held until its HELLO arrives (any
        thread)."""
        self._owned()
        with held(), self._ctrl_lock:  # (Ctrl-C: not between a message's frames)
            if self._ctrl is None or self._ctrl.closed:
                return  # closed: the iterator is ending
            self._deliver(worker_id, self.routes.encode(worker_id, kind, epoch, payload))
            self._sent()

    def _deliver(self, worker_id: int, frames: list[bytes]) -> None:
        if worker_id in self.routes.ready:
            self._send(worker_id, frames)
        else:
            self.routes.hold(worker_id, frames)

    def send_all(self, messages: list[Any]) -> None:
        """Send the scheduler's ``SendTasks`` and ``Control`` messages, in order (the
        training thread, as its credits draw them)."""
        self._owned()
        with held(), self._ctrl_lock:  # (Ctrl-C: not between a message's frames)
            if self._ctrl is None or self._ctrl.closed:
                return  # closed: the iterator is ending
            for m in messages:
                if m.kind is Kind.TASKS:
                    self.send_tasks(m.worker_id, m.epoch, m.tasks)
                else:
                    self._deliver(m.worker_id, self.routes.encode(m.worker_id, m.kind,
                                                                  m.epoch, m.payload))
            self._sent()

    def send_tasks(self, worker_id: int, epoch: int, tasks: list[tuple[int, Any]]) -> None:
        """Send tasks in as few messages as ``max_message_bytes`` allows. Raises
        :class:`ProtocolError` (``too-large``) for a task over the limit on its own: the
        worker would drop it unseen."""
        with self._ctrl_lock:
            frames = self.routes.encode(worker_id, Kind.TASKS, epoch, tasks)
            if len(frames[2]) <= self.wire.max_message_bytes:
                self._deliver(worker_id, frames)
                return
            if len(tasks) > 1:
                half = len(tasks) // 2
                self.send_tasks(worker_id, epoch, tasks[:half])
                self.send_tasks(worker_id, epoch, tasks[half:])
                return
            seq = tasks[0][0]
            raise ProtocolError(
                "too-large", f"the indices of batch {seq} take {len(frames[2]):,} bytes, over "
                f"max_message_bytes={self.wire.max_message_bytes:,}: raise "
                "DpexDataLoader(max_message_bytes=...) or use smaller batches")

    def counters(self) -> dict:
        """A copy of the counters (any thread: plain numbers, and a dict copied whole
        under the GIL)."""
        counts = self.counts
        return {"received": counts.received, "received_in_ring": counts.received_in_ring,
                "security": self.keys.mode,
                "unroutable": self.routes.unroutable, "cuts": counts.cuts,
                "rejected": dict(counts.rejected)}

    async def snapshot(self) -> dict:
        return self.counters()

    async def close(self) -> None:
        self._closing = True
        self.handoff.wake()  # a training thread waiting on the data socket lets it go
        with self._data_lock, self._ctrl_lock:
            for sock in (self._data, self._ctrl):
                if sock is not None and not sock.closed:
                    if self._loop is not None and sock is self._ctrl:
                        self._loop.remove_reader(sock.FD)
                    # Made with zmq.Socket(ctx, ...): the context's destroy() does not
                    # know them, and its term() would wait for them.
                    sock.close(linger=0)
        for task in self._tasks:
            task.cancel()
        self.gate.close()
        await asyncio.gather(*self._tasks, return_exceptions=True)
        if self._admission is not None:
            self._admission.stop()
        if self._ctx is not None:
            self._ctx.destroy(linger=0)  # the sockets, monitors and the ZAP socket
        with self._data_lock:
            for ring in self.rings.values():
                ring.close()
