"""A loader's construction starts Ray and its hosts on a background thread
(dpex/client/_early.py): the rules, with a fake Ray (the real start is the ray and e2e
tiers' first iterators)."""

import logging
import signal
import sys
import threading

import pytest

from dpex.client._early import EarlyStart, _DropSigtermWarning


class FakeRay:
    def __init__(self, fail: BaseException | None = None, gate: threading.Event | None = None):
        self.up, self.fail, self.gate = False, fail, gate
        self.connects: list[str] = []

    def connect(self, head: str) -> None:
        self.connects.append(head)
        if self.gate is not None:
            assert self.gate.wait(10)
        if self.fail is not None:
            raise self.fail
        self.up = True

    def initialized(self) -> bool:
        return self.up


@pytest.fixture(autouse=True)
def _sigterm_kept():
    before = signal.getsignal(signal.SIGTERM)
    yield
    signal.signal(signal.SIGTERM, before)


def test_with_ray_connected_the_hosts_start_on_the_thread_and_iter_waits_for_them():
    ray = FakeRay()
    ray.up = True
    ran, gate = [], threading.Event()
    early = EarlyStart(ray.connect, ray.initialized)
    early.begin("auto", lambda: (gate.wait(10), ran.append(threading.current_thread())))
    assert ran == []  # the constructor returned at once
    gate.set()
    early.wait("auto", 10.0)
    assert ran and ran[0] is not threading.current_thread() and ray.connects == []
    ran[0].join(5.0)
    assert not ran[0].is_alive()  # (it did not start Ray: nothing to live for)


def test_the_constructor_returns_before_ray_is_up_and_iter_waits_for_it():
    gate = threading.Event()
    ray = FakeRay(gate=gate)
    early = EarlyStart(ray.connect, ray.initialized, park_s=0.05)
    ran = []
    early.begin("auto", lambda: ran.append("first loader's hosts"))
    early.begin("auto", lambda: ran.append("second loader's hosts"))
    assert ran == [] and not ray.up  # (Ray is still starting: begin() did not wait)
    waiter = threading.Thread(target=early.wait, args=("auto", 10.0))
    waiter.start()
    waiter.join(0.2)
    assert waiter.is_alive()  # iter() waits for the start ...
    gate.set()
    waiter.join(10)
    assert not waiter.is_alive() and ray.up  # ... and goes on once it is done
    assert ran == ["first loader's hosts", "second loader's hosts"]  # in order, once each
    assert ray.connects[0] == "auto"
    ray.up = False  # (ray.shutdown(): its thread ends)


def test_the_thread_that_started_ray_lives_while_ray_runs_and_ends_after_shutdown():
    # Ray's processes die with the *thread* that started them (PR_SET_PDEATHSIG).
    ray = FakeRay()
    early = EarlyStart(ray.connect, ray.initialized, park_s=0.05)
    early.begin("auto", lambda: None)
    early.wait("auto", 10.0)
    assert ray.up
    thread = early._thread
    thread.join(0.3)
    assert thread.is_alive()  # parked, not ended
    ran = []
    early.begin("auto", lambda: ran.append(threading.current_thread()))  # Ray is up now:
    early.wait("auto", 10.0)
    assert ran == [thread]  # the parked thread starts the next loader's hosts
    ray.up = False
    thread.join(5.0)
    assert not thread.is_alive()


def test_a_failed_start_is_raised_at_iter_for_its_address_and_starts_no_hosts():
    ray = FakeRay(fail=RuntimeError("cannot reach the Ray cluster at 10.0.0.1:6379"))
    early = EarlyStart(ray.connect, ray.initialized)
    ran = []
    early.begin("10.0.0.1:6379", lambda: ran.append("hosts"))
    with pytest.raises(RuntimeError, match="cannot reach"):
        early.wait("10.0.0.1:6379", 10.0)
    assert ran == []
    early.wait("10.0.0.1:6379", 10.0)  # raised once: iter() connects itself next time
    early.wait("auto", 10.0)  # another address: not its failure


def test_a_hosts_start_that_fails_never_reaches_the_caller():
    ray = FakeRay()
    ray.up = True

    def broken():
        raise OSError("no")

    EarlyStart(ray.connect, ray.initialized).begin("auto", broken)  # (logged at debug)


def test_sigterm_exits_cleanly_as_ray_init_would_set_it_on_the_main_thread():
    signal.signal(signal.SIGTERM, signal.SIG_DFL)
    ray = FakeRay()
    early = EarlyStart(ray.connect, ray.initialized)
    early.begin("auto", lambda: None)
    early.wait("auto", 10.0)
    handler = signal.getsignal(signal.SIGTERM)
    assert callable(handler)
    with pytest.raises(SystemExit):
        handler(signal.SIGTERM, None)
    ray.up = False


def test_a_users_own_sigterm_handler_is_kept():
    def mine(signum, frame):
        pass

    signal.signal(signal.SIGTERM, mine)
    ray = FakeRay()
    early = EarlyStart(ray.connect, ray.initialized)
    early.begin("auto", lambda: None)
    early.wait("auto", 10.0)
    assert signal.getsignal(signal.SIGTERM) is mine
    ray.up = False


def test_rays_warning_about_the_thread_is_dropped_and_nothing_else():
    quiet = _DropSigtermWarning()

    def record(msg):
        return logging.LogRecord("ray._private.worker", logging.WARNING, "", 0, msg, (), None)

    assert not quiet.filter(record("SIGTERM handler is not set because current thread "
                                   "is not the main thread."))
    assert quiet.filter(record("Started a local Ray instance."))


def test_dpex_early_start_0_starts_nothing_before_iter(monkeypatch):
    monkeypatch.setenv("DPEX_EARLY_START", "0")
    ray = FakeRay()
    early = EarlyStart(ray.connect, ray.initialized)
    early.begin("auto", lambda: None)
    early.wait("auto", 1.0)
    assert ray.connects == [] and early._thread is None


def test_handed_off_while_ray_starts_no_hosts_start_and_the_ray_it_started_is_shut_down():
    """mp.spawn / ddp_spawn: the launcher's loaders were pickled into ranks that start
    their own; the launcher's early start lets its Ray go and starts no hosts."""
    gate = threading.Event()
    ray = FakeRay(gate=gate)
    shut = []
    early = EarlyStart(ray.connect, ray.initialized, park_s=0.05,
                       shutdown=lambda: (shut.append(1), setattr(ray, "up", False)))
    ran = []
    early.begin("auto", lambda: ran.append("train hosts"))
    early.begin("auto", lambda: ran.append("val hosts"))
    early.handed_off()  # (Ray is still starting)
    thread = early._thread
    gate.set()
    thread.join(5.0)
    assert not thread.is_alive() and ran == [] and shut == [1] and not ray.up


def test_after_an_iterator_waited_a_hand_off_changes_nothing():
    ray = FakeRay()
    shut = []
    early = EarlyStart(ray.connect, ray.initialized, park_s=0.05, shutdown=lambda: shut.append(1))
    ran = []
    early.begin("auto", lambda: ran.append("hosts"))
    early.wait("auto", 10.0)  # iter() in the launcher itself
    early.handed_off()
    thread = early._thread
    thread.join(0.3)
    assert thread.is_alive() and shut == [] and ran == ["hosts"]  # Ray kept, parked
    ray.up = False


def test_a_loader_built_after_a_hand_off_starts_again_and_iter_waits_for_the_shutdown():
    ray = FakeRay()
    stopping, stopped = threading.Event(), threading.Event()
    early = EarlyStart(ray.connect, ray.initialized, park_s=0.05,
                       shutdown=lambda: (stopping.set(), stopped.wait(10),
                                         setattr(ray, "up", False)))
    early.begin("auto", lambda: None)
    early.handed_off()
    assert stopping.wait(10)
    waiter = threading.Thread(target=early.wait, args=("auto", 10.0))
    waiter.start()
    waiter.join(0.3)
    assert waiter.is_alive()  # iter() never runs beside the shutdown
    stopped.set()
    waiter.join(10)
    assert not waiter.is_alive() and not ray.up
    ran = []
    early.begin("auto", lambda: ran.append("hosts"))
    early.wait("auto", 10.0)
    assert ran == ["hosts"] and ray.up and ray.connects == ["auto", "auto"]
    ray.up = False


class RecordingWorld:
    """A loader's world (client/_runtime.Runtimes) that records what the loader asks."""

    def __init__(self):
        self.prestarts = []
        self.handed_off_count = 0

    def prestart(self, worker_class, num_workers, remote_args, keep_s, head_address):
        self.prestarts.append((num_workers, head_address))

    def handed_off(self):
        self.handed_off_count += 1


def test_a_loader_pickled_for_a_spawned_process_hands_the_start_off(monkeypatch):
    """Only a pickle for a process multiprocessing spawns (its Popen pickling): a
    deepcopy or a checkpoint's pickle keeps the start."""
    import copy
    import multiprocessing.context
    import pickle

    from dpex import DpexDataLoader

    world = RecordingWorld()
    monkeypatch.setattr(DpexDataLoader, "_runtimes", world)
    loader = DpexDataLoader(list(range(8)), distribute_mode=True, num_workers=2)
    copy.deepcopy(loader)
    pickle.dumps(loader)
    assert world.handed_off_count == 0
    multiprocessing.context.set_spawning_popen(object())
    try:
        pickle.dumps(loader)
    finally:
        multiprocessing.context.set_spawning_popen(None)
    assert world.handed_off_count == 1


def test_a_loader_begins_the_start_when_built_and_in_a_rank_it_is_pickled_into(monkeypatch):
    import pickle

    from dpex import DpexDataLoader

    world = RecordingWorld()
    monkeypatch.setattr(DpexDataLoader, "_runtimes", world)
    loader = DpexDataLoader(list(range(8)), distribute_mode=True, num_workers=2,
                            head_address="127.0.0.1:1")
    assert world.prestarts == [(2, "127.0.0.1:1")]
    pickle.loads(pickle.dumps(loader))  # (mp.spawn, Lightning's ddp_spawn)
    assert world.prestarts == [(2, "127.0.0.1:1")] * 2
    DpexDataLoader(list(range(8)), distribute_mode=True, num_workers=0)
    DpexDataLoader(list(range(8)), num_workers=2)  # (torch's own: nothing of dpex's)
    assert len(world.prestarts) == 2


def test_ray_still_being_imported_on_the_start_thread_is_not_connected(monkeypatch):
    import types

    from dpex.client._early import ray_connected

    monkeypatch.setitem(sys.modules, "ray", types.ModuleType("ray"))  # (a module partly made)
    assert ray_connected() is False
    done = types.ModuleType("ray")
    done.is_initialized = lambda: True
    monkeypatch.setitem(sys.modules, "ray", done)
    assert ray_connected() is True
