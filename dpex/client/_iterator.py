"""The synchronous iterator a training loop sees: torch's face of dpex's workers.

The sampler stays here, on the training thread, drawn lazily as credits allow
(exactly where torch draws it); each epoch's batches come from the iterator's
:class:`~dpex.client._driver.EpochDriver`, which owns the loop thread, the session,
the workers and the scheduler. This class keeps what torch's iterators keep (the
epoch, what it yielded, pinning) and what ``state_dict()`` asks of it.
"""

from __future__ import annotations

import functools
import itertools
import time
import traceback
import weakref
from typing import Any

from torch.utils.data import IterDataPipe, MapDataPipe, _DatasetKind, _utils
from torch.utils.data.dataloader import _BaseDataLoaderIter, _sharding_worker_init_fn

from dpex._config import DpexConfig
from dpex._protocol import Kind
from dpex._reaper import finalizer_for
from dpex._spec import ShippedLoader, restores_dataset, stateful_dataset
from dpex._start_trace import mark
from dpex._stats import Latencies, LoaderStats
from dpex.client._book import IteratorBook
from dpex.client._driver import EpochDriver, Seeds
from dpex.client._events import Handoff
from dpex.client._interrupts import held, interruptible
from dpex.client._launch import plan_launch
from dpex.client._ray_runtimes import RayRuntimes
from dpex.client._report import iterator_stats
from dpex.client._runtime import Runtimes
from dpex.client._scheduler import EPOCH_END
from dpex.client._taken import TakenRecord
from dpex.client._workers import WorkerProcess
from dpex.client.resume import Drawing, IteratorPosition, distributed_seed
from dpex.errors import IteratorClosedError

__all__ = ["RayDataLoaderIter"]

_DROPPED_RNG_QUERY_S = 2.0  # how long a dropped iterator asks its workers for their states
_iterator_ids = itertools.count()


class RayDataLoaderIter(_BaseDataLoaderIter):
    """Iterator of a ``DpexDataLoader`` with ``distribute_mode=True, num_workers > 0``;
    ``worker_class`` is the Ray actor class its own workers run (``DpexWorker``);
    ``book``: the loader's :class:`~dpex.client._book.IteratorBook`, which this
    iterator reports to (it writes nothing into the loader); ``runtimes``: the world
    its workers run in (:class:`~dpex.client._runtime.Runtimes`; Ray's by default)."""

    def __init__(self, loader: Any, config: DpexConfig, worker_class: type,
                 book: IteratorBook, runtimes: Runtimes | None = None) -> None:
        super().__init__(loader)
        runtimes = runtimes if runtimes is not None else RayRuntimes()
        self._book = book
        # How many workers, which one takes the first batch, what each starts from and
        # how batches are seeded: decided in one pure function (_launch.py).
        plan = plan_launch(
            num_workers=loader.num_workers, scaled_to=book.scaled_to,
            prefetch_factor=loader.prefetch_factor,
            iterable=self._dataset_kind == _DatasetKind.Iterable,
            worker_seeding=config.worker_seeding, resume=self._index_sampler.resume,
            base_seed=self._base_seed, sampler_seed=distributed_seed(self._index_sampler))
        self._launch = plan
        self._num_workers = plan.num_workers
        mark("ray connect")
        runtimes.connect(config.head_address)
        mark("ray connected")
        worker_init_fn = loader.worker_init_fn
        if isinstance(self._dataset, (IterDataPipe, MapDataPipe)):
            # As torch: DataPipes are sharded across ranks and workers before worker_init_fn.
            worker_init_fn = functools.partial(
                _sharding_worker_init_fn, worker_init_fn, self._world_size, self._rank)
        contents = ShippedLoader(
            dataset=self._dataset, dataset_kind=self._dataset_kind,
            auto_collation=self._auto_collation, collate_fn=self._collate_fn,
            drop_last=self._drop_last, worker_init_fn=worker_init_fn)
        handoff = Handoff()
        number = next(_iterator_ids)
        label = f"iterator {number} of a DpexDataLoader over {type(self._dataset).__name__}"
        runtime = runtimes.make(f"dpex-loop-{number}", handoff, config, label, worker_class)
        # Dropped without being closed: torn down on dpex's reaper thread (see _reaper).
        self._finalizer = weakref.finalize(self, finalizer_for(runtime.close))
        # Resuming: an IterableDataset's workers also pass over what they delivered
        # before (or load their dataset's own state), and those whose shards ended stay
        # ended.
        self._resume_first_worker = plan.first_worker
        iterable = self._dataset_kind == _DatasetKind.Iterable
        self._taken = TakenRecord(self._num_workers, iterable,
                                  iterable and stateful_dataset(self._dataset), plan.shards)
        self._driver = EpochDriver(
            runtime, handoff, config, plan, Seeds(self._base_seed, self._shared_seed),
            ship=functools.partial(runtimes.ship, loader, contents,
                                   config.worker_pool is not None),
            node_id=runtimes.node_id(), free_resources=runtimes.free_resources,
            prefetch_factor=loader.prefetch_factor,
            in_order=loader.in_order, iterable=iterable, timeout=self._timeout,
            on_stop=self._shutdown_workers, on_scaled=book.scaled)
        self._reset(loader, first_iter=True)

    # -- epochs --------------------------------------------------------------------

    def _reset(self, loader: Any, first_iter: bool = False) -> None:
        super()._reset(loader, first_iter)
        if not first_iter and self._driver.closed:
            raise IteratorClosedError("this dpex iterator was closed; iterate the loader again")
        self._epoch_t0, self._epoch_end = time.monotonic(), None
        self._latencies = Latencies()  # this epoch's, as the wait
        # The RESUME payload is the IterDataPipe seed of the new epoch (None otherwise).
        first_worker, self._resume_first_worker = self._resume_first_worker, 0
        self._taken.new_epoch()
        # A worker passes over what it delivered, unless it resumes its dataset's own state.
        specs = self._driver.specs
        skips = {w: n for w, n in self._taken.count.items()
                 if not restores_dataset(specs[w].rng_state)}
        start = functools.partial(self._driver.start_epoch, self._next_index,
                                  shared_seed=self._shared_seed, first_worker=first_worker,
                                  ended=frozenset(self._taken.ended), skips=skips)
        drawing = self._sampler_iter
        # A resumed epoch draws its first batches at the first next(), not here: a
        # framework sets the sampler's epoch after iter() (Lightning's fit loop on a
        # restart), and the saved position belongs to that epoch.
        self._deferred_start = None
        if first_iter and isinstance(drawing, Drawing) and drawing.resume is not None:
            self._deferred_start = start
        else:
            start()

    @property
    def _epoch(self) -> int:
        return self._driver.sched.epoch

    @property
    def _ready(self) -> dict[int, dict]:
        """The HELLO of each worker whose current incarnation is ready."""
        return self._driver.ready

    def scale_to(self, n: int) -> None:
        """Run ``n`` workers from now on (``loader.scale_workers``; see
        :meth:`~dpex.client._elastic.Elastic.scale_to`)."""
        self._driver.elastic.scale_to(n, self._next_index)

    # -- consuming -------------------------------------------------------------

    def _next_index(self) -> Any:
        """The next index batch (the scheduler draws them); worker_seeding="per_sample":
        with each entry's position in the epoch."""
        index = super()._next_index()
        if self._launch.sample_seed is None or not isinstance(self._sampler_iter, Drawing):
            return index
        return self._sampler_iter.positioned(index, self.epochs_served)

    def __next__(self) -> Any:
        try:
            with held(keep_on_return=True):  # Ctrl-C raised in the waits (_interrupts)
                data = super().__next__()
                drawing = self._sampler_iter
                if isinstance(drawing, Drawing):  # (what state_dict() may still ask for)
                    drawing.yielded(drawing.yielded_of(self._num_yielded))
            return data
        except StopIteration:
            raise
        except BaseException as exc:
            # The traceback holds every frame below this one and each of them holds this
            # iterator, so it would live (with its workers) as long as the exception is
            # kept. Clearing their locals releases an iterator that nothing else refers
            # to (a `for` loop's, once the error has left the loop) at once, as a dropped
            # iterator is; one the caller still holds goes on, as torch's does.
            traceback.clear_frames(exc.__traceback__)
            del self
            raise

    def _next_data(self) -> Any:
        driver = self._driver
        if driver.closed and self._epoch_end is None:  # an ended epoch stays ended
            raise IteratorClosedError("this dpex iterator was closed; iterate the loader again")
        if self._deferred_start is not None:
            with interruptible():  # (if it raises, the next call tries again)
                self._deferred_start()
            self._deferred_start = None
        while True:
            msg = driver.next_message(self._next_index)
            if msg is EPOCH_END:
                self._epoch_end = time.monotonic()
                if not self._persistent_workers:
                    self._shutdown_workers()
                raise StopIteration
            self._taken.took(msg)
            if msg.kind is Kind.END:
                continue
            if msg.kind is Kind.ERROR:
                msg.payload.reraise()
            data = msg.payload
            driver.taken_total += 1
            if driver.taken_total == 1:
                mark("first batch")
            if self._pin_memory:
                data = _utils.pin_memory.pin_memory(data, self._pin_memory_device)
            self._latencies.add(msg.ready_ns, time.time_ns())
            return data

    # -- state_dict() --------------------------------------------------------------

    def resume_points(self, mid_epoch: bool) -> dict[int, tuple[int, int]]:
        """See :meth:`TakenRecord.resume_points` (none with per-batch seeding of a
        map-style dataset: its workers' RNG states say nothing about later batches)."""
        if self._launch.per_batch and self._dataset_kind != _DatasetKind.Iterable:
            return {}
        points = self._taken.resume_points(self._driver.sched.epoch, mid_epoch)
        # a retired worker's session is gone: nobody to ask (its id resumes from its seed)
        return {w: at for w, at in points.items() if not self._driver.sched.workers[w].gone}

    @property
    def rng_worker_count(self) -> int:
        """The worker count the workers' RNG states belong to; 0 once workers were added
        or retired (their ids no longer say which batches they make)."""
        changed = self._driver.sched.counters["added"] or self._driver.sched.counters["retired"]
        return 0 if changed else self._num_workers

    @property
    def epochs_served(self) -> int:
        """Epochs begun with this iterator's base seed, a resumed run's before it included."""
        return self._launch.epochs_before + self._driver.sched.epoch

    def shard_positions(self) -> dict:
        """See :meth:`TakenRecord.shard_positions` (for ``state_dict()``)."""
        return self._taken.shard_positions(
            self._driver.sched.ledger.worker_of(self._driver.sched.buffer.next_seq))

    def position(self, iterator_rng: Any) -> IteratorPosition:
        """Where this iterator stands, for ``state_dict()`` (``iterator_rng``: the RNG
        state the loader drew its base seed from)."""
        drawing = self._sampler_iter
        ended = self._epoch_end is not None
        if not isinstance(drawing, Drawing):
            return IteratorPosition(None, self._num_yielded, ended, iterator_rng)
        yielded = drawing.yielded_of(self._num_yielded)
        ended = ended or drawing.ended_at(yielded)
        return IteratorPosition(drawing, yielded, ended, iterator_rng,
                                epochs_served=self.epochs_served, workers=self)

    def worker_rng_states(self, asked: dict[int, tuple[int, int]], limit: float | None = None
                          ) -> dict[int, dict | None] | None:
        """See :meth:`EpochDriver.worker_rng_states`."""
        return self._driver.worker_rng_states(asked, limit)

    # -- lifecycle and introspection -------------------------------------------

    def _shutdown_workers(self) -> None:
        """Stop the actors, close the sockets and join the loop thread (idempotent);
        leave the final counters with the loader, for ``loader.stats()``. Here, on the
        training thread: an explicit end, not garbage collection."""
        self._finalizer.detach()
        self._driver.runtime.close()
        self._book.ended(self.stats())

    @property
    def _workers(self) -> list[WorkerProcess]:
        """The current worker of each id, as torch's ``_workers`` (process-like handles)."""
        workers, known = self._driver.runtime.workers, self._driver.known
        # pid: the process running the worker's dataset code, as torch's (a session's own
        # process on a warm worker or a fleet; else the actor's).
        return [WorkerProcess(workers, w, actor, known.get(w, {}).get(
                    "session_pid", known.get(w, {}).get("pid")))
                for w, actor in sorted(workers.actors.items())]

    @property
    def closed(self) -> bool:
        """True once this iterator's workers, sockets and thread are stopped."""
        return self._driver.closed

    def stats(self, wait: bool = True) -> LoaderStats:
        """This iterator's counters and data-stall figures (docs/STATS.md); see
        :func:`~dpex.client._report.iterator_stats`."""
        epoch_s = (self._epoch_end or time.monotonic()) - self._epoch_t0
        return iterator_stats(self._driver, epoch_s, self._latencies.summary(), wait)

    def __del__(self) -> None:
        # Dropped in the middle of an epoch (a loop left with `break`): the loader's book
        # keeps where it stood, for a state_dict() after the loop, and its counters.
        if hasattr(self, "_book") and hasattr(self, "_driver") and not self._driver.closed:
            # (its workers' states too, asked from the thread that took its batches)
            self._book.dropped(self, self._driver.elastic.is_training_thread(),
                               _DROPPED_RNG_QUERY_S, functools.partial(self.stats, wait=False))
        # The finalizer is the safety net; this only makes the common case prompt.
        finalizer = getattr(self, "_finalizer", None)
        if finalizer is not None:
            finalizer()
