"""The iterator's elastic worker set: ``scale_to(n)`` (``loader.scale_workers``) and the
autoscaler's loop (``num_workers=dpex.Autoscale(...)``), as a mixin of
:class:`~dpex.client._iterator.RayDataLoaderIter`.

The rules live in pure objects (:class:`~dpex.client._scheduler.EpochScheduler`'s
``add_worker``/``retire_worker``, :class:`~dpex.client._autoscaler.Autoscaler`);
this carries out their actions: starting a worker, ending a retired one's session.
It uses the iterator's ``_apply``, ``_next_index``, ``_new_ring``, ``_sched``,
``_specs``, ``_runtime``, ``_session``, ``_loop``, ``_shipped``, ``_autoscaler``,
``_added_at``, the loop's cumulative ``_waited_total`` and ``_taken_total``,
``_startup_timeout`` and ``_loader_ref``.
"""

from __future__ import annotations

import dataclasses
import logging
import threading
import time
from typing import Any

import ray
from torch.utils.data import _DatasetKind

from dpex.errors import IteratorClosedError

__all__ = ["ElasticWorkers", "mean"]

logger = logging.getLogger("dpex")


def mean(values: Any) -> float | None:
    """(The mean, not the median: a worker's throughput is 1 / its mean batch time,
    heavy tails included.)"""
    values = list(values)
    return sum(values) / len(values) if values else None


class ElasticWorkers:
    _sched: Any
    _specs: list
    _runtime: Any
    _session: Any
    _loop: Any
    _shipped: Any
    _autoscaler: Any
    _added_at: dict[int, float]
    _waited_total: float
    _taken_total: int
    _startup_timeout: float
    _dataset_kind: Any
    _worker_shared_seed: Any
    _loader_ref: Any
    _training_thread: int  # the thread that takes the batches (the scheduler is its own)
    _scale_request: int | None  # a count asked for from another thread, not yet carried out

    def _scale_as_requested(self) -> None:
        """On the training thread: carry out a count asked for from another thread."""
        n, self._scale_request = self._scale_request, None
        if n is not None:
            self.scale_to(n)

    def scale_to(self, n: int) -> None:
        """Run ``n`` workers from now on (map-style datasets): new ones take tasks once
        ready; removed ones finish what they hold first. Nothing is lost or repeated.
        Called on another thread than the training loop's (a control server, say), it
        is carried out by the training thread at its next batch (the scheduler is that
        thread's alone)."""
        if isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"scale_to() takes a worker count >= 1, got {n!r}")
        if self._dataset_kind == _DatasetKind.Iterable:
            raise ValueError("an IterableDataset's worker count is fixed: each worker "
                             "iterates its own shard")
        if threading.get_ident() != self._training_thread:
            self._scale_request = n
            return
        if self._runtime.closed:
            raise IteratorClosedError("this dpex iterator was closed; iterate the loader again")
        while self._sched.num_workers < n:
            self._apply(self._sched.add_worker(self._next_index))
        while self._sched.num_workers > n:
            self._apply(self._sched.retire_worker())
        loader = self._loader_ref()
        if loader is not None:  # the next iterator starts with as many
            loader._autoscale_workers = n

    def _autoscale(self) -> None:
        """Once per ``interval``: ask the autoscaler, and carry out its decision."""
        scaler = self._autoscaler
        assert scaler is not None
        now = time.monotonic()
        if not scaler.due(now):
            return
        if not self._sched.workers.all_ready():  # starting up: not the loop's pace yet
            scaler.begin(now, self._waited_total, self._taken_total)
            return
        self._give_up_unstarted()
        records = self._sched.workers.records
        # (an added worker starts at its first result: its HELLO can come long before,
        # while its session loads the dataset)
        starting = sum(r.added and not r.batches and not r.gone for r in records)
        workers = self._sched.num_workers
        new = scaler.tick(now, self._waited_total, self._taken_total, workers, starting,
                          mean(self._sched.batch_times), self._room(),
                          in_flight=self._sched.in_flight)
        if new is None or new == workers:
            return
        decision = scaler.decisions[-1]
        logger.info("dpex autoscale: %d -> %d workers: %s", workers, new, decision["reason"])
        self.scale_to(new)

    def _give_up_unstarted(self) -> None:
        """An added worker (or its replacement) not ready within ``startup_timeout`` is
        given up: the others take what it held."""
        now = time.monotonic()
        for rec in self._sched.workers.records:
            if (rec.added and not rec.ready and rec.accepting
                    and now - self._added_at.get(rec.id, now) > self._startup_timeout
                    and self._sched.num_workers > 1):
                logger.warning("dpex: added worker %s did not start within %g s; given up",
                               rec.id, self._startup_timeout)
                self._apply(self._sched.retire_worker(rec.id))

    def _room(self) -> int | None:
        """How many more workers the cluster can place now (None: they reserve nothing,
        so any number can; the autoscaler notices when they no longer help)."""
        demand = getattr(self._runtime.workers, "demand", None)
        if not demand:
            return None
        free = ray.available_resources()
        return max(0, min(int(free.get(name, 0.0) // amount) for name, amount in demand.items()))

    def _start_worker(self, w: int) -> None:
        """Start an added worker (a new id), seeded as torch seeds worker ``w``."""
        assert w == len(self._specs), (w, len(self._specs))
        self._specs.append(dataclasses.replace(
            self._specs[0], worker_id=w, incarnation=0, ring=self._new_ring(w),
            shared_seed=self._worker_shared_seed, rng_state=None,
            num_workers=self._sched.num_workers))
        self._added_at[w] = time.monotonic()
        self._runtime.workers.add(self._specs[w], self._shipped)

    def _stop_worker(self, w: int) -> None:
        """A retired worker holds nothing: end its session (its exit is expected)."""
        self._runtime.workers.retire(w)
        self._loop.call_soon(self._session.forget, w)
        ring = self._specs[w].ring
        if ring is not None:
            self._loop.call_soon(self._session.retire_ring, ring.ring_id)

