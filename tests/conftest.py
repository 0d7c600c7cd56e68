"""Shared fixtures and the test tiers.

- ``ray_session``: one Ray instance per test process (``scripts/test.sh`` runs two,
  pytest-xdist, so two embedded instances share the machine), started the way dpex
  starts it for a user: the embedded default, this machine's cores, nothing special.
- Leaks fail: a test on that instance must stop every worker it started.
- The tiers (README, Development): ``pytest_collection_modifyitems`` marks ``ray`` and
  ``e2e`` tests; the ``fast`` tier is neither.
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


# Test files whose tests (those that are not on the shared Ray instance already) start
# processes: examples and doc pages run as a user runs them, a session's own process,
# torch's worker processes, a script after `ray.shutdown()`. With the `slow` tests they
# are the `e2e` tier (README, Development).
E2E_FILES = frozenset({"test_docs.py", "test_session_process.py",
                       "test_resume_conformance.py", "test_ray_shutdown.py",
                       "test_worker_env.py"})


def pytest_collection_modifyitems(config, items):
    """The tiers as markers: ``ray`` for a test on the shared Ray instance (the
    ``ray_session`` fixture, directly or through ``usefixtures``), ``e2e`` for a slow
    test or one of E2E_FILES; the ``fast`` tier is neither (scripts/test.sh fast)."""
    for item in items:
        if item.get_closest_marker("slow") or item.path.name in E2E_FILES:
            item.add_marker(pytest.mark.e2e)
        elif "ray_session" in getattr(item, "fixturenames", ()):
            item.add_marker(pytest.mark.ray)
