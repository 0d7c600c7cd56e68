"""A worker session's control reader over a real ROUTER/DEALER pair on loopback, with no
Ray and no compute thread: what the reader puts in its inbox is what a test checks."""

import asyncio
import contextlib
import queue

import zmq
import zmq.asyncio

from dpex.server._control import ControlChannel
from dpex.server._session import Session, SessionServer


@contextlib.asynccontextmanager
async def control_reader(wire, count_rejected=lambda: None):
    """Yields ``(router, inbox, session)``: send ``[b"w", *frames]`` on the router."""
    server = SessionServer({}, 30.0, count=lambda n: None, count_rejected=count_rejected)
    ctx = zmq.asyncio.Context()
    router, dealer = ctx.socket(zmq.ROUTER), zmq.Socket(ctx, zmq.DEALER)  # (as a session's)
    for s in (router, dealer):
        s.setsockopt(zmq.LINGER, 0)
    dealer.setsockopt(zmq.IDENTITY, b"w")
    port = router.bind_to_random_port("tcp://127.0.0.1")
    dealer.connect(f"tcp://127.0.0.1:{port}")
    dealer.send(b"here")  # the ROUTER knows the route once it heard from it
    await asyncio.wait_for(router.recv_multipart(), 5)
    inbox: queue.SimpleQueue = queue.SimpleQueue()
    session = Session()
    spec = type("Spec", (), {"wire": wire})
    channel = ControlChannel(dealer, asyncio.get_running_loop())
    reader = asyncio.ensure_future(server.read_control(channel, spec, inbox, session))
    try:
        yield router, inbox, session
    finally:
        reader.cancel()
        await asyncio.gather(reader, return_exceptions=True)
        dealer.close(0)  # (a plain socket: the context's destroy() does not know it)
        ctx.destroy(0)
