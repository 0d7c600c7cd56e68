"""Nothing left behind: actors, sockets and threads end with their iterator or loader."""

import gc
import os
import signal
import threading
import time

import dsets
import pytest
import torch
from dsets import assert_same, pids_alive

from dpex import DpexDataLoader, IteratorClosedError

pytestmark = pytest.mark.timeout(120)
ON_RAY = pytest.mark.usefixtures("ray_session")  # (actors, threads, sockets: Ray's)
# What the iterator's face says (closed, a break), with dpex's workers in this process
# (tests/inprocess.py).
IN_PROCESS = pytest.mark.usefixtures("inprocess")


def dpex_threads():
    return [t for t in threading.enumerate() if t.name.startswith("dpex-loop")]


def threads_back_to(before, limit=10.0):
    """The loop threads left once the count is back to ``before`` or ``limit`` passed: a
    dropped iterator is torn down on dpex's reaper thread, so its loop thread ends a
    moment after its workers (which it stops first)."""
    deadline = time.monotonic() + limit
    while len(dpex_threads()) > before and time.monotonic() < deadline:
        time.sleep(0.05)
    return len(dpex_threads())



def wait_gone(pids, limit=10.0):
    return dsets.wait_gone(pids, limit)


def worker_pids(it):
    deadline = time.monotonic() + 30
    while len(it._ready) < it._num_workers and time.monotonic() < deadline:
        it._driver.receive_one()
    # The process running each worker's dataset code (on a warm worker, its session's).
    return [info.get("session_pid", info["pid"]) for info in it._ready.values()]


# The tests below that wait for worker processes to end turn warm workers off
# (warm_worker_timeout=0): with them on, an iterator's end ends its workers' sessions
# and keeps the processes for the next iterator (tests/test_warm.py).
NO_REUSE = {"warm_worker_timeout": 0}


@ON_RAY
def test_exhausted_iterator_stops_its_actors_and_thread():
    before = len(dpex_threads())
    it = iter(DpexDataLoader(dsets.Squares(10), batch_size=5, num_workers=2, distribute_mode=True,
                             **NO_REUSE))
    pids = worker_pids(it)
    assert len(list(it)) == 2 and len(pids) == 2
    assert wait_gone(pids) == []
    assert threads_back_to(before) == before


@ON_RAY
def test_broken_off_and_deleted_iterator_leaves_nothing():
    before = len(dpex_threads())
    loader = DpexDataLoader(dsets.Squares(100), batch_size=2, num_workers=2, distribute_mode=True,
                            **NO_REUSE)
    it = iter(loader)
    next(it)
    pids = worker_pids(it)
    del it
    gc.collect()
    assert wait_gone(pids) == []
    assert threads_back_to(before) == before


@ON_RAY
@pytest.mark.parametrize("how", ["close", "with"])
def test_persistent_workers_end_with_close_or_context_manager(how):
    before = len(dpex_threads())
    kw = {"batch_size": 5, "num_workers": 2, "persistent_workers": True, "distribute_mode": True,
          **NO_REUSE}
    if how == "close":
        loader = DpexDataLoader(dsets.Squares(10), **kw)
        list(loader)
        pids = worker_pids(loader._iterator)
        assert pids_alive(pids) == pids  # persistent: alive between epochs
        loader.close()
        loader.close()  # idempotent
    else:
        with DpexDataLoader(dsets.Squares(10), **kw) as loader:
            list(loader)
            pids = worker_pids(loader._iterator)
    assert wait_gone(pids) == []
    assert threads_back_to(before) == before


@IN_PROCESS
def test_a_closed_iterator_says_so():
    loader = DpexDataLoader(dsets.Squares(60), batch_size=3, num_workers=2, distribute_mode=True)
    it = iter(loader)
    next(it)
    loader.close()
    with pytest.raises(IteratorClosedError, match="closed; iterate the loader again"):
        list(it)
    assert len(list(loader)) == 20  # a new iterator: the whole epoch


@IN_PROCESS
@pytest.mark.subprocess  # (torch's workers beside)
@pytest.mark.parametrize("persistent", [False, True])
def test_break_then_next_epoch_matches_torch(persistent):
    kw = {"batch_size": 3, "shuffle": True, "num_workers": 2, "persistent_workers": persistent}
    runs = []
    for cls, extra in ((dsets.torch_loader, {}), (DpexDataLoader, {"distribute_mode": True})):
        torch.manual_seed(11)
        loader = cls(dsets.Squares(30), **kw, **extra)
        first = next(iter(loader))
        runs.append([first, list(loader)])
        if extra:
            loader.close()
    assert_same(runs[0], runs[1])


@ON_RAY
def test_a_training_loop_that_looks_late_still_gets_its_batches():
    """Workers that started while nobody read the queue are not a start-up failure, nor
    are persistent workers idle that long between epochs. (The driver's rule alone, the
    HELLOs that came meanwhile count: test_driver_live.py.)"""
    # Start-up (placing the actors, starting their processes) takes 1-4 s on this machine,
    # up to about 3 times that beside another test process (scripts/test.sh runs two).
    loader = DpexDataLoader(dsets.Squares(12), batch_size=3, num_workers=2, startup_timeout=12,
                            persistent_workers=True, distribute_mode=True)
    it = iter(loader)
    time.sleep(13)  # past startup_timeout before the first next()
    assert len(list(it)) == 4
    time.sleep(13)
    assert len(list(loader)) == 4
    loader.close()


@ON_RAY
def test_persistent_loader_starts_afresh_after_its_workers_died():
    from dpex.errors import WorkerDiedError

    loader = DpexDataLoader(dsets.Slow(0.05, n=40), batch_size=2, num_workers=2,
                            persistent_workers=True, max_worker_restarts=0,
                            distribute_mode=True)
    it = iter(loader)
    next(it)
    pids = worker_pids(it)  # both up: a worker killed while starting is a start-up failure
    os.kill(pids[1], signal.SIGKILL)  # worker 1's own process (a session on its host)
    with pytest.raises(WorkerDiedError, match=r"dpex worker 1 \(pid \d+, node [\d.]+\) died "
                       r"after 0 restart\(s\)"):
        list(it)
    assert it.closed
    assert len(list(loader)) == 20 and loader._iterator is not it  # new workers
    loader.close()


@ON_RAY
def test_workers_are_listed_like_torchs_and_end_with_their_iterator():
    """``iterator._workers`` as torch's: process-like handles (PyTorch's own tests use it)."""
    loader = DpexDataLoader(dsets.Squares(40), batch_size=2, num_workers=3,
                            distribute_mode=True)
    it = iter(loader)
    next(it)
    workers = it._workers
    assert [w.worker_id for w in workers] == [0, 1, 2]
    assert all(w.is_alive() and w.exitcode is None for w in workers)
    pids = sorted(worker_pids(it))  # once every worker said HELLO, the handles know pids
    assert sorted(w.pid for w in it._workers) == pids
    del it  # broken off: its workers end, as torch's do
    for w in workers:
        w.join(10)
        assert not w.is_alive() and w.exitcode == 0


@ON_RAY
def test_a_forked_child_dropping_the_iterator_leaves_the_parents_workers_alone():
    """A child forked while an iterator lives holds a copy of it; when the child drops
    that copy and exits, the parent's workers, sockets and loop thread stay the parent's."""
    import os

    torch.manual_seed(2)
    expected = list(dsets.torch_loader(dsets.Squares(40), batch_size=2, shuffle=True,
                                       num_workers=2))
    torch.manual_seed(2)
    it = iter(DpexDataLoader(dsets.Squares(40), batch_size=2, shuffle=True, num_workers=2,
                             distribute_mode=True, timeout=60))
    got = [next(it)]
    while len(it._ready) < 2:
        it._driver.receive_one()
    pid = os.fork()
    if pid == 0:
        try:
            del it
            gc.collect()
            time.sleep(1.0)  # what the child's reaper would do, it would have done now
        finally:
            os._exit(0)
    deadline = time.monotonic() + 30
    while os.waitpid(pid, os.WNOHANG) == (0, 0):
        if time.monotonic() > deadline:
            os.kill(pid, 9)
            pytest.fail("the child hung dropping its copy")
        time.sleep(0.05)
    got += list(it)
    assert_same(expected, got, "epoch")
    assert it.stats()["dropped"].get("restarted", 0) == 0
