"""Shared fixtures: one local Ray instance per test session, on loopback."""

import os
import sys

import cloudpickle
import pytest

sys.path.insert(0, os.path.dirname(__file__))
import dsets  # noqa: E402

# Test datasets live in this folder, which Ray workers cannot import: ship them by value.
cloudpickle.register_pickle_by_value(dsets)


@pytest.fixture(scope="session")
def ray_session():
    import ray

    if not ray.is_initialized():
        ray.init(num_cpus=8, _node_ip_address="127.0.0.1", include_dashboard=False,
                 log_to_driver=False)
    yield ray
    ray.shutdown()


@pytest.fixture(autouse=True)
def no_leaked_actors(request):
    """A test that uses Ray must give back every CPU its actors held (STYLE: leaks fail)."""
    yield
    if "ray_session" not in request.fixturenames:
        return
    import gc

    gc.collect()  # iterators kept alive only by reference cycles (tracebacks) go now
    dsets.wait_cluster_idle(limit=10.0)
