"""A fleet's sessions each run in a process of their own (no Ray): the fleet worker
owns it, and it ends with the fleet worker."""

import json
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time

import cloudpickle
import pytest
from test_strangers import events, live_session  # noqa: F401 (a fixture)
from torch.utils.data import _DatasetKind

from dpex._spec import Parcel, ShippedLoader, WorkerSpec
from dpex.client._events import WorkerHello

pytestmark = pytest.mark.timeout(120)

# A fleet worker in a process of its own (its Ray placement made up): serves one
# session of the trainer whose spec it reads from stdin, until it is killed.
FLEET_WORKER = textwrap.dedent("""
    import asyncio, sys
    import cloudpickle
    sys.path.insert(0, sys.argv[1])
    from test_strangers import bare_worker
    spec, shipped = cloudpickle.loads(sys.stdin.buffer.read())
    asyncio.run(bare_worker(60.0).serve(spec, shipped))
""")


def alive(pid):
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    with open(f"/proc/{pid}/stat") as f:
        return f.read().split(")")[-1].split()[0] != "Z"


@pytest.mark.subprocess
def test_a_fleet_session_process_ends_with_the_fleet_worker_that_owns_it(live_session):  # noqa: F811
    sess, _, handoff = live_session
    spec = WorkerSpec(wire=sess.wire, worker_id=0, num_workers=1, base_seed=0,
                      data_address=sess.data_address, control_address=sess.control_address,
                      keys=sess.keys.client, own_process=True)
    shipped = cloudpickle.dumps(ShippedLoader(list(range(4)), _DatasetKind.Map, True,
                                              None, False, None))
    worker = subprocess.Popen([sys.executable, "-c", FLEET_WORKER, os.path.dirname(__file__)],
                              stdin=subprocess.PIPE)
    try:
        worker.stdin.write(cloudpickle.dumps((spec, Parcel(shipped))))
        worker.stdin.close()
        hello = events(handoff, lambda e: isinstance(e, WorkerHello), timeout=60)
        session_pid = hello.info["session_pid"]
        assert hello.info["pid"] == 1 and session_pid not in (worker.pid, os.getpid())
        assert alive(session_pid)
        worker.send_signal(signal.SIGKILL)  # no clean-up code of the worker runs
        worker.wait(10)
        deadline = time.monotonic() + 5  # its session would wait 60 s for the trainer
        while alive(session_pid):
            assert time.monotonic() < deadline, "the session outlived its fleet worker"
            time.sleep(0.05)
    finally:
        worker.kill()
        worker.wait(10)


FORKSERVER_HOST = textwrap.dedent("""
    import multiprocessing, sys, time
    from dpex.server import _session_process
    _session_process.prestart()
    print(multiprocessing.current_process()._config["tempdir"], flush=True)
    time.sleep(float(sys.argv[1]))
""")


@pytest.mark.subprocess
def test_a_killed_workers_forkserver_directory_is_removed_by_the_next_one(tmp_path):
    """Ray ends a worker with SIGKILL, and multiprocessing removes its pymp-* directory
    only at a clean exit: each worker used to leave one behind in /tmp."""
    env = {**os.environ, "TMPDIR": str(tmp_path)}
    first = subprocess.Popen([sys.executable, "-c", FORKSERVER_HOST, "60"], env=env,
                             stdout=subprocess.PIPE, text=True)
    try:
        mine = first.stdout.readline().strip()
        assert mine == str(tmp_path / f"dpex-mp-{os.getuid()}" / str(first.pid))
        assert os.path.isdir(mine)
    finally:
        first.kill()
        first.wait(10)
    assert os.path.isdir(mine)  # killed: nothing removed it
    second = subprocess.run([sys.executable, "-c", FORKSERVER_HOST, "0"], env=env,
                            capture_output=True, text=True, timeout=120)
    assert second.returncode == 0, second.stderr[-2000:]
    assert not os.path.exists(mine)  # the next start removed the dead one's
    assert os.listdir(tmp_path / f"dpex-mp-{os.getuid()}") == []  # its own, at its exit
    assert not list(tmp_path.glob("pymp-*"))


def worker_without_ray(monkeypatch, **kwargs):
    """A DpexWorker built as Ray builds it, its placement made up; its forkserver start
    recorded instead of run."""
    from dpex.server import _actor

    started = threading.Event()
    monkeypatch.setattr(_actor, "prestart", started.set)
    monkeypatch.setattr(_actor, "_placement", lambda: {"node_id": "f" * 56, "pid": 1})
    monkeypatch.setattr(_actor, "_ray_view", lambda own_job: None)
    monkeypatch.setattr(_actor, "_fleet_node_bases", lambda: None)  # (it would start Ray)
    return _actor.DpexWorker(**kwargs), started


def test_a_warm_worker_starts_its_forkserver_only_once_kept_idle(monkeypatch):
    """Its first session runs in the actor and may be its only one (persistent_workers,
    one iterator): the forkserver (~170 MiB PSS) waits until the warm pool keeps the
    worker for a later session (issue 25, item 10). A fleet worker, whose every
    session forks, starts it at once."""
    worker, started = worker_without_ray(monkeypatch, warm=True)
    assert not started.wait(0.5)  # started with the actor before
    worker._sessions.add(object())  # serving: not kept, still nothing
    assert worker.keep() is False and not started.wait(0.2)
    worker._sessions.clear()
    assert worker.keep() is True and started.wait(5)


def test_a_fleet_worker_starts_its_forkserver_at_once(monkeypatch):
    _, started = worker_without_ray(monkeypatch, fleet=True)
    assert started.wait(5)


def test_a_session_process_starts_from_the_workers_start_state(monkeypatch, tmp_path):
    """A warm worker's forkserver starts after its first session, which ran in the actor
    and may have set variables, changed directory or sys.path (a worker_init_fn): each
    forked session starts from the worker's state as it started, as it did when the
    forkserver started with the worker (test_warm.py's
    test_a_warm_worker_gives_exactly_what_a_fresh_one_gives runs it for real)."""
    from dpex.server import _session_process

    state = _session_process._process_state()
    monkeypatch.setenv("DPEX_TEST_INIT", "0,")
    monkeypatch.chdir(tmp_path)
    monkeypatch.syspath_prepend(str(tmp_path))
    _session_process.restore_state(state)
    assert os.environ.get("DPEX_TEST_INIT") == state[0].get("DPEX_TEST_INIT")
    assert os.getcwd() == state[2]
    assert str(tmp_path) not in sys.path


PRELOAD_HOST = textwrap.dedent("""
    import json, sys
    from dpex.server import _session_process
    import colorsys, usermod   # a library module and the user's, after the worker started
    colorsys.touched = usermod.touched = True   # state of the first session
    _session_process.prestart()
    ctx = _session_process.mp_context()
    parent, child = ctx.Pipe()
    import probe
    p = ctx.Process(target=probe.report, args=(child,))
    p.start()
    print(json.dumps(parent.recv()))
    p.join(30)
""")


@pytest.mark.subprocess
@pytest.mark.parametrize("setting", [None, "0"])
def test_the_forkserver_preloads_the_libraries_a_first_session_imported(tmp_path, setting):
    """A warm worker's later sessions fork from a forkserver that has already imported
    the installed libraries its first session imported (Lightning's worker_init_fn
    imports Lightning: ~10 s per session here), with none of that session's state, and
    never the user's own modules; DPEX_FORKSERVER_PRELOAD=0 turns it off."""
    (tmp_path / "usermod.py").write_text("touched = False\n")
    (tmp_path / "probe.py").write_text(textwrap.dedent("""
        import sys
        def report(conn):
            mods = sys.modules
            conn.send({"colorsys": "colorsys" in mods, "usermod": "usermod" in mods,
                       "touched": getattr(mods.get("colorsys"), "touched", False)})
    """))
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))])}
    env.pop("DPEX_FORKSERVER_PRELOAD", None)
    if setting is not None:
        env["DPEX_FORKSERVER_PRELOAD"] = setting
    run = subprocess.run([sys.executable, "-c", PRELOAD_HOST], env=env, cwd=tmp_path,
                         capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    assert seen == {"colorsys": setting is None, "usermod": False, "touched": False}


THREADED_PRELOAD_HOST = textwrap.dedent("""
    import json, sys
    from dpex.server import _session_process
    names = ["colorsys", sys.argv[1]]
    for name in names:   # what the first session imported
        __import__(name)
    _session_process.library_modules = lambda: names  # (as if all were installed)
    _session_process.prestart()
    ctx = _session_process.mp_context()
    parent, child = ctx.Pipe()
    import probe
    p = ctx.Process(target=probe.report, args=(child, names))
    p.start()
    print(json.dumps(parent.recv()))
    p.join(30)
""")

THREAD_STARTERS = {
    "python": """
        import threading, time
        threading.Thread(target=time.sleep, args=(3600,), name="threadlib-poller",
                         daemon=True).start()
    """,
    # A thread of C code, unknown to Python: libc's sleep(3600) as its start routine.
    "native": """
        import ctypes
        libc = ctypes.CDLL(None, use_errno=True)
        tid = ctypes.c_ulong()
        start = ctypes.cast(libc.sleep, ctypes.c_void_p)
        assert libc.pthread_create(ctypes.byref(tid), None, start, ctypes.c_void_p(3600)) == 0
    """,
}


@pytest.mark.subprocess
@pytest.mark.parametrize("kind", ["python", "native", "openblas"])
def test_a_library_that_starts_a_thread_on_import_is_not_preloaded(tmp_path, kind):
    """Issue 39, item 8: a library that starts a thread on import made the forkserver,
    and so every later session's fork, a fork of a multi-threaded process (a lock
    that thread holds stays held in the child). The forkserver says so and starts
    again without the libraries: the session has none of them imported. A thread
    pool that stops around a fork (OpenBLAS's, which scipy starts on import: Lightning
    imports it) leaves the preload as it was."""
    if kind == "openblas":
        pytest.importorskip("scipy.linalg")
        library = "scipy.linalg"
    else:
        library = "threadlib"
        (tmp_path / "threadlib.py").write_text(textwrap.dedent(THREAD_STARTERS[kind]))
    (tmp_path / "probe.py").write_text(textwrap.dedent("""
        import sys
        def report(conn, names):
            conn.send({name: name in sys.modules for name in names})
    """))
    env = {**os.environ, "TMPDIR": str(tmp_path), "PYTHONPATH": os.pathsep.join(
        [str(tmp_path), os.path.dirname(os.path.dirname(os.path.abspath(__file__)))])}
    env.pop("DPEX_FORKSERVER_PRELOAD", None)
    run = subprocess.run([sys.executable, "-c", THREADED_PRELOAD_HOST, library], env=env,
                         cwd=tmp_path, capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stderr[-2000:]
    seen = json.loads(run.stdout.strip().splitlines()[-1])
    preloaded = kind == "openblas"
    assert seen == {"colorsys": preloaded, library: preloaded}
    said = [line for line in run.stderr.splitlines() if "started threads" in line]
    if preloaded:
        assert said == []
    else:
        assert len(said) == 1 and "from threadlib" in said[0], run.stderr[-2000:]
        assert ("threadlib-poller" in said[0]) == (kind == "python")
