"""The resource model on the embedded default: dpex runs wherever torch runs.

These tests use Ray exactly as a user gets it on this machine (``ray.init()`` as dpex
starts it: this machine's cores, 2 here), never a cluster sized to hide a limit.
Everything that torch's DataLoader runs at once (several live loaders, iterators not
yet collected, more workers than cores) dpex must run at once too; only what the user
asks Ray to reserve can wait, and then it says so.
"""

import gc
import os
import threading
import time
import warnings

import dsets
import pytest
import ray
import torch
from dsets import assert_same

from dpex import DpexDataLoader, PlacementWarning, WorkerStartupError

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(180)]

CORES = os.cpu_count()


def both(make, consume):
    """``consume(make(cls, extra))`` for torch's loader and dpex's, seeded alike."""
    out = []
    for cls, extra in ((dsets.torch_loader, {}), (DpexDataLoader, {"distribute_mode": True})):
        torch.manual_seed(7)
        out.append(consume(make(cls, extra)))
    return out


def worker_pids(it, limit=60.0):
    """The workers' processes: each actor's and, on a warm worker, its session's own."""
    deadline = time.monotonic() + limit
    while len(it._ready) < it._num_workers and time.monotonic() < deadline:
        it._driver.receive_one()
    return sorted(info[key] for info in it._ready.values() for key in ("pid", "session_pid")
                  if key in info)



def wait_gone(pids, limit=5.0):
    return dsets.wait_gone(pids, limit)


def test_the_session_runs_on_this_machines_cores():
    # The guard for everything below: no test here gets more CPUs than the machine has.
    assert ray.cluster_resources()["CPU"] == CORES


def test_more_workers_than_cores_start_at_once_and_match_torch():
    n = CORES * 2 + 1
    torch_run, dpex_run = both(
        lambda cls, extra: cls(dsets.Squares(60), batch_size=3, shuffle=True, num_workers=n,
                               **extra),
        lambda loader: list(loader))
    assert_same(torch_run, dpex_run)


def test_two_loaders_iterated_in_turn_match_torch():
    def interleave(loaders):
        a, b = (iter(loader) for loader in loaders)
        out = []
        for x, y in zip(a, b, strict=True):
            out += [x, y]
        return out

    def make(cls, extra):
        return [cls(dsets.Squares(24), batch_size=2, shuffle=True, num_workers=CORES, **extra)
                for _ in range(2)]

    torch_run, dpex_run = both(make, interleave)
    assert_same(torch_run, dpex_run)


def test_train_and_val_loaders_alive_together_match_torch():
    """Lightning's pattern: a persistent train loader and a fresh val loader per epoch,
    each with as many workers as the machine has cores."""
    def run(loaders):
        train, val = loaders
        out = []
        for _ in range(2):
            out.append(list(train))
            out.append(list(val))
        if isinstance(train, DpexDataLoader):
            train.close()
        return out

    def make(cls, extra):
        return (cls(dsets.Squares(20), batch_size=4, shuffle=True, num_workers=CORES,
                    persistent_workers=True, **extra),
                cls(dsets.Squares(12), batch_size=4, num_workers=CORES, **extra))

    torch_run, dpex_run = both(make, run)
    assert_same(torch_run, dpex_run)


def test_iterators_not_yet_collected_do_not_block_a_new_one():
    loader = DpexDataLoader(dsets.Squares(40), batch_size=2, num_workers=CORES,
                            distribute_mode=True)
    held = [iter(loader) for _ in range(3)]  # all alive, none finished
    for it in held:
        next(it)
    assert len(list(iter(loader))) == 20
    del held


def released(pids, reuse):
    """Ended (without warm workers); or, with them, every session process ended and
    every actor idle in the warm pool."""
    if not reuse:
        return wait_gone(pids)
    from dpex.client._warm import POOL

    assert POOL.wait_settled(10)
    actors = {w.get("Pid") for w in dsets.live_workers()}
    return dsets.wait_released([p for p in pids if p in actors]) + wait_gone(
        [p for p in pids if p not in actors])


@pytest.mark.parametrize("reuse", [True, False], ids=["warm", "no-reuse"])
def test_an_iterator_that_raised_releases_its_workers_at_once(reuse):
    loader = DpexDataLoader(dsets.FailsAt(5, n=40), batch_size=2, num_workers=CORES,
                            distribute_mode=True, warm_worker_timeout=60 if reuse else 0)
    pids = []
    with pytest.raises(ValueError) as caught:
        for i, _ in enumerate(loader):
            if i == 0:
                pids = worker_pids(loader._book.current)
    # The exception (and so its traceback) is still alive here: the iterator is not.
    assert caught.value is not None and loader._book.current is None
    assert released(pids, reuse) == []
    # Iterating again gets fresh workers and the whole epoch up to the same error.
    got = []
    with pytest.raises(ValueError):
        for batch in loader:
            got.append(batch)
    assert len(got) == 2


def test_an_iterator_the_caller_keeps_goes_on_after_an_error_as_torchs_does():
    expected, got = both(
        lambda cls, extra: cls(dsets.FailsAt(5, n=12), batch_size=2, num_workers=CORES,
                               **extra),
        dsets.outcomes)
    assert [type(b) for b in got[0]] == [type(b) for b in expected[0]]
    assert got[0][2][0] == "ValueError" and len(got[0]) == 6


@pytest.mark.parametrize("reuse", [True, False], ids=["warm", "no-reuse"])
def test_a_broken_off_iterator_releases_its_workers_without_the_garbage_collector(reuse):
    loader = DpexDataLoader(dsets.Squares(40), batch_size=2, num_workers=CORES,
                            distribute_mode=True, warm_worker_timeout=60 if reuse else 0)
    gc.disable()  # only reference counting may free it
    try:
        for i, _ in enumerate(loader):
            if i == 0:
                pids = worker_pids(loader._book.current)
            if i == 2:
                break
        assert loader._book.current is None
        assert released(pids, reuse) == []
    finally:
        gc.enable()


@ray.remote(num_cpus=0)
class Holder:
    """Holds a Ray resource reservation on behalf of a test (another job, say)."""

    def ping(self):
        return True


def test_a_reservation_that_can_never_fit_is_refused_at_once():
    loader = DpexDataLoader(dsets.Squares(4), num_workers=2, distribute_mode=True,
                            ray_remote_args={"num_cpus": CORES + 1})
    t0 = time.monotonic()
    with pytest.raises(WorkerStartupError, match=rf"cannot place 2 dpex workers \(CPU: "
                                                 rf"{CORES + 1} asked per worker, the largest "
                                                 rf"node has {CORES}"):
        iter(loader)
    loader = DpexDataLoader(dsets.Squares(4), num_workers=CORES + 1, distribute_mode=True,
                            ray_remote_args={"num_cpus": 1})
    with pytest.raises(WorkerStartupError, match=rf"CPU: {CORES + 1} asked, {CORES} in the "
                                                 "cluster"):
        iter(loader)
    assert time.monotonic() - t0 < 5


def test_a_reservation_that_must_wait_is_named_within_seconds_with_who_holds_what(caplog):
    first = DpexDataLoader(dsets.Squares(8), batch_size=2, num_workers=CORES,
                           persistent_workers=True, distribute_mode=True,
                           ray_remote_args={"num_cpus": 1})
    list(first)  # its workers hold every CPU of the machine now
    second = DpexDataLoader(dsets.Squares(8), batch_size=2, num_workers=1,
                            distribute_mode=True, ray_remote_args={"num_cpus": 1},
                            startup_timeout=60)
    closer = threading.Timer(6.0, first.close)  # frees the CPUs after a while
    t0 = time.time()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        closer.start()
        try:
            got = list(second)  # waits for the CPUs, then the whole epoch
        finally:
            closer.join()
    assert len(got) == 4 and time.time() - t0 >= 6.0
    placement = [w for w in caught if issubclass(w.category, PlacementWarning)]
    assert len(placement) == 1
    text = str(placement[0].message)
    assert "each reserves CPU 1" in text and "only CPU 0 free" in text
    assert f"{CORES} workers, each reserving CPU 1" in text and "over Squares" in text
    assert "leave num_cpus out of ray_remote_args" in text
    said = [r.created for r in caplog.records if "cannot be placed now" in r.getMessage()]
    assert said and said[0] - t0 < 4.0  # within seconds, long before the CPUs came free


def test_a_reservation_that_stays_unplaceable_fails_after_startup_timeout():
    hog = Holder.options(num_cpus=CORES).remote()
    ray.get(hog.ping.remote(), timeout=30)
    try:
        loader = DpexDataLoader(dsets.Squares(8), batch_size=1, num_workers=1,
                                distribute_mode=True, ray_remote_args={"num_cpus": 1},
                                startup_timeout=4)
        t0 = time.monotonic()
        with pytest.warns(PlacementWarning, match="cannot be placed now"), \
                pytest.raises(WorkerStartupError, match=r"workers \[0\] did not start within"):
            list(loader)
        assert time.monotonic() - t0 < 20
    finally:
        ray.kill(hog)


def test_custom_resources_are_reserved_exactly_as_asked():
    # The embedded default has no "prep" resource: a worker that needs one can never fit.
    loader = DpexDataLoader(dsets.Squares(4), num_workers=1, distribute_mode=True,
                            ray_remote_args={"resources": {"prep": 1}})
    with pytest.raises(WorkerStartupError, match=r"prep: 1 asked per worker, the largest "
                                                 r"node has 0"):
        iter(loader)


def test_an_autoscaling_cluster_is_not_refused_for_todays_size(monkeypatch):
    from dpex import _cluster

    assert _cluster._autoscaling_max() is None  # the embedded default does not autoscale
    loader = DpexDataLoader(dsets.Squares(4), num_workers=CORES * 4, distribute_mode=True,
                            ray_remote_args={"num_cpus": 1}, startup_timeout=60)
    with pytest.raises(WorkerStartupError, match="cannot place"):
        iter(loader)
    # The same request where the autoscaler may grow the cluster to 64 CPUs: accepted
    # (it waits for the new nodes), refused only beyond what the cluster can become.
    monkeypatch.setattr(_cluster, "_autoscaling_max", lambda: {"CPU": 64.0})
    it = iter(loader)
    assert not it.closed
    it._shutdown_workers()
    loader = DpexDataLoader(dsets.Squares(4), num_workers=65, distribute_mode=True,
                            ray_remote_args={"num_cpus": 1})
    with pytest.raises(WorkerStartupError, match="CPU: 65 asked, at most 64 after autoscaling"):
        iter(loader)


SPREAD_SCRIPT = """
import collections, json, os, sys
sys.path.insert(0, {tests!r})
import cloudpickle, dsets, ray, torch
from ray.cluster_utils import Cluster
from dpex import DpexDataLoader
cloudpickle.register_pickle_by_value(dsets)
# A head without CPUs (a common set-up: it runs nothing) and two CPU nodes.
cluster = Cluster(initialize_head=True, head_node_args={{"num_cpus": 0}})
small, big = cluster.add_node(num_cpus=1), cluster.add_node(num_cpus=3)
cluster.wait_for_nodes()
ray.init(address=cluster.address)
try:
    loader = DpexDataLoader(dsets.Squares(24), batch_size=2, num_workers=4,
                            distribute_mode=True, persistent_workers=True)
    batches = list(loader)
    nodes = collections.Counter(w["node_id"] for w in loader.stats()["workers"].values())
    loader.close()
    expected = list(dsets.torch_loader(dsets.Squares(24), batch_size=2, num_workers=0))
    dsets.assert_same(expected, batches)
    names = {{cluster.head_node.node_id: "head", small.node_id: "small", big.node_id: "big"}}
    print(json.dumps({{names[n]: k for n, k in nodes.items()}}))
finally:
    ray.shutdown()
    cluster.shutdown()
"""


@pytest.mark.slow
def test_workers_spread_over_the_cpu_nodes_of_a_real_cluster():
    import json
    import subprocess
    import sys

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    tests = os.path.dirname(os.path.abspath(__file__))
    proc = subprocess.run([sys.executable, "-c", SPREAD_SCRIPT.format(tests=tests)],
                          capture_output=True, text=True, timeout=240, env=env)
    assert proc.returncode == 0, proc.stderr[-4000:]
    placed = json.loads(proc.stdout.strip().splitlines()[-1])
    assert placed == {"small": 1, "big": 3}  # by CPU count, none on the CPU-less head
