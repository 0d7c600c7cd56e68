"""What one worker does for one session, without sockets: torch's worker loop.

Seeding, ``get_worker_info()``, ``worker_init_fn`` and the fetcher are set up
exactly as ``torch.utils.data._utils.worker._worker_loop`` does; each task
becomes the frames of one data message (a batch, a wrapped error, or END).
"""

from __future__ import annotations

import logging
import random
import time
from typing import Any

import torch
from torch._utils import ExceptionWrapper
from torch.utils.data import IterDataPipe, _DatasetKind
from torch.utils.data._utils import worker as torch_worker
from torch.utils.data.graph_settings import apply_random_seed

from dpex import _loader_pickle
from dpex._process_state import TrainerState
from dpex._protocol import Kind, ProtocolError
from dpex._shm import WorkerRing, collating_into
from dpex._spec import (
    DATASET_ITER_STATE,
    DATASET_STATE,
    FINISH_EPOCH,
    Parcel,
    Positioned,
    ShippedLoader,
    WorkerSpec,
    own_state,
    stateful_dataset,
)
from dpex._transport import SOCKET, RingTransport, Transport, encode_data
from dpex.errors import BatchTooLargeError, WorkerStartupError
from dpex.server._rng import (
    RngLog,
    RngRecorder,
    batch_seed,
    restore_rng,
    sample_seed,
    seed_batch,
    seed_sample,
)
from dpex.server._trainer_state import enter_trainer_state

__all__ = ["BASE_LOAD", "BaseLoad", "TaskRunner", "load_pickled", "load_shipped"]

logger = logging.getLogger("dpex")


def _seed_like_torch(base_seed: int, worker_id: int) -> int:
    seed = base_seed + worker_id
    random.seed(seed)
    torch.manual_seed(seed)
    try:
        import numpy as np
    except ImportError:
        return seed
    np.random.seed(torch_worker._generate_state(base_seed, worker_id))
    return seed


def load_shipped(shipped: Parcel, *, lend: bool | None = None,
                 unpickler: Any = None) -> ShippedLoader:
    """The shipped loader, unpickled from ``shipped`` (taken: its bytes are not kept once
    unpickled; the trainer's memfd mapped here, :class:`ShipmentUnavailable` if it is
    gone, and the trainer starts the worker again), or the one the fork base this
    process was forked from holds (``shipped.preloaded``: :data:`BASE_LOAD`). ``lend``
    and ``unpickler``: as :func:`dpex._loader_pickle.loads` takes them."""
    if shipped.preloaded:
        return BASE_LOAD.held()
    data = shipped.take()
    if data is None:
        raise WorkerStartupError("the shipped loader was unpickled once already")
    return load_pickled(data, lend=lend, unpickler=unpickler)


def _enter(head: dict) -> None:
    enter_trainer_state(TrainerState.from_head(head))


class _EachWorker:
    """A base's loader that each session unpickles itself, over the base's copy of the
    shipment (``data``: its buffers are lent, so the tensors and arrays stay the base's
    pages): unpickling it ran the dataset's own code or opened a descriptor (``why``)."""

    __slots__ = ("data", "why")

    def __init__(self, data: Any, why: str) -> None:
        self.data, self.why = data, why


class BaseLoad:
    """What a fork base (:mod:`dpex.server._fork_base`) does with the shipment it mapped:
    unpickle the loader and hold it here, where its sessions' :func:`load_shipped`
    reads it (each session is a fork of the base: the same module, the same object).
    Pickled by reference into the base; one per process (:data:`BASE_LOAD`)."""

    _held: Any = None  # the loader, the error unpickling raised, or an _EachWorker

    def __call__(self, data: Any, *, unpickler: Any = None) -> bool:
        """Unpickle the loader from ``data`` and hold it; False where that raised (each
        session raises it as its own :class:`WorkerStartupError`)."""
        try:
            BaseLoad._held = load_pickled(data, unpickler=unpickler)
        except BaseException as exc:  # noqa: BLE001 - held for each session
            BaseLoad._held = exc
            return False
        return True

    def each_worker(self, data: Any, why: str) -> None:
        """Drop the loader: each session unpickles its own from ``data`` (``why``)."""
        BaseLoad._held = _EachWorker(data, why)

    def held(self) -> ShippedLoader:
        """In a session forked from a base: its loader, or this worker's own unpickling
        of its bytes; raises what unpickling raised."""
        held = BaseLoad._held
        if isinstance(held, BaseException):
            raise held
        if isinstance(held, _EachWorker):  # this worker's own unpickling, as under spawn
            return load_pickled(held.data, lend=True)
        if held is None:
            raise RuntimeError("this process was not forked from a dpex fork base")
        return held

    def __reduce__(self) -> str:
        return "BASE_LOAD"


BASE_LOAD = BaseLoad()


def load_pickled(data: Any, *, lend: bool | None = None, unpickler: Any = None) -> ShippedLoader:
    """The shipped loader unpickled from its bytes (a bytes-like object: what a fork
    base holds), the trainer's directory and environment its header carries applied
    first."""
    try:
        return _loader_pickle.loads(data, lend=lend, unpickler=unpickler, enter=_enter)
    except ModuleNotFoundError as exc:
        raise WorkerStartupError(
            f"cannot unpickle the dataset: this worker cannot import module {exc.name!r}, "
            "which the dataset, collate_fn or worker_init_fn refer to: install it on every node, ship it with ray_remote_args={'runtime_env': {'py_modules': [...]}}, "
            "or call cloudpickle.register_pickle_by_value(module) before iterating"
        ) from exc
    except Exception as exc:
        raise WorkerStartupError(
            f"cannot unpickle the dataset: {type(exc).__name__}: {exc}"
        ) from exc


class TaskRunner:
    """One worker's view of a session. Not thread-safe: one fetch thread drives it.

    Construction raises :class:`WorkerStartupError` only if the shipped loader
    cannot be unpickled; an exception from ``worker_init_fn`` is kept and sent as
    the first task's result, as torch does, after which (as in torch) that
    worker has no fetcher until the next epoch.
    """

    def __init__(self, spec: WorkerSpec, shipped: Parcel, node: str = "?",
                 ring: WorkerRing | None = None, transport: Transport | None = None) -> None:
        """``ring``: the trainer's shared-memory ring when this worker shares its node
        (batches are collated into it and travel through it); ``transport``: how
        batches travel otherwise (the socket by default; a test's in-memory fake)."""
        self.spec = spec
        self.node = node
        self.ring = ring
        self.transport: Transport = (RingTransport(sender=ring) if ring is not None
                                     else transport or SOCKET)
        # The RNG states right after each recent task: state_dict() asks for those of
        # the last batch of this worker's that the training loop took.
        self._rng = RngLog(spec.rng_keep)
        self._recorder = RngRecorder()
        self._dataset_state_failed = False
        self.loader: ShippedLoader = load_shipped(shipped)
        torch.set_num_threads(1)
        self._setup(spec)

    def _setup(self, spec: WorkerSpec) -> None:
        seed = _seed_like_torch(spec.base_seed, spec.worker_id)
        self.dataset = self.loader.dataset
        self._shared_rng = torch.Generator()
        self._seed_datapipe(spec.shared_seed)
        self.info = torch_worker.WorkerInfo(
            id=spec.worker_id, num_workers=spec.num_workers, seed=seed, dataset=self.dataset,
        )
        torch_worker._worker_info = self.info
        self.exhausted = False
        self._skip: tuple[int, int] | None = None  # (epoch, batches) to fast-forward
        self.init_error: ExceptionWrapper | None = None
        self.fetcher = None
        try:
            if self.loader.worker_init_fn is not None:
                self.loader.worker_init_fn(spec.worker_id)
            saved = spec.rng_state or {}
            if spec.rng_state is not None:  # resumed: where the saved run's worker stood
                restore_rng(spec.rng_state)
                if DATASET_STATE in saved:  # a stateful dataset's own state: before iter()
                    self.dataset.load_state_dict(saved[DATASET_STATE])
                if saved.get(FINISH_EPOCH):  # a state between epochs: the old one's end
                    self._finish_saved_epoch(saved.get(DATASET_ITER_STATE))
            # The state when the epoch began (seq -1), before iter(dataset) draws: an
            # IterableDataset's position mid-epoch is that, and the batches delivered since.
            self._mark_epoch_start(1)
            self.fetcher = self._new_fetcher()
            if DATASET_ITER_STATE in saved and not saved.get(FINISH_EPOCH):
                # its iterator's own state: after iter() (torchdata's order)
                self.fetcher.dataset_iter.load_state_dict(saved[DATASET_ITER_STATE])
        except Exception:
            self.init_error = ExceptionWrapper(where=self._where())

    def _finish_saved_epoch(self, iterator_state: Any) -> None:
        """Run what was left of the saved run's epoch for this worker's dataset (its
        state was taken after its last batch: nothing is left but the end of its
        ``__iter__``, where a dataset that counts its epochs counts), dropping it."""
        if self.loader.dataset_kind != _DatasetKind.Iterable:
            return
        dataset_iter = iter(self.dataset)
        if iterator_state is not None:
            dataset_iter.load_state_dict(iterator_state)
        for _ in dataset_iter:
            pass

    def _seed_datapipe(self, shared_seed: int | None) -> None:
        if isinstance(self.dataset, IterDataPipe) and shared_seed is not None:
            self._shared_rng.manual_seed(shared_seed)
            self.dataset = apply_random_seed(self.dataset, self._shared_rng)

    def _new_fetcher(self) -> Any:
        ld = self.loader
        return _DatasetKind.create_fetcher(
            ld.dataset_kind, self.dataset, ld.auto_collation, ld.collate_fn, ld.drop_last
        )

    def _where(self, seq: int | None = None, indices: Any = None) -> str:
        where = f"in DataLoader worker process {self.spec.worker_id}"
        detail = f"dpex worker on node {self.node}"
        if seq is not None:
            shown = repr(indices)
            detail += f", batch {seq}, indices {shown if len(shown) <= 200 else shown[:197] + '...'}"
        return f"{where} ({detail})"

    def resume(self, shared_seed: int | None = None, epoch: int = 0) -> None:
        """Start epoch ``epoch`` on a persistent worker: a fresh fetcher, as torch does.
        A fast-forward still pending from an earlier epoch is dropped with it."""
        torch_worker._worker_info = self.info
        self.exhausted = False
        self._skip = None
        self._seed_datapipe(shared_seed)
        self._mark_epoch_start(epoch)
        self.fetcher = self._new_fetcher()

    def _mark_epoch_start(self, epoch: int) -> None:
        if self.spec.rng_keep:
            self._rng.epoch_began(epoch, self._snapshot(epoch_start=True))

    def skip(self, n: int, epoch: int) -> None:
        """A replacement's fast-forward: the first ``n`` batches of this worker's
        IterableDataset shard in ``epoch`` were delivered by its predecessor. They are
        passed over before the next task of that epoch, with its (placeholder) index;
        a task of a later epoch (or a RESUME) drops it: a new epoch starts the shard
        anew, as in torch."""
        if self.loader.dataset_kind == _DatasetKind.Iterable:
            self._skip = (epoch, n)

    def _fast_forward(self, epoch: int, indices: Any) -> None:
        (skip_epoch, n), self._skip = self._skip, None
        if skip_epoch != epoch:
            return
        for _ in range(n):
            try:
                self.fetcher.fetch(indices)
            except StopIteration:
                self.exhausted = True
                return
            except Exception:
                continue  # it was delivered as an error in its slot already

    def run_task(self, epoch: int, seq: int, indices: Any) -> list[Any]:
        """Fetch and collate one batch; return the frames of its data message."""
        if self.spec.batch_seeds is not None:
            before, skip = self.spec.batch_seeds
            seed_batch(batch_seed(self.spec.base_seed, before + epoch,
                                  seq + (skip if epoch == 1 else 0)))
        frames = self._run_task(epoch, seq, indices)
        if self.spec.rng_keep:
            self._rng.task_done(epoch, seq, self._snapshot())
        return frames

    def rng_after(self, epoch: int, seq: int) -> dict | None:
        """The RNG states right after task ``seq`` of ``epoch`` (seq -1: when the epoch
        began; None if this worker did not run it, or not recently), with a stateful
        IterableDataset's own state. Any thread."""
        return self._rng.after(epoch, seq)

    def _snapshot(self, epoch_start: bool = False) -> dict:
        """The RNG states, with a stateful IterableDataset's own state (``dataset``) and
        its iterator's (``dataset_iter``; a dataset that is its own iterator has only
        that one), torchdata's split: the first is loaded before ``iter()``, the second
        after."""
        state = self._recorder.capture()
        if self.loader.dataset_kind != _DatasetKind.Iterable:
            return state
        dataset_iter = getattr(self.fetcher, "dataset_iter", None) if not epoch_start else None
        for key, obj in ((DATASET_STATE, self.dataset), (DATASET_ITER_STATE, dataset_iter)):
            if obj is None or not stateful_dataset(obj) or (
                    key == DATASET_STATE and dataset_iter is self.dataset):
                continue
            try:
                state[key] = own_state(obj)
            except Exception as exc:  # its next batch says what is wrong, if anything is
                if epoch_start:  # (a dataset that is its own iterator, before iter())
                    continue
                if not self._dataset_state_failed:
                    self._dataset_state_failed = True
                    logger.warning("dpex worker %s: the dataset's state_dict() failed (%s: "
                                   "%s); a resumed worker passes over its batches instead",
                                   self.spec.worker_id, type(exc).__name__, exc)
        return state

    def _run_task(self, epoch: int, seq: int, indices: Any) -> list[Any]:
        wire, wid = self.spec.wire, self.spec.worker_id
        torch_worker._worker_info = self.info
        if self.init_error is not None:  # once, as torch; later tasks find no fetcher
            error, self.init_error = self.init_error, None
            return wire.encode(Kind.ERROR, epoch, seq, wid, error)
        if self._skip is not None and self.fetcher is not None:
            self._fast_forward(epoch, indices)
        if self.exhausted:
            return wire.encode(Kind.END, epoch, seq, wid)
        try:
            if self.fetcher is None:
                raise UnboundLocalError(  # torch's type for this case, with a clearer text
                    "this worker's worker_init_fn failed (raised on its first batch); as in "
                    "torch it has no fetcher until the next epoch")
            started = time.perf_counter()
            with collating_into(self.ring):
                batch = (self._fetch_per_sample(indices) if isinstance(indices, Positioned)
                         else self.fetcher.fetch(indices))
            ready_ns = time.time_ns()
            took_us = max(1, int((time.perf_counter() - started) * 1e6))
        except StopIteration:
            if self.loader.dataset_kind == _DatasetKind.Iterable:
                self.exhausted = True
                return wire.encode(Kind.END, epoch, seq, wid)
            return self._error(epoch, seq, indices)
        except Exception:
            return self._error(epoch, seq, indices)
        try:
            try:
                return encode_data(wire, epoch, seq, wid, batch, self.transport, ready_ns,
                                   took_us)
            except ProtocolError as exc:  # too large: the trainer would drop it unseen
                raise BatchTooLargeError(f"{exc}; raise DpexDataLoader(max_message_bytes=...) "
                                         "or use smaller batches") from None
        except Exception:
            return self._error(epoch, seq, indices)

    def _fetch_per_sample(self, task: Positioned) -> Any:
        """worker_seeding="per_sample": torch's fetch, with torch, ``random`` and NumPy
        seeded before each sample from its position in the epoch (so it draws the same
        whichever rank, worker or batch takes it). A dataset's ``__getitems__`` is not
        called: each sample is fetched on its own, after its seeding."""
        fetcher, seed = self.fetcher, self.spec.sample_seed
        assert fetcher is not None and seed is not None
        if not fetcher.auto_collation:  # batch_size=None: one sample per task
            seed_sample(sample_seed(seed, task.epoch, task.first))
            return fetcher.collate_fn(fetcher.dataset[task.indices])
        items = []
        for j, index in enumerate(task.indices):
            seed_sample(sample_seed(seed, task.epoch, task.first + j * task.stride))
            items.append(fetcher.dataset[index])
        return fetcher.collate_fn(items)

    def _error(self, epoch: int, seq: int, indices: Any) -> list[Any]:
        wrapper = ExceptionWrapper(where=self._where(seq, indices))
        wire, wid = self.spec.wire, self.spec.worker_id
        try:
            frames = wire.encode(Kind.ERROR, epoch, seq, wid, wrapper)
        except Exception:  # an exception type that cannot be pickled: keep its text
            wrapper.exc_type = RuntimeError
            frames = wire.encode(Kind.ERROR, epoch, seq, wid, wrapper)
        over = len(frames[2]) - wire.max_message_bytes
        if over > 0:  # the trainer would drop it unseen, and wait for the slot forever
            text = wrapper.exc_msg
            keep = max(0, (len(text) - over - 512) // 2)  # 512: room for the note
            wrapper.exc_msg = (
                f"{text[:keep]}\n[... {len(text) - 2 * keep:,} characters of this error "
                f"message cut: it is over max_message_bytes={wire.max_message_bytes:,} ...]\n"
                f"{text[len(text) - keep:] if keep else ''}")
            frames = wire.encode(Kind.ERROR, epoch, seq, wid, wrapper)
        return frames
