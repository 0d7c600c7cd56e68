"""Shared fixtures and the test tiers.

- ``ray_session``: one Ray instance per test process (``scripts/test.sh`` runs two,
  pytest-xdist, so two embedded instances share the machine), started the way dpex
  starts it for a user: the embedded default, this machine's cores, nothing special.
- Leaks fail: a test on that instance must stop every worker it started.
- The tiers (README, Development), chosen per test: ``pytest_collection_modifyitems``
  marks ``e2e`` a test marked ``slow``, else ``ray`` one that uses the ``ray_session``
  fixture (or is marked ``ray``: one that asks for the fixture only in some of its
  cases), else ``e2e`` one marked ``subprocess``; the ``fast`` tier is none of them,
  and ``fast_tier_guard`` makes any process or Ray start there fail, naming the test's
  missing marker.
- ``inprocess``: dpex's workers run in this process (tests/inprocess.py: the real task
  runner, no Ray), for the loader's, iterator's and resume's rules in the fast tier.
- Test datasets are shipped to Ray workers by value, and torch's reference loaders'
  forkserver preloads them.
"""

import multiprocessing
import os
import sys

import cloudpickle
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import dsets  # noqa: E402
import resumable  # noqa: E402

# torch's reference loaders start their workers by forkserver (dsets.torch_loader): the
# forkserver imports torch and the test datasets once, so each worker forks with them
# loaded instead of importing torch again (about 1.5 s of CPU per worker here).
multiprocessing.set_forkserver_preload(["torch", "numpy", "dsets", "resumable"])

# Test datasets live in this folder, which Ray workers cannot import: ship them by value.
cloudpickle.register_pickle_by_value(dsets)
cloudpickle.register_pickle_by_value(resumable)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    from dpex._ray_connect import connect_ray

    connect_ray("auto")  # what a user's first DpexDataLoader iterator does
    yield ray
    import dpex

    dpex.release_warm_workers()
    ray.shutdown()


@pytest.fixture(autouse=True)
def trainer_process_state():
    """torch's worker loop sets process-wide state in its worker process (what
    ``get_worker_info()`` returns, one torch thread), and so does dpex's (TaskRunner).
    Tests that run TaskRunners in this process (test_transport, the in-memory worker
    group) must not hand it to the next test, whose trainer would take itself for a
    worker: an IterableDataset in the trainer (``num_workers=0``) sharded itself as
    worker 1 of 3 and yielded nothing, when the suite ran in another order."""
    import torch
    from torch.utils.data._utils import worker

    info, threads = worker._worker_info, torch.get_num_threads()
    yield
    worker._worker_info = info
    torch.set_num_threads(threads)


@pytest.fixture(autouse=True)
def no_leaked_actors(request):
    """A test that uses Ray must stop every worker it started (STYLE: leaks fail)."""
    yield
    if "ray_session" not in request.fixturenames:
        return
    import gc

    gc.collect()  # iterators kept alive only by reference cycles (tracebacks) go now
    dsets.wait_no_workers(limit=10.0)


def pytest_collection_modifyitems(config, items):
    """The tiers as markers, per test: ``e2e`` for a test marked ``slow``, else ``ray``
    for one on the shared Ray instance (the ``ray_session`` fixture, directly or through
    ``usefixtures``, or a ``ray`` marker: torch's worker processes may run beside it),
    else ``e2e`` for one marked ``subprocess``; the ``fast`` tier is none of them
    (scripts/test.sh fast)."""
    for item in items:
        if item.get_closest_marker("slow"):
            item.add_marker(pytest.mark.e2e)
        elif "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
        elif item.get_closest_marker("ray"):
            pass  # (asks for the shared instance itself)
        elif item.get_closest_marker("subprocess"):
            item.add_marker(pytest.mark.e2e)


def _refused(what):
    def refuse(*args, **kwargs):
        raise AssertionError(
            f"a fast-tier test {what}: mark it `subprocess` (or `slow`) if it starts "
            "processes, or use the `ray_session` fixture (or the `ray` marker) for Ray")
    return refuse


@pytest.fixture(autouse=True)
def fast_tier_guard(request, monkeypatch):
    """The fast tier starts no process and no Ray: what would is refused by name."""
    if request.node.get_closest_marker("e2e") or request.node.get_closest_marker("ray"):
        yield
        return
    import _posixsubprocess
    import subprocess

    import ray

    monkeypatch.setattr(_posixsubprocess, "fork_exec", _refused("started a process"))
    monkeypatch.setattr(subprocess, "_fork_exec", _refused("started a process"),
                        raising=False)
    monkeypatch.setattr(os, "fork", _refused("forked"))
    monkeypatch.setattr(os, "posix_spawn", _refused("spawned a process"))
    monkeypatch.setattr(ray, "init", _refused("started Ray"))
    # A dpex loader's construction begins joining Ray on a thread (client/_early.py),
    # which could outlive the test and this guard: here it begins nothing (iter()
    # still connects, and is refused above).
    from dpex.client import _early

    monkeypatch.setattr(_early.EARLY, "begin", lambda *args, **kwargs: None)
    yield


@pytest.fixture
def dpex_workers(request):
    """Where a test's dpex workers run: on the shared Ray instance for a test marked
    ``ray`` (a real case of its kind), else in this process (tests/inprocess.py)."""
    if request.node.get_closest_marker("ray"):
        request.getfixturevalue("ray_session")
        yield None
        return
    from inprocess import workers_in_process

    with workers_in_process() as world:
        yield world


@pytest.fixture
def inprocess():
    """dpex's workers in this process (tests/inprocess.py): the real task runner over
    the shipped loader, without Ray; the in-process world, for a test to look into."""
    from inprocess import workers_in_process

    with workers_in_process() as world:
        yield world
