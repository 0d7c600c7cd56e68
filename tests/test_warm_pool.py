"""The warm pool's own thread, without Ray (its Ray calls stubbed)."""

import queue
import time
from types import SimpleNamespace

import fake_runtime
import pytest
import ray

from dpex._spec import WorkerSpec
from dpex.client import _hosts, _warm, _workers
from dpex.client._shipment import Shipment


def stub_ray(monkeypatch, wait):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(ray, "get_runtime_context",
                        lambda: SimpleNamespace(get_job_id=lambda: "01000000"))
    monkeypatch.setattr(_warm, "_reusable", lambda actor: True)
    monkeypatch.setattr(_warm, "_kill", lambda actor: None)


def test_a_returning_worker_is_kept_once_its_session_ended(monkeypatch):
    stub_ray(monkeypatch, lambda refs, num_returns=1, timeout=None: (list(refs), []))
    pool = _warm.WarmPool()
    actor = object()
    pool.give_back(actor, [object()], "key", None, 60)
    assert pool.wait_settled(5) and pool.idle_count() == 1
    assert pool.take("other", None) is None and pool.take("key", None) is actor
    assert pool.release() == 0


def test_the_pool_thread_outlives_a_failing_ray_call(monkeypatch):
    calls = []

    def flaky_wait(refs, num_returns=1, timeout=None):
        calls.append(1)
        if len(calls) == 1:
            raise RuntimeError("the GCS did not answer")
        return list(refs), []

    stub_ray(monkeypatch, flaky_wait)
    pool = _warm.WarmPool()
    pool.give_back(object(), [object()], "key", None, 60)
    assert pool.wait_settled(5) and pool.idle_count() == 1  # checked on the next round
    assert pool.release() == 1


def test_take_without_waiting_passes_over_a_returning_worker(monkeypatch):
    stub_ray(monkeypatch, lambda refs, num_returns=1, timeout=None: ([], list(refs)))
    monkeypatch.setattr(_warm, "_CHECK_S", 60.0)  # (it stays returning meanwhile)
    pool = _warm.WarmPool()
    pool.give_back(object(), [object()], "key", None, 60)
    started = time.monotonic()
    assert pool.take("key", None, wait=False) is None
    assert time.monotonic() - started < 0.5
    pool.release()


class BlockingPool:
    """A pool whose take() waits as long as it is allowed to (a worker returning)."""

    def __init__(self):
        self.waits = []

    def take(self, key, node, wait=True):
        self.waits.append(wait)
        time.sleep(5.0 if wait else 0.0)
        return None


class FakeActorClass:
    started = 0

    @classmethod
    def options(cls, **options):
        return cls

    @classmethod
    def remote(cls, **kwargs):
        cls.started += 1
        ref = SimpleNamespace(future=lambda: SimpleNamespace(add_done_callback=lambda cb: None))
        return SimpleNamespace(serve=SimpleNamespace(remote=lambda spec, shipped: ref),
                               _actor_id=SimpleNamespace(hex=lambda: f"{cls.started:x}"))


@pytest.mark.parametrize("how", ["restart", "add"])
def test_recovery_and_scale_up_never_wait_for_the_pool(monkeypatch, how):
    """A dead worker's replacement (or an added worker) starts at once on a fresh host
    when no idle one is there: the training thread, which carries it out, must not
    wait up to 5 s per worker for one that is still returning (issue 25, item 18)."""
    pool = BlockingPool()
    monkeypatch.setattr(_workers, "POOL", pool)
    monkeypatch.setattr(_hosts, "SHARED", _hosts.SharedHosts())  # (no live loader)
    nodes = iter(f"{n:056x}" for n in range(1, 100))  # each on a node of its own: no
    monkeypatch.setattr(_workers, "_nodes_for", lambda n: [next(nodes) for _ in range(n)])
    # actor of the group to host an added worker's session there
    group = _workers.WorkerGroup(object, {}, queue.SimpleQueue(), keep_s=60.0)
    group._actor_class = FakeActorClass
    started = time.monotonic()
    for w in range(3):
        spec = WorkerSpec(None, w, 3, 0, "", "", None, incarnation=1)
        getattr(group, how)(spec, Shipment(fake_runtime.Delivery(), False, 10))
    assert time.monotonic() - started < 1.0 and pool.waits == [False] * 3
    assert sorted(group.actors) == [0, 1, 2] and not group.warm
