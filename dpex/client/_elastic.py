"""An iterator's elastic worker set: ``scale_to(n)`` (``loader.scale_workers``) and the
autoscaler's loop (``num_workers=dpex.Autoscale(...)``), composed into its
:class:`~dpex.client._driver.EpochDriver`.

The rules live in pure objects (:class:`~dpex.client._scheduler.EpochScheduler`'s
``add_worker``/``retire_worker``, :class:`~dpex.client._autoscaler.Autoscaler`);
this asks them and has the driver carry out their actions, of which the driver hands
back here the two only an elastic set has (``StartWorker``: starting an added worker,
``StopWorker``: ending a retired one's session). It reads the driver's scheduler,
runtime, session, shipment and cumulative wait and take counts, and calls its
``apply``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
import weakref
from collections.abc import Callable
from typing import Any

import ray

from dpex._autoscale import Autoscale
from dpex.client._autoscaler import Autoscaler
from dpex.errors import IteratorClosedError

__all__ = ["Elastic", "mean"]

logger = logging.getLogger("dpex")


def mean(values: Any) -> float | None:
    """(The mean, not the median: a worker's throughput is 1 / its mean batch time,
    heavy tails included.)"""
    values = list(values)
    return sum(values) / len(values) if values else None


class Elastic:
    """Adds and retires a driver's workers, on request or by its autoscaler."""

    def __init__(self, driver: Any, policy: Autoscale | None, iterable: bool,
                 on_scaled: Callable[[int], None]) -> None:
        """``driver``: the :class:`~dpex.client._driver.EpochDriver` that owns this;
        ``policy``: ``num_workers=dpex.Autoscale(...)`` (None: only ``scale_to``);
        ``on_scaled(n)``: tell the loader (its next iterator starts with ``n``)."""
        self._driver = weakref.proxy(driver)  # (its owner: no reference cycle)
        self._iterable = iterable
        self._on_scaled = on_scaled
        # the thread that takes the batches (the scheduler is its alone), and a count
        # asked for from another thread, not yet carried out
        self._training_thread, self._request = threading.get_ident(), None
        self.autoscaler: Autoscaler | None = None
        if policy is not None:
            most = policy.max or max(1, int(ray.cluster_resources().get("CPU", 1)))
            self.autoscaler = Autoscaler(policy, most, time.monotonic())

    def on_training_thread(self) -> None:
        """The calling thread takes the batches from now on."""
        self._training_thread = threading.get_ident()

    def is_training_thread(self) -> bool:
        """Whether the calling thread is the one that takes the batches."""
        return threading.get_ident() == self._training_thread

    def begin(self) -> None:
        """An epoch begins (the time between epochs is not the loop's)."""
        if self.autoscaler is not None:
            d = self._driver
            self.autoscaler.begin(time.monotonic(), d.waited_total, d.taken_total)

    def tick(self, draw: Callable[[], Any]) -> None:
        """Before each take: a count asked for from another thread, then the autoscaler."""
        n, self._request = self._request, None
        if n is not None:
            self.scale_to(n, draw)
        if self.autoscaler is not None:
            self._autoscale(draw)

    def scale_to(self, n: int, draw: Callable[[], Any]) -> None:
        """Run ``n`` workers from now on (map-style datasets): new ones take tasks once
        ready; removed ones finish what they hold first. Nothing is lost or repeated.
        Called on another thread than the training loop's (a control server, say), it
        is carried out by the training thread at its next batch (the scheduler is that
        thread's alone)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"scale_to() takes a worker count >= 1, got {n!r}")
        if self._iterable:
            raise ValueError("an IterableDataset's worker count is fixed: each worker "
                             "iterates its own shard")
        if threading.get_ident() != self._training_thread:
            self._request = n
            return
        d = self._driver
        if d.closed:
            raise IteratorClosedError("this dpex iterator was closed; iterate the loader again")
        while d.sched.num_workers < n:
            d.apply(d.sched.add_worker(draw))
        while d.sched.num_workers > n:
            d.apply(d.sched.retire_worker())
        self._on_scaled(n)

    def _autoscale(self, draw: Callable[[], Any]) -> None:
        """Once per ``interval``: ask the autoscaler, and carry out its decision."""
        scaler, d = self.autoscaler, self._driver
        assert scaler is not None
        now = time.monotonic()
        if not scaler.due(now):
            return
        if not d.sched.workers.all_ready():  # starting up: not the loop's pace yet
            scaler.begin(now, d.waited_total, d.taken_total)
            return
        self.give_up_unstarted()
        records = d.sched.workers.records
        # (an added worker starts at its first result: its HELLO can come long before,
        # while its session loads the dataset)
        starting = sum(r.added and not r.batches and not r.gone for r in records)
        workers = d.sched.num_workers
        new = scaler.tick(now, d.waited_total, d.taken_total, workers, starting,
                          mean(d.sched.batch_times), self._room(),
                          in_flight=d.sched.in_flight)
        if new is None or new == workers:
            return
        decision = scaler.decisions[-1]
        logger.info("dpex autoscale: %d -> %d workers: %s", workers, new, decision["reason"])
        self.scale_to(new, draw)

    def give_up_unstarted(self) -> None:
        """An added worker (or its replacement) not ready within ``startup_timeout`` is
        given up: the others take what it held."""
        d = self._driver
        now = time.monotonic()
        for rec in d.sched.workers.records:
            if (rec.added and not rec.ready and rec.accepting
                    and now - (rec.started_at or now) > d.startup_timeout
                    and d.sched.num_workers > 1):
                logger.warning("dpex: added worker %s did not start within %g s; given up",
                               rec.id, d.startup_timeout)
                d.apply(d.sched.retire_worker(rec.id))

    # -- the actions only an elastic worker set has (the driver's apply() hands them here)

    def start_worker(self, w: int) -> None:
        """Start an added worker (a new id, its record just made), seeded as torch seeds
        worker ``w``."""
        d = self._driver
        rec = d.sched.workers[w]
        assert rec.spec is None, w
        rec.spec = dataclasses.replace(
            d.sched.workers[0].spec, worker_id=w, incarnation=0, ring=d.new_ring(w),
            shared_seed=d.shared_seed, rng_state=None, num_workers=d.sched.num_workers)
        rec.started_at = time.monotonic()
        d.runtime.workers.add(rec.spec, d.shipment)

    def stop_worker(self, w: int) -> None:
        """A retired worker holds nothing: end its session (its exit is expected)."""
        d = self._driver
        d.runtime.workers.retire(w)
        d.session.forget(w)
        ring = d.sched.workers[w].spec.ring
        if ring is not None:
            d.session.retire_ring(ring.ring_id)

    def _room(self) -> int | None:
        """How many more workers the cluster can place now (None: they reserve nothing,
        so any number can; the autoscaler notices when they no longer help)."""
        demand = getattr(self._driver.runtime.workers, "demand", None)
        if not demand:
            return None
        free = ray.available_resources()
        return max(0, min(int(free.get(name, 0.0) // amount) for name, amount in demand.items()))
