"""The warm pool's own thread, without Ray (its Ray calls stubbed)."""

import ray

from dpex.client import _warm


def stub_ray(monkeypatch, wait):
    monkeypatch.setattr(ray, "is_initialized", lambda: True)
    monkeypatch.setattr(ray, "wait", wait)
    monkeypatch.setattr(_warm, "_reusable", lambda actor: True)
    monkeypatch.setattr(_warm, "_kill", lambda actor: None)


def test_a_returning_worker_is_kept_once_its_session_ended(monkeypatch):
    stub_ray(monkeypatch, lambda refs, num_returns=1, timeout=None: (list(refs), []))
    pool = _warm.WarmPool()
    actor = object()
    pool.give_back(actor, object(), "key", None, 60)
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
    pool.give_back(object(), object(), "key", None, 60)
    assert pool.wait_settled(5) and pool.idle_count() == 1  # checked on the next round
    assert pool.release() == 1
