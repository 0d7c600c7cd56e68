"""A fleet's workers on one node share one fork base per dataset (issue 47; no Ray: two
fleet workers' base starters in this process, one registry directory): the second
finds the first's base, its sessions fork from it, and the owner stops it only once
no session of either uses it."""

import os
import signal
import subprocess
import sys
import time

import pytest
from test_loader_pickle import shipped

from dpex._spec import PRELOADED, Parcel
from dpex.server._base_cache import BaseStarter
from dpex.server._node_bases import NodeBases, Published
from dpex.server._session_process import mp_context
from dpex.server._task_runner import load_shipped

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def report(conn):
    """A session's stand-in: its parent (the base) and the dataset it was forked with."""
    loader = load_shipped(PRELOADED)
    conn.send((os.getppid(), len(loader.dataset), loader.dataset[7]))
    conn.close()


def session(base):
    ctx = mp_context()
    mine, theirs = ctx.Pipe()
    proc = base.process(target=report, args=(theirs,), daemon=True)
    proc.start()
    theirs.close()
    assert mine.poll(60), "the session never answered"
    said = mine.recv()
    proc.join(10)
    return said


def test_two_fleet_workers_of_a_node_fork_from_one_base_which_waits_for_its_users(tmp_path):
    data = bytes(shipped(list(range(1000))))
    key = "ab" * 16
    node_a, node_b = NodeBases(str(tmp_path)), NodeBases(str(tmp_path))
    owner = BaseStarter(None, share_libraries=False, node=node_a).start(key, Parcel(data))
    other = BaseStarter(None, share_libraries=False, node=node_b).start(key, Parcel())  # no bytes
    assert isinstance(owner, Published) and not isinstance(other, Published)
    assert other.pid == owner.base.pid  # one base on the node, not two
    assert session(owner) == (owner.base.pid, 1000, 7)
    assert session(other) == (owner.base.pid, 1000, 7)  # forked by the owner's base

    use = node_b.use(key)  # a session of the other worker runs on it
    owner.stop()  # the owner retires it: held, not stopped
    assert owner.alive() and other.alive()
    assert session(other)[0] == owner.base.pid
    node_b.unuse(use)
    node_a.sweep()
    deadline = time.monotonic() + 10
    while other.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not owner.alive() and not other.alive()
    assert node_b.find(key) is None  # withdrawn: the next worker starts another


# -- a fleet worker's death ends its own sessions, not those forked from its base -------

OWNER = """
import sys, time
sys.path.insert(0, sys.argv[1])
from test_loader_pickle import shipped
from dpex._spec import PRELOADED, Parcel
from dpex.server._base_cache import BaseStarter
from dpex.server._node_bases import NodeBases
held = BaseStarter(None, share_libraries=False, node=NodeBases(sys.argv[2])).start(
    sys.argv[3], Parcel(bytes(shipped(list(range(1000))))))
print("ready", flush=True)
time.sleep(600)
"""

OTHER = """
import sys, time, types
sys.path.insert(0, sys.argv[1])
from test_node_bases import Idle
from dpex._spec import PRELOADED, Parcel
from dpex.server._base_cache import BaseStarter
from dpex.server._node_bases import NodeBases
from dpex.server._session_process import SessionProcess
base = BaseStarter(None, share_libraries=False, node=NodeBases(sys.argv[2])).start(
    sys.argv[3], Parcel())
child = SessionProcess(Idle, types.SimpleNamespace(worker_id=0, wire=None), Parcel(), {}, 30.0, None, base)
child.start()
print(base.pid, child._proc.pid, flush=True)
time.sleep(600)
"""


class Idle:
    """A session's stand-in: serves until its fleet worker says stop or is gone."""

    def __init__(self, placement, session_timeout, counts):
        pass

    async def serve_until_told(self, spec, shipped, conn):
        import asyncio

        told = asyncio.Event()
        asyncio.get_running_loop().add_reader(conn.fileno(), told.set)
        await asyncio.wait_for(told.wait(), 120)


def _alive(pid):
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split(")")[1].split()[0] != "Z"
    except OSError:
        return False


def test_a_fleet_workers_death_ends_only_its_own_sessions_as_ray_ends_its_process_group(tmp_path):
    # Ray starts each worker in a process group of its own (one session for all) and
    # ends a dead worker's group; here two processes stand in for two fleet workers of
    # a node, the first owning the node's base, the second forking a session from it.
    here, key = os.path.dirname(__file__), "cd" * 16
    args = [here, str(tmp_path), key]
    owner = subprocess.Popen([sys.executable, "-c", OWNER, *args], process_group=0,
                             stdout=subprocess.PIPE, text=True)
    other = None
    try:
        assert owner.stdout.readline().strip() == "ready"
        other = subprocess.Popen([sys.executable, "-c", OTHER, *args], process_group=0,
                                 stdout=subprocess.PIPE, text=True)
        base_pid, session_pid = map(int, other.stdout.readline().split())
        assert os.getpgid(base_pid) == owner.pid  # the base is the owner's ...
        deadline = time.monotonic() + 10
        while os.getpgid(session_pid) != other.pid and time.monotonic() < deadline:
            time.sleep(0.05)
        assert os.getpgid(session_pid) == other.pid  # ... the session its own worker's
        os.killpg(owner.pid, signal.SIGTERM)  # the owner dies, as Ray ends it
        os.killpg(owner.pid, signal.SIGKILL)
        owner.wait(10)
        time.sleep(1.0)
        assert not _alive(base_pid)  # its base went with it
        assert _alive(session_pid)  # the other worker's session did not
        os.killpg(other.pid, signal.SIGKILL)  # its own worker's end reaches it
        other.wait(10)
        deadline = time.monotonic() + 10
        while _alive(session_pid) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert not _alive(session_pid)
    finally:
        for proc in (owner, other):
            if proc is not None and proc.poll() is None:
                os.killpg(proc.pid, signal.SIGKILL)
                proc.wait(10)


# -- a host's library base ------------------------------------------------------------


def imported(conn, names):
    """A session's stand-in: which of ``names`` it was forked with imported."""
    import sys

    conn.send({name: name in sys.modules for name in names})
    conn.close()


def test_a_new_datasets_base_forks_from_a_library_base_holding_what_earlier_ones_imported():
    """The library base imports the installed libraries an earlier base's loader
    imported, and the next dataset's base is forked from it: its sessions have them
    without importing them again. (It imported nothing while its load read a
    memoryview as bytes: every library base was a fork of the forkserver, silently.)"""
    import colorsys

    starter = BaseStarter(None)
    first = starter.start("aa" * 16, Parcel(bytes(shipped([colorsys.rgb_to_hsv]))))
    assert first is not None and "colorsys" in first.libraries
    second = starter.start("bb" * 16, Parcel(bytes(shipped(list(range(10))))))
    try:
        assert "colorsys" not in second.libraries  # (its own loader imported nothing)
        ctx = mp_context()
        mine, theirs = ctx.Pipe()
        proc = second.process(target=imported, args=(theirs, ["colorsys"]), daemon=True)
        proc.start()
        theirs.close()
        assert mine.poll(60), "the session never answered"
        assert mine.recv() == {"colorsys": True}
        proc.join(10)
    finally:
        for base in (first, second, starter._parent):
            if base is not None:
                base.stop()


def test_the_libraries_a_shipment_names_are_imported_once_before_its_base():
    """The trainer names the installed libraries its pickle's classes and functions are
    of (Lightning's worker_init_fn); the library base imports them before the first
    dataset's base forks from it: that base imports nothing again, nor does a later
    one, and a package that is new is added by forking a new library base from the old
    one, which then ends."""
    starter = BaseStarter(None)
    starter.learn(["colorsys"])
    first = starter.start("aa" * 16, Parcel(bytes(shipped([1, 2, 3]))))
    library = starter._parent
    bases = [first, library]
    try:
        assert library is not None and first is not None
        assert "colorsys" not in first.libraries  # (the library base had imported it)
        ctx = mp_context()
        mine, theirs = ctx.Pipe()
        proc = first.process(target=imported, args=(theirs, ["colorsys", "wave"]), daemon=True)
        proc.start()
        theirs.close()
        assert mine.poll(60), "the session never answered"
        assert mine.recv() == {"colorsys": True, "wave": False}
        proc.join(10)
        starter.learn(["colorsys"])  # nothing new: the same library base
        bases.append(starter.start("bb" * 16, Parcel(bytes(shipped([4])))))
        assert starter._parent is library
        starter.learn(["wave"])  # a new package: a new library base, forked from the old
        bases.append(starter.start("cc" * 16, Parcel(bytes(shipped([5])))))
        assert starter._parent is not library and starter._parent_has >= {"colorsys", "wave"}
        bases.append(starter._parent)
        # Replaced: told to end (it does once the bases forked from it have ended).
        assert library._alive is None
        assert first.alive()
    finally:
        for base in bases:
            if base is not None:
                base.stop()


# -- a base whose owner is ending: its entry outlives its socket ----------------------

def test_a_session_forks_from_a_base_of_its_own_when_the_found_one_refuses(tmp_path,
                                                                          monkeypatch):
    """The fleet shrinks: the worker that owns a node's base is stopped, its base ends
    with it, and another worker's session finds the entry while the base's pid still
    lives but its socket no longer listens. The session marks it gone, starts a base of
    its own from the bytes it still holds, forks from that, and publishes it (CI failed
    on ``ConnectionRefusedError`` before)."""
    import asyncio
    import json
    import socket
    import types

    from test_session_process import worker_without_ray

    from dpex.server import _actor

    key = "cd" * 16
    dead = str(tmp_path / "refusing.sock")
    with socket.socket(socket.AF_UNIX) as s:
        s.bind(dead)  # (closed without unlinking: a connect is refused)
    stand_in = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(120)"])
    try:
        (tmp_path / f"{key}.json").write_text(json.dumps(
            {"pid": stand_in.pid, "address": dead, "per_worker": None, "libraries": []}))
        worker, _ = worker_without_ray(monkeypatch)
        worker._node = NodeBases(str(tmp_path))
        worker._starter = BaseStarter(None, share_libraries=False, node=worker._node)
        worker._bases = _actor.BaseCache(worker._starter.start)
        monkeypatch.setattr(_actor, "SessionWorker", Idle)
        spec = types.SimpleNamespace(worker_id=0, wire=None, shipment=key, namespace=None)
        data = Parcel(bytes(shipped(list(range(1000)))))

        async def fork():
            base, child = await worker._fork_child(spec, data)
            try:
                return base.pid, child._proc.pid, _alive(child._proc.pid)
            finally:
                await worker._end_child(child, base, None)

        base_pid, child_pid, ran = asyncio.run(fork())
        assert ran and base_pid not in (None, stand_in.pid)
        assert data.empty  # the base holds it now
        entry = json.loads((tmp_path / f"{key}.json").read_text())
        assert entry["pid"] == base_pid  # the next worker finds the live one
        assert not worker._children
    finally:
        stand_in.kill()
        stand_in.wait(10)
        for held in worker._bases.held().values():
            if held is not None:
                held.stop()
