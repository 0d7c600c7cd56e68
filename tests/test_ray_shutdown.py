"""After the user's ray.shutdown(), nothing of dpex starts Ray again (issue 25, item 7).

Ray's API calls ``ray.init()`` by itself when the process is not connected; the warm
pool's thread, the reaper thread and the exit hook used to make such calls after the
user shut Ray down, starting a new local Ray inside the user's process. The unit tests
here put Ray's own auto-init wrapper around fake API functions, so a call that would
start Ray is seen (``FakeRay.started``) without Ray; the last test does it for real.
"""

import functools
import logging
import os
import queue
import subprocess
import sys
import textwrap
import threading
import time

import pytest
import ray
from ray._private.auto_init_hook import wrap_auto_init

from dpex import _reaper
from dpex.client import _fleet_group, _warm, _workers

pytestmark = pytest.mark.timeout(120)


class FakeRay:
    """Ray's public API as a process sees it: each function behind Ray's real auto-init
    wrapper, which calls ``ray.init()`` (recorded in ``started``) when not connected;
    the bare function refuses to run unconnected, as Ray's does."""

    def __init__(self, monkeypatch, on_call=None):
        self.up = True
        self.job = "01000000"  # a new one for each ray.init()
        self.started: list[str] = []
        self.calls: list[str] = []
        self.on_call = on_call or (lambda fake, name: None)
        monkeypatch.setattr(ray, "is_initialized", lambda: self.up)
        monkeypatch.setattr(ray, "init", self.init)
        for name in ("get", "wait", "kill", "cancel"):
            monkeypatch.setattr(ray, name, wrap_auto_init(functools.partial(self.api, name)))
        context = type("Context", (), {"get_job_id": lambda _: self.api("job")})()
        monkeypatch.setattr(ray, "get_runtime_context", wrap_auto_init(lambda: context))

    def init(self, *args, **kwargs):
        self.started.append(threading.current_thread().name)
        self.up = True  # what Ray's auto-init does: a new local instance

    def api(self, name, *args, **kwargs):
        if not self.up:
            raise RuntimeError("Ray has not been started yet")
        self.calls.append(name)
        self.on_call(self, name)
        if name == "wait":
            return list(args[0]), []
        if name == "job":
            return self.job
        return True if name == "get" else None

    def actor(self):
        return FakeActor(self)


class FakeActor:
    def __init__(self, fake):
        self.keep = type("Method", (), {})()
        self.keep.remote = wrap_auto_init(lambda: fake.api("keep") or "ref")


def shut_down_at(name):
    """on_call: the user shuts Ray down while dpex's call ``name`` runs."""
    def on_call(fake, called):
        if called == name:
            fake.up = False
    return on_call


def test_the_exit_hook_starts_no_ray_after_shutdown(monkeypatch):
    """release() (also dpex's exit hook) with Ray shut down: the idle and returning
    workers went with their driver; nothing is killed, nothing is started."""
    fake = FakeRay(monkeypatch)
    pool = _warm.WarmPool()
    pool._idle.append(_warm._Entry(fake.actor(), "key", None, 60.0, job=fake.job))
    pool._returning.append(_warm._Entry(fake.actor(), "key", None, 60.0, refs=["ref"],
                                        job=fake.job))
    monkeypatch.setattr(_warm, "POOL", pool)
    fake.up = False  # the user's ray.shutdown()
    _warm.release()
    assert fake.started == [] and pool.idle_count() == 0 and not pool._returning


def test_the_pool_thread_starts_no_ray_when_shut_down_mid_round(monkeypatch):
    """The user shuts Ray down while the pool's thread waits for a returning worker:
    its next Ray call would have started Ray (and failed every 0.5 s after)."""
    fake = FakeRay(monkeypatch, on_call=shut_down_at("wait"))
    pool = _warm.WarmPool()
    pool.give_back(fake.actor(), "ref", "key", None, 60.0)
    deadline = time.monotonic() + 10
    while pool._thread is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert fake.started == []
    assert pool._thread is None and pool.idle_count() == 0 and not pool._returning


def test_workers_of_an_earlier_connection_are_never_handed_out(monkeypatch):
    """ray.shutdown() then ray.init() at once (before the pool's thread saw Ray down):
    the kept workers ended with the first driver, and their handles mean nothing to
    the second; the pool drops them instead of starting a session on one."""
    fake = FakeRay(monkeypatch, on_call=lambda fake, name: time.sleep(0.01))
    pool = _warm.WarmPool()
    pool._idle.append(_warm._Entry(fake.actor(), "key", None, 60.0, job=fake.job))
    fake.job = "02000000"  # shut down and initialized again
    assert pool.take("key", None, wait=False) is None and pool.idle_count() == 0
    assert fake.started == []


def test_a_failing_check_is_logged_once(monkeypatch, caplog):
    """A Ray call of the pool's thread that keeps failing (Ray up) is logged once, not
    once per round (every 0.5 s)."""
    def failing(fake, name):
        if name == "wait":
            raise RuntimeError("the GCS did not answer")

    FakeRay(monkeypatch, on_call=failing)
    monkeypatch.setattr(_warm, "_TICK_S", 0.01)
    pool = _warm.WarmPool()
    with caplog.at_level(logging.DEBUG, logger="dpex"):
        pool.give_back(object(), "ref", "key", None, 60.0)
        time.sleep(0.5)  # ~50 rounds
        pool.release()
    warnings = [r for r in caplog.records if r.levelno >= logging.WARNING]
    assert len(warnings) == 1, [r.getMessage() for r in warnings]


def test_release_tears_down_what_is_pending_first(monkeypatch):
    """release_warm_workers() (the user's, before ray.shutdown(), or the exit hook's)
    first runs the teardowns handed to the reaper (a dropped iterator's: they give its
    workers back to the pool), then kills every kept worker, while Ray is still up."""
    fake = FakeRay(monkeypatch)
    killed = []
    monkeypatch.setattr(_warm, "_kill", killed.append)
    pool = _warm.WarmPool()
    monkeypatch.setattr(_warm, "POOL", pool)
    dropped = fake.actor()

    def teardown():  # a dropped iterator's close(), still queued at release()
        time.sleep(0.3)
        pool.give_back(dropped, "ref", "key", None, 60.0)

    _reaper.reap(teardown)
    _warm.release()
    assert killed == [dropped] and fake.started == []


def group_of(n, keep_s):
    group = _workers.WorkerGroup(object, {}, queue.SimpleQueue(), keep_s=keep_s)
    for w in range(n):
        group.actors[w] = object()
        group._calls[w] = f"ref{w}"
    return group


@pytest.mark.parametrize("keep_s", [0.0, 60.0], ids=["killed", "kept"])
def test_a_dropped_iterators_teardown_starts_no_ray(monkeypatch, keep_s):
    """The reaper ends a dropped iterator's workers while the user shuts Ray down on the
    training thread: the calls after the shutdown would each have started Ray."""
    fake = FakeRay(monkeypatch, on_call=shut_down_at("cancel" if keep_s else "kill"))
    monkeypatch.setattr(_warm, "POOL", _warm.WarmPool())
    group = group_of(3, keep_s)
    done = threading.Event()
    _reaper.reap(lambda: (group.stop(), done.set()))
    assert done.wait(10) and fake.started == [] and group.stopped


def test_a_fleet_iterators_teardown_starts_no_ray(monkeypatch):
    fake = FakeRay(monkeypatch, on_call=shut_down_at("cancel"))
    group = _fleet_group.FleetGroup("fleet", queue.SimpleQueue())
    group._calls = {0: "ref0", 1: "ref1"}
    group.stop()
    assert fake.started == []


# A user's script: warm workers returning to the pool, a loader dropped without close
# (the reaper ends it; the shutdown comes as it gives them back to the pool), then
# ray.shutdown() and (argv[1] == "wait") a pause or an exit at once. ray.init is
# replaced before the shutdown: any later call says who made it.
SCRIPT = textwrap.dedent("""
    import gc, logging, sys, threading, time, traceback
    import ray, torch
    from dpex import DpexDataLoader

    ray.init(address="local", include_dashboard=False, num_cpus=2)
    loader = DpexDataLoader(torch.arange(64), batch_size=8, num_workers=2,
                            distribute_mode=True)
    assert len(list(loader)) == 8  # its workers go back to the warm pool
    dropped = iter(DpexDataLoader(torch.arange(64), batch_size=8, num_workers=2,
                                  distribute_mode=True))
    next(dropped)
    del dropped
    gc.collect()
    from dpex.client._warm import POOL  # shut down while its workers are returning:
    deadline = time.monotonic() + 10    # the pool's thread is then busy with them
    while not POOL._returning and time.monotonic() < deadline:
        time.sleep(0.005)

    def refuse_init(*args, **kwargs):
        print("RAY_INIT_CALLED on", threading.current_thread().name, flush=True)
        traceback.print_stack(file=sys.stdout)
        raise RuntimeError("dpex started Ray after ray.shutdown()")

    ray.init = refuse_init
    ray.shutdown()
    if sys.argv[1] == "wait":
        time.sleep(3)
    print("EXITING", flush=True)
""")


@pytest.mark.slow
@pytest.mark.parametrize("then", ["wait", "exit"])
def test_after_ray_shutdown_nothing_starts_ray_for_real(then):
    env = {**os.environ, "RAY_ADDRESS": ""}
    started = time.monotonic()
    proc = subprocess.run([sys.executable, "-c", SCRIPT, then], capture_output=True,
                          text=True, timeout=180, env=env)
    out = proc.stdout + proc.stderr
    assert proc.returncode == 0, out[-4000:]
    assert "EXITING" in out and "RAY_INIT_CALLED" not in out, out[-4000:]
    assert out.count("Started a local Ray instance") <= 1, out[-4000:]  # the script's own
    assert out.count("dpex warm pool") <= 1, out[-4000:]
    print(f"{then}: {time.monotonic() - started:.1f} s")
