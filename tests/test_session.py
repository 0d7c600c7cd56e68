"""The trainer session's sockets, driven by a fake worker on loopback (no Ray)."""

import asyncio
import queue

import pytest
import pytest_asyncio
import torch
import zmq
import zmq.asyncio
from dsets import SessionEvents

from dpex._addresses import port_range
from dpex._event_loop import LoopThread
from dpex._protocol import Kind, Message, Wire, worker_identity
from dpex._transport import encode_data
from dpex.client._events import Handoff, WorkerHello
from dpex.client._scheduler import SendTasks
from dpex.client._session import TrainerSession
from dpex.errors import DpexTimeoutError, ProtocolError

WIRE = Wire.new()


async def next_event(handoff, timeout=5.0):
    deadline = asyncio.get_running_loop().time() + timeout
    while True:
        try:
            return handoff.get_nowait()
        except queue.Empty:
            if asyncio.get_running_loop().time() > deadline:
                raise TimeoutError("no event from the session") from None
            await asyncio.sleep(0.005)


@pytest_asyncio.fixture
async def session():
    s = TrainerSession(WIRE, "127.0.0.1", Handoff())
    await s.open()
    s.events = SessionEvents(s, s.handoff)  # (what the training thread reads)
    yield s
    await s.close()


@pytest.fixture
def fake_worker(session):
    ctx = zmq.asyncio.Context.instance()
    ctrl, data = ctx.socket(zmq.DEALER), ctx.socket(zmq.PUSH)
    for sock in (ctrl, data):
        sock.setsockopt(zmq.LINGER, 0)
    ctrl.setsockopt(zmq.IDENTITY, session.routes.identity(0))
    for sock in (ctrl, data):
        session.keys.client.apply(sock)
    ctrl.connect(session.control_address)
    data.connect(session.data_address)
    yield ctrl, data
    ctrl.close(0)
    data.close(0)


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_tasks_wait_for_hello_then_batches_reach_the_handoff(session, fake_worker):
    ctrl, data = fake_worker
    assert session.data_address.startswith("tcp://127.0.0.1:")
    session.send_tasks(0, epoch=1, tasks=[(0, [4, 5])])  # queued: no HELLO yet
    await ctrl.send_multipart(WIRE.encode(Kind.HELLO, worker_id=0, payload={"pid": 1}))
    hello = await next_event(session.events)
    assert isinstance(hello, WorkerHello) and hello.worker_id == 0
    task = WIRE.decode(await asyncio.wait_for(ctrl.recv_multipart(), 5))
    assert task.kind is Kind.TASKS and task.payload == ([(0, [4, 5])], None)
    await data.send_multipart(encode_data(WIRE, 1, 0, 0, torch.tensor([4, 5])), copy=False)
    [msg] = await next_event(session.events)  # data messages come as a list
    assert isinstance(msg, Message) and torch.equal(msg.payload, torch.tensor([4, 5]))


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_burst_of_batches_is_read_in_few_lists_in_order(session, fake_worker):
    _, data = fake_worker
    for seq in range(40):
        data.send_multipart(encode_data(WIRE, 1, seq, 0, torch.tensor([seq])), copy=False)
    lists = []
    while sum(map(len, lists)) < 40:
        lists.append(await next_event(session.events))
    assert [m.seq for batch in lists for m in batch] == list(range(40))
    assert len(lists) < 40  # at least one read took several batches


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_garbage_and_foreign_messages_are_counted_and_dropped(session, fake_worker):
    _, data = fake_worker
    await data.send_multipart([b"garbage"])
    await data.send_multipart(Wire(b"z" * 16, WIRE.key).encode(Kind.END, 1, 0, 0))
    await data.send_multipart(Wire(WIRE.session_id, bytes(32)).encode(Kind.END, 1, 1, 0))
    await data.send_multipart(WIRE.encode(Kind.HELLO, 1, 0, 0))  # control kind on data
    await data.send_multipart(WIRE.encode(Kind.END, 1, 7, 0))
    [msg] = await next_event(session.events)
    assert msg.kind is Kind.END and msg.seq == 7  # only the valid one came through
    assert session.counts.rejected == {"frame-count": 1, "session": 1, "mac": 1, "kind": 1}


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_a_replayed_progress_report_is_dropped_and_counted(session, fake_worker):
    """Issue 48: a worker's PROGRESS reports are numbered, so one read off the wire
    (the authenticated mode's frames are in clear) and sent again cannot make a worker
    look busy or idle. A replacement (a newer incarnation) numbers from 0 again."""
    import dataclasses

    ctrl, _ = fake_worker
    await ctrl.send_multipart(WIRE.encode(Kind.HELLO, worker_id=0, payload={"pid": 1}))
    assert isinstance(await next_event(session.events), WorkerHello)
    reports = [WIRE.encode(Kind.PROGRESS, 1, seq, 0, (0.5, 0, n))
               for n, seq in enumerate((3, 4, 5))]
    for frames in (reports[0], reports[1], reports[0], reports[1], reports[2]):
        await ctrl.send_multipart(frames)
    replacement = dataclasses.replace(WIRE, incarnation=1)
    await ctrl.send_multipart(replacement.encode(Kind.PROGRESS, 1, 6, 0, (0.1, 0, 0)))
    got = [await next_event(session.events) for _ in range(4)]
    assert [(p.incarnation, p.seq) for p in got] == [(0, 3), (0, 4), (0, 5), (1, 6)]
    await asyncio.sleep(0.2)
    assert session.counts.rejected == {"replayed": 2}


def test_loop_thread_starts_runs_and_stops_idempotently():
    lt = LoopThread("dpex-test-loop")
    lt.start()
    assert lt.running
    assert lt.run(asyncio.sleep(0, result=42), timeout=5) == 42
    cleaned = []

    async def cleanup():
        cleaned.append(True)

    lt.stop(cleanup=cleanup)
    lt.stop()
    assert cleaned == [True] and not lt.running


def test_loop_thread_run_times_out():
    lt = LoopThread("dpex-test-loop")
    lt.start()
    try:
        with pytest.raises(DpexTimeoutError, match="did not finish within 0.1 s") as err:
            lt.run(asyncio.sleep(10), timeout=0.1)
        assert isinstance(err.value, TimeoutError)  # `except TimeoutError` still catches it
    finally:
        lt.stop()


@pytest.mark.timeout(60)
def test_hellos_arriving_while_tasks_are_sent_are_all_seen():
    """Sends from the training thread must not swallow the ROUTER's read edge: the loop
    thread's reader would never hear the HELLOs that arrive meanwhile."""
    import random
    import threading
    import time

    handoff = Handoff()
    loop = LoopThread("dpex-test-loop")
    sess = TrainerSession(Wire.new(), "127.0.0.1", handoff)
    loop.start()
    loop.run(sess.open(), 5)
    ctx = zmq.Context()
    socks = []

    def dealer(w):
        s = ctx.socket(zmq.DEALER)
        s.setsockopt(zmq.LINGER, 0)
        s.setsockopt(zmq.IDENTITY, sess.routes.identity(w))
        sess.keys.client.apply(s)
        s.connect(sess.control_address)
        socks.append(s)
        s.send_multipart(sess.wire.encode(Kind.HELLO, worker_id=w, payload={}))
        return s

    stop = threading.Event()
    try:
        busy = dealer(0)
        assert isinstance(handoff.get(timeout=5), WorkerHello)

        def drain():
            while not stop.is_set():
                if busy.poll(20):
                    busy.recv_multipart()

        def hammer():
            i = 0
            while not stop.is_set():
                sess.send_all([SendTasks(0, 1, [(i, None)])])  # (this thread: the training one)
                i += 1
                if i % 50 == 0:
                    time.sleep(0.0005)

        threads = [threading.Thread(target=drain), threading.Thread(target=hammer)]
        for t in threads:
            t.start()
        late = range(1, 41)
        for w in late:
            time.sleep(random.random() * 0.004)  # scrambled against the sends
            dealer(w)
        stop.set()
        for t in threads:
            t.join(5)
        seen, deadline = set(), time.monotonic() + 5
        while seen != set(late) and time.monotonic() < deadline:
            try:
                event = handoff.get(timeout=0.1)
            except queue.Empty:
                continue
            if isinstance(event, WorkerHello):
                seen.add(event.worker_id)
        assert set(late) - seen == set()
    finally:
        stop.set()
        for s in socks:
            s.close(0)
        ctx.term()
        loop.stop(cleanup=sess.close)


def test_loop_thread_stopped_from_its_own_thread_still_cleans_up_and_ends():
    """A finalizer may run on the loop thread (garbage collection there)."""
    lt = LoopThread("dpex-test-loop")
    lt.start()
    cleaned = []

    async def cleanup():
        cleaned.append(True)

    lt.call_soon(lt.stop, cleanup)
    lt._thread.join(5)
    assert cleaned == [True] and not lt._thread.is_alive() and not lt.running
    with pytest.raises(RuntimeError, match="stopped"):
        lt.call_soon(print)


def test_exception_in_a_scheduled_call_reaches_on_error():
    errors = queue.SimpleQueue()
    lt = LoopThread("dpex-test-loop", on_error=errors.put)
    lt.start()
    try:
        lt.call_soon(lambda: 1 / 0)
        assert isinstance(errors.get(timeout=5), ZeroDivisionError)
        assert lt.running
    finally:
        lt.stop()


def test_sockets_bind_inside_dpex_port_range(monkeypatch):
    monkeypatch.setenv("DPEX_PORT_RANGE", "50100-50120")
    lt = LoopThread("dpex-test-loop")
    lt.start()
    sess = TrainerSession(Wire.new(), "127.0.0.1", Handoff())
    try:
        lt.run(sess.open(), timeout=5)
        ports = [int(a.rsplit(":", 1)[1]) for a in (sess.data_address, sess.control_address)]
        assert all(50100 <= p <= 50120 for p in ports), ports
    finally:
        lt.stop(cleanup=sess.close)
    for bad in ("5-3", "50100", "a-b", "80-90"):
        monkeypatch.setenv("DPEX_PORT_RANGE", bad)
        with pytest.raises(ValueError, match="DPEX_PORT_RANGE"):
            port_range()


@pytest.mark.asyncio
@pytest.mark.timeout(30)
async def test_tasks_over_max_message_bytes_are_split_and_one_alone_too_big_is_an_error():
    handoff = Handoff()
    sess = TrainerSession(Wire.new(max_message_bytes=1024), "127.0.0.1", handoff)
    await sess.open()
    ctx = zmq.asyncio.Context()
    ctrl = ctx.socket(zmq.DEALER)
    ctrl.setsockopt(zmq.LINGER, 0)
    ctrl.setsockopt(zmq.IDENTITY, sess.routes.identity(0))
    sess.keys.client.apply(ctrl)
    ctrl.connect(sess.control_address)
    try:
        await ctrl.send_multipart(sess.wire.encode(Kind.HELLO, worker_id=0, payload={}))
        await next_event(handoff)
        tasks = [(seq, list(range(seq * 100, seq * 100 + 100))) for seq in range(8)]
        sess.send_tasks(0, 1, tasks)  # 2.2 KB pickled, ~0.2 KB a task: 4 messages
        got, messages = [], 0
        while len(got) < len(tasks):
            msg = sess.wire.decode(await asyncio.wait_for(ctrl.recv_multipart(), 5))
            got += msg.payload[0]
            messages += 1
        assert got == tasks and 2 < messages < len(tasks)
        with pytest.raises(ProtocolError, match="indices of batch 9 .*max_message_bytes"):
            sess.send_tasks(0, 1, [(9, list(range(1000)))])
    finally:
        ctx.destroy(0)
        await sess.close()


def test_routes_hold_messages_until_hello_and_a_new_incarnation_starts_afresh():
    """ControlRoutes (no socket): what is held comes out in order on the HELLO; a
    replacement gets its own identity, numbering from 0 and no marks of its
    predecessor; a lost route holds again and is counted."""
    from dpex.client._routes import ControlRoutes

    routes = ControlRoutes(WIRE)

    def decoded(frames):
        return WIRE.decode(frames)

    first = routes.encode(3, Kind.RESUME, 2, {"skip": 1})
    routes.hold(3, first)
    second = routes.encode(3, Kind.TASKS, 2, [(0, [1, 2])])
    routes.hold(3, second)
    assert 3 not in routes.ready and routes.identity(3) == worker_identity(3, 0, WIRE.key)
    held = routes.hello(3)
    assert held == [first, second] and 3 in routes.ready and routes.hello(3) == []
    assert [decoded(f).seq for f in held] == [0, 1]
    tasks, marks = decoded(second).payload
    assert tasks == [(0, [1, 2])] and marks == {"resume": (2, {"skip": 1})}

    routes.hold(3, routes.encode(3, Kind.PING, 2, None), lost=True)
    assert routes.unroutable == 1 and 3 not in routes.ready

    routes.expect(3, 1)  # a replacement: its predecessor's held messages are not its
    assert routes.identity(3) == worker_identity(3, 1, WIRE.key) and routes.hello(3) == []
    fresh = decoded(routes.encode(3, Kind.TASKS, 2, [(5, [9])]))
    assert fresh.seq == 0 and fresh.payload[1] is None

    routes.forget(3)
    assert 3 not in routes.ready
