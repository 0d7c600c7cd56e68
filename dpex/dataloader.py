"""``DpexDataLoader``: torch's DataLoader, with workers that may run on a Ray cluster."""

from __future__ import annotations

import dataclasses
import inspect
import logging
import multiprocessing.context
import os
import warnings
from collections.abc import Callable, Iterable, Mapping
from typing import Any, TypeVar

import torch
from torch.utils.data import DataLoader, Dataset, Sampler
from torch.utils.data.dataloader import _BaseDataLoaderIter

from dpex import _process_state  # noqa: F401  (its fallback: the env at dpex import)
from dpex._config import DpexConfig, prefetch_window
from dpex._protocol import DEFAULT_MAX_MESSAGE_BYTES
from dpex._shm import DEFAULT_RING_BYTES
from dpex._start_trace import mark
from dpex._stats import LoaderStats
from dpex.client._book import IteratorBook
from dpex.client._early import ray_connected
from dpex.client.resume import (
    IndexView,
    LoaderView,
    ResumeState,
    Saving,
    capture,
    in_trainer,
    loaded,
    replaying,
    starting,
)
from dpex.errors import DpexDroppedWarning

__all__ = ["DpexDataLoader"]

logger = logging.getLogger("dpex")

T_co = TypeVar("T_co", covariant=True)

# torch's DataLoader takes ``in_order`` from 2.6 on; dpex's own iterator honours it on
# any version.
_TORCH_HAS_IN_ORDER = "in_order" in inspect.signature(DataLoader.__init__).parameters
# What Lightning's wrapped ``__init__`` stores on the instance (lightning_fabric's
# ``_wrap_init_method``).
_LIGHTNING_RECORD = "__pl_saved_args"
_LIGHTNING_KWARGS = "__pl_saved_kwargs"
# dpex's own keyword arguments: DpexConfig's fields, in its order. A new knob is a field
# there (with its check and doc) and a parameter of the same name and default below;
# tests/test_layout.py checks the two agree.
_DPEX_ARGUMENTS = tuple(f.name for f in dataclasses.fields(DpexConfig))
# A stateful sampler's states kept for torch's iterators, which draw at most their fixed
# window ahead of what they yielded: that window, and this margin.
_TORCH_WINDOW_MARGIN = 4
# torch's keyword arguments after ``dataset``, passed on by name.
_TORCH_ARGUMENTS = ("batch_size", "shuffle", "sampler", "batch_sampler", "num_workers",
                    "collate_fn", "pin_memory", "drop_last", "timeout", "worker_init_fn",
                    "multiprocessing_context", "generator", "prefetch_factor",
                    "persistent_workers", "pin_memory_device")


def _checked_config(arguments: dict[str, Any]) -> DpexConfig:
    """dpex's settings from the constructor's arguments, checked with torch's."""
    if isinstance(arguments["batch_size"], bool):
        raise TypeError(
            f"batch_size={arguments['batch_size']!r}: DpexDataLoader takes torch's arguments "
            "in torch's order; pass distribute_mode=... and head_address=... by keyword")
    config = DpexConfig(**{name: arguments[name] for name in _DPEX_ARGUMENTS})
    distributed = config.distribute_mode and arguments["num_workers"] > 0
    if config.worker_seeding != "torch" and not distributed:
        raise ValueError(
            f"worker_seeding={config.worker_seeding!r} seeds dpex's workers "
            "(distribute_mode=True, num_workers > 0); torch's own loader seeds each "
            "worker once: leave worker_seeding='torch' for it")
    if config.worker_seeding == "per_sample" and isinstance(
            arguments["dataset"], torch.utils.data.IterableDataset):
        raise ValueError(
            "worker_seeding='per_sample' seeds each sample from its position in the "
            "epoch, which a map-style dataset's sampler gives; an IterableDataset has "
            "none: use 'per_batch' or 'torch' for it")
    return config


def _torch_arguments(arguments: dict[str, Any], distributed: bool) -> dict[str, Any]:
    """The keyword arguments for torch's ``DataLoader.__init__``."""
    torch_kwargs = {name: arguments[name] for name in _TORCH_ARGUMENTS}
    if _TORCH_HAS_IN_ORDER:
        torch_kwargs["in_order"] = arguments["in_order"]
    elif not arguments["in_order"] and not distributed:
        raise TypeError(f"in_order=False needs torch >= 2.6 (this is {torch.__version__}) "
                        "unless distribute_mode=True")
    return torch_kwargs


class DpexDataLoader(DataLoader[T_co]):
    """A drop-in ``torch.utils.data.DataLoader``.

    Takes every argument of torch's DataLoader, in torch's order and with torch's
    validation, plus keyword-only arguments:

    - ``distribute_mode`` (default ``False``): with ``True`` and ``num_workers > 0``
      the workers are Ray actors that stream batches to this process over ZeroMQ;
      with ``False`` this is torch's own loader.
    - ``head_address`` (default ``"auto"``): the Ray cluster to join; ``"auto"``
      joins a running cluster or starts a local Ray instance; ignored if Ray is
      already initialised in this process.
    - ``ray_remote_args``: options for the worker actors (default 1 CPU each,
      spread across nodes).
    - ``startup_timeout`` (default 120 s): how long workers may take to start.
    - ``max_message_bytes`` (default 2 GiB): the largest batch accepted.
    - ``max_worker_restarts`` (default 3): a worker that dies is replaced and its
      outstanding batches re-sent, up to this many times per worker and iterator.
    - ``shm_ring_bytes`` (default 64 MiB): a worker on this process's Ray node
      writes its batches into a shared-memory ring of this size instead of
      sending them over a socket; ``0`` turns this fast path off.
    - ``worker_seeding`` (default ``"torch"``): ``"per_batch"`` seeds every batch
      from which batch it is, so it is the same whichever worker, and however many,
      computed it (docs/AUTOSCALE.md); ``"per_sample"`` seeds every sample from its
      position in the epoch, the same on any rank count (docs/RESUME.md).
    - ``encryption`` (default ``None``: as Ray, on when ``RAY_USE_TLS`` is): encrypt
      batches on the wire (ZeroMQ CURVE). Off, workers still need the iterator's
      credentials to connect and every message is authenticated; the bytes travel in
      clear, as NCCL's do (docs/FAULTS_AND_SECURITY.md).

    The batches, their order, seeds and ``get_worker_info()`` inside workers are
    those torch gives for the same arguments and generator.
    """

    def __init__(
        self,
        dataset: Dataset[T_co],
        batch_size: int | None = 1,
        shuffle: bool | None = None,
        sampler: Sampler | Iterable | None = None,
        batch_sampler: Sampler[list] | Iterable[list] | None = None,
        num_workers: int = 0,
        collate_fn: Callable[[list], Any] | None = None,
        pin_memory: bool = False,
        drop_last: bool = False,
        timeout: float = 0,
        worker_init_fn: Callable[[int], None] | None = None,
        multiprocessing_context: Any = None,
        generator: Any = None,
        *,
        prefetch_factor: int | None = None,
        persistent_workers: bool = False,
        pin_memory_device: str = "",
        in_order: bool = True,
        distribute_mode: bool = False,
        head_address: str = "auto",
        ray_remote_args: Mapping[str, Any] | None = None,
        startup_timeout: float = 120.0,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        max_worker_restarts: int = 3,
        shm_ring_bytes: int = DEFAULT_RING_BYTES,
        worker_pool: str | None = None,
        lost_batch_timeout: float | None = None,
        hung_batch_timeout: float | None = 600.0,
        straggler_timeout: float | str | None = "auto",
        warm_worker_timeout: float = 60.0,
        worker_seeding: str = "torch",
        encryption: bool | None = None,
    ) -> None:
        arguments = locals()
        config = _checked_config(arguments)
        # Public attributes named like the parameters: frameworks (Lightning) rebuild the
        # loader from them, so they must exist under exactly these names.
        for name in _DPEX_ARGUMENTS:
            setattr(self, name, getattr(config, name))
        self._reset_runtime_state()
        recorded_before = _LIGHTNING_RECORD in self.__dict__
        # By keyword: a framework that records this call (Lightning, when DpexDataLoader was
        # imported after it began recording) must see names, not positions.
        super().__init__(dataset, **_torch_arguments(arguments, distribute_mode and num_workers > 0))
        if not _TORCH_HAS_IN_ORDER:
            self.in_order = in_order
        if not recorded_before:
            self._complete_lightning_record(config)
        self._start_early()
        mark("loader built")

    def _start_early(self) -> None:
        """Ray and the hosts start now, in the background (client/_early.py): when the
        loader is built, and in a rank it was pickled into (``mp.spawn``, ``ddp_spawn``)."""
        if self._distributed and self.worker_pool is None:
            from dpex.server._actor import DpexWorker

            self._world().prestart(DpexWorker, self.num_workers, self.ray_remote_args,
                                   self.warm_worker_timeout, self.head_address)

    def _complete_lightning_record(self, config: DpexConfig) -> None:
        """Make Lightning's record of this construction include dpex's arguments.

        Lightning records the arguments of the outermost ``__init__`` it wrapped and
        re-creates the loader from them (``type(loader)(*args, **kwargs)``, with its own
        ``sampler`` under DDP). When this class was defined after Lightning started
        recording (dpex imported inside a ``*_dataloader`` hook), only torch's
        ``DataLoader.__init__`` was wrapped: its record lacks ``distribute_mode`` and the
        rest, and the re-created loader would silently be torch's. Adding them here
        makes the re-created loader this one's twin.
        """
        kwargs = self.__dict__.get(_LIGHTNING_KWARGS)
        if not isinstance(kwargs, dict):
            return  # not recorded: Lightning rebuilds from the attributes set above
        for name in _DPEX_ARGUMENTS:
            kwargs.setdefault(name, getattr(config, name))

    # Where dpex's workers run (dpex.client._runtime.Runtimes): None is Ray's. A test
    # sets an in-process one on the class (tests/inprocess.py).
    _runtimes: Any = None

    def _world(self) -> Any:
        if self._runtimes is not None:
            return self._runtimes
        from dpex.client._ray_runtimes import RayRuntimes  # (imports nothing heavy)

        return RayRuntimes()

    def _reset_runtime_state(self) -> None:
        """What belongs to this process's live iterators, never to the configuration."""
        self._book = IteratorBook(self._resume_view)  # its iterators (client/_book.py)
        # What load_state_dict() loaded and no iterator has taken yet (travels with the
        # configuration: a spawned rank resumes from it).
        self.__dict__.setdefault("_resume", None)

    def __getstate__(self) -> dict:
        """The configuration only (for ``mp.spawn``, Lightning's ``ddp_spawn``): live
        iterators, their workers and counters stay with the process that made them."""
        state = dict(self.__dict__)
        for name in ("_iterator", "_book"):
            state.pop(name, None)
        if self._distributed and multiprocessing.context.get_spawning_popen() is not None:
            self._world().handed_off()  # (its ranks start their own Ray and hosts)
        return state

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.__dict__["_iterator"] = None  # torch's slot for a persistent iterator
        self._reset_runtime_state()
        self._start_early()

    @classmethod
    def from_loader(cls, loader: DataLoader, **dpex_arguments: Any) -> DpexDataLoader:
        """A DpexDataLoader with ``loader``'s torch configuration and dpex's arguments.

        For loaders that a framework builds itself (Accelerate, ``transformers.Trainer``):
        the same dataset, and the very sampler or batch sampler, generator,
        ``collate_fn`` and ``worker_init_fn`` objects, so the twin yields exactly
        ``loader``'s batches. ``dpex_arguments`` are this class's keyword arguments
        (``distribute_mode=True``, ...); those not given keep ``loader``'s own when it
        is a DpexDataLoader, else their defaults.
        """
        if isinstance(loader, DpexDataLoader):
            dpex_arguments = {**dataclasses.asdict(loader.dpex_config), **dpex_arguments}
        kwargs: dict[str, Any] = {}
        if isinstance(loader.dataset, torch.utils.data.IterableDataset):
            # torch makes its own (placeholder) sampler and batch sampler for these
            kwargs.update(batch_size=loader.batch_size, drop_last=loader.drop_last)
        elif loader.batch_sampler is not None:  # torch's BatchSampler or the user's: reuse it
            kwargs["batch_sampler"] = loader.batch_sampler
        else:  # batch_size=None: the sampler itself
            kwargs.update(batch_size=None, sampler=loader.sampler, drop_last=loader.drop_last)
        if loader.num_workers > 0:
            kwargs["prefetch_factor"] = loader.prefetch_factor
        return cls(
            loader.dataset, num_workers=loader.num_workers, collate_fn=loader.collate_fn,
            pin_memory=loader.pin_memory, timeout=loader.timeout,
            worker_init_fn=loader.worker_init_fn,
            multiprocessing_context=loader.multiprocessing_context, generator=loader.generator,
            persistent_workers=loader.persistent_workers,
            pin_memory_device=loader.pin_memory_device,
            in_order=getattr(loader, "in_order", True), **kwargs, **dpex_arguments,
        )

    @property
    def _is_accelerate_prepared(self) -> bool:
        # HF Accelerate reads this flag on a loader just before prepare() rebuilds it as a
        # plain torch DataLoader, dropping this class and its Ray workers: say so loudly.
        prepared = self.__dict__.get("_accelerate_prepared", False)
        if not prepared and self._distributed and not self.__dict__.get("_dpex_preparing"):
            warnings.warn(
                "HF Accelerate is about to rebuild this DpexDataLoader as a plain torch "
                "DataLoader: distribute_mode=True is dropped and torch's local worker "
                "processes will load the batches instead of dpex's Ray workers. Use "
                "dpex.accelerate.prepare_data_loader(accelerator, loader) instead of "
                "accelerator.prepare(loader) to keep them (see docs/INTEGRATIONS.md).",
                DpexDroppedWarning, stacklevel=2)
        return prepared

    @_is_accelerate_prepared.setter
    def _is_accelerate_prepared(self, value: bool) -> None:
        self.__dict__["_accelerate_prepared"] = value

    @property
    def dpex_config(self) -> DpexConfig:
        """dpex's settings as one validated, frozen object."""
        return DpexConfig(**{name: getattr(self, name) for name in _DPEX_ARGUMENTS})

    @property
    def _distributed(self) -> bool:
        return bool(self.distribute_mode) and self.num_workers > 0

    def check_worker_number_rationality(self) -> None:
        """torch's warning when ``num_workers`` exceeds the CPUs the workers can use: this
        machine's for torch's loader and for dpex's embedded default, the Ray cluster's
        for dpex's on a cluster (known once this process is connected to Ray: at
        ``iter()``; before, a loader that will start or join Ray on its own judges by this
        machine, without importing Ray)."""
        if not self._distributed:
            super().check_worker_number_rationality()
            return
        if not ray_connected():
            explicit = os.environ.get("RAY_ADDRESS", "") not in ("", "auto")
            if self.head_address in ("auto", "", None) and not explicit \
                    and not self.worker_pool:
                super().check_worker_number_rationality()  # the workers will share this machine
            return
        import ray

        cpus = int(ray.cluster_resources().get("CPU", 0))
        if self.num_workers > cpus:
            warnings.warn(
                f"This DataLoader will create {self.num_workers} worker processes in total. "
                f"The Ray cluster it runs on has {cpus} CPUs, which is smaller than what this "
                "DataLoader is going to create. Please be aware that excessive worker "
                "creation might get DataLoader running slow or even freeze, lower the worker "
                "number to avoid potential slowness/freeze if necessary.", stacklevel=2)

    def __iter__(self) -> _BaseDataLoaderIter:
        # A persistent iterator that a fatal error (or close()) stopped cannot resume;
        # the next epoch gets fresh workers instead of an error about a dead loop.
        if getattr(self._iterator, "closed", False):
            self._iterator = None
        return super().__iter__()

    @property
    def _index_sampler(self) -> Any:
        """torch's index sampler (batch sampler, or sampler), seen through dpex's
        :class:`~dpex.client.resume.IndexView`: the same indices, with each epoch's
        position kept for ``state_dict()``."""
        # A stateful sampler's states are kept for the batches drawn and not yet yielded:
        # dpex's iterator says which it yielded (its window follows scale_workers() and
        # the autoscaler); torch's iterators draw at most their fixed window ahead.
        keep = None if self._distributed else prefetch_window(
            self.prefetch_factor or 0, self.num_workers) + _TORCH_WINDOW_MARGIN
        return IndexView(self._torch_index_sampler, self._resume, keep)

    @property
    def _torch_index_sampler(self) -> Any:
        return super()._index_sampler

    def _resume_view(self) -> LoaderView:
        """What saving and loading a state read of this loader."""
        iterable = isinstance(self.dataset, torch.utils.data.IterableDataset)  # (torch's kind)
        return LoaderView(
            index_sampler=self._torch_index_sampler, sampler=self.sampler,
            batch_sampler=self.batch_sampler, generator=self.generator,
            dataset=self.dataset, iterable=iterable, num_workers=self.num_workers,
            distributed=self._distributed,
            persistent=bool(self.persistent_workers) and self.num_workers > 0,
            in_order=bool(getattr(self, "in_order", True)), batch_size=self.batch_size,
            drop_last=bool(self.drop_last), measure=self.__len__)

    def _set_generator(self, generator: torch.Generator | None) -> None:
        self.__dict__["generator"] = generator  # (DataLoader refuses setting it later)

    def _get_iterator(self) -> _BaseDataLoaderIter:
        mark("iter")
        resume: ResumeState | None = self._resume
        if resume is None:
            # The current iterator never drew (its first next() was refused): this one
            # resumes in its place.
            resume = self._resume = self._book.unstarted()
        iterator_rng = starting(resume, self.generator)
        view = self._resume_view()
        with replaying(view, resume, self._set_generator):
            iterator = self._make_iterator(view)  # (if this fails, the state stays for the next try)
        self._resume = None  # the new iterator's epoch holds it until it draws
        self._book.hold(iterator, iterator_rng, strong=self.num_workers == 0,
                        dpex=self._distributed)
        return iterator

    def _make_iterator(self, view: LoaderView) -> _BaseDataLoaderIter:
        if not self._distributed:
            if self.num_workers == 0:
                return in_trainer(view, self._resume, super()._get_iterator)
            return super()._get_iterator()
        from dpex.client._iterator import RayDataLoaderIter
        from dpex.server._actor import DpexWorker

        # Built from the attributes, which a framework may have set since __init__.
        iterator = RayDataLoaderIter(self, self.dpex_config, DpexWorker, self._book,
                                     self._world())
        self.check_worker_number_rationality()  # as torch does here; Ray is connected now
        return iterator

    def state_dict(self) -> dict:
        """Where this loader stands, as plain data (``json.dumps`` and ``torch.save`` take
        it; ``torch.load`` with ``weights_only=True`` reads it back): the batches of the
        current epoch already yielded and the generator states its order and seeds come
        from. Taken without stopping the workers; batches prefetched but not yet yielded
        are not in it (a resumed loader computes them again). Lightning and Accelerate
        checkpoints pick it up. See docs/RESUME.md."""
        return self._resume_position().state()

    def _resume_position(self) -> Saving:
        """Where this loader stands, cheaply: ``.state()`` is ``state_dict()`` (asking
        the workers for their RNG states only then)."""
        position = self._book.position()
        if position is None and self._book.kept is not None:
            return Saving(self._book.kept)  # its iterator ended mid-epoch (IteratorBook.keep)
        return capture(self._resume_view(), position, self._resume)

    def load_state_dict(self, state_dict: dict) -> None:
        """Resume where ``state_dict()`` was taken: the next ``iter(loader)`` yields the
        rest of that epoch, and later epochs follow, exactly as an uninterrupted run's
        (a map-style dataset's with any ``num_workers``, an IterableDataset's with the
        same). Raises :class:`~dpex.ResumeStateError` for a state of another loader
        (sampler and its settings, batch size, ``drop_last``, dataset length,
        generator, worker count of an IterableDataset) or dpex version, naming what
        differs, and :class:`~dpex.UnsupportedError` for one this loader cannot
        resume. A dataset's own ``state_dict()`` is loaded in torchdata's order."""
        resume = loaded(self._resume_view(), state_dict)
        # An iterator still alive stands elsewhere: state_dict() now describes what was
        # loaded, until the next iterator moves.
        self._book.empty()
        persistent = self._iterator
        if persistent is not None:  # its workers hold another position: a fresh iterator
            self._iterator = None
            if hasattr(persistent, "_shutdown_workers"):
                persistent._shutdown_workers()
        self._resume = resume

    def scale_workers(self, n: int) -> None:
        """Run ``n`` workers from now on: the live iterator adds or retires workers at
        once (a map-style dataset's; nothing is lost or repeated, and the batches stay
        exact, see docs/AUTOSCALE.md), and the next iterator starts with ``n``. With
        ``num_workers=dpex.Autoscale(...)`` its autoscaler may change this later."""
        if not self._distributed:
            raise ValueError("scale_workers() changes dpex's workers (distribute_mode=True, "
                             "num_workers > 0); torch's own loader has a fixed count")
        iterator = self._book.newest
        if iterator is not None and not iterator.closed:
            iterator.scale_to(n)
        elif isinstance(n, bool) or not isinstance(n, int) or n < 1:
            raise ValueError(f"scale_workers() takes a worker count >= 1, got {n!r}")
        self._book.scaled(n)

    def stats(self) -> LoaderStats:
        """Counters of the newest iterator, running or finished (``{}`` if there is none):
        the data-stall share (how much of the epoch the training loop waited for data),
        each worker's batches/s and transport, credits in flight, messages received,
        rejected and dropped by reason, and recoveries; every key in docs/STATS.md
        (``dpex.stats_prometheus(loader)`` gives them in Prometheus' format). A
        finished iterator that was already collected reports what it counted when it
        shut down."""
        iterator = self._book.newest
        return iterator.stats() if iterator is not None else dict(self._book.final_stats)

    def close(self) -> None:
        """Stop every worker, socket and thread this loader started (idempotent). A
        ``state_dict()`` after it still says where the newest iterator stood."""
        current = self._book.current
        if self._book.is_live(current) and not current.closed:
            try:
                self._book.keep(current, ask_workers=True)
            except Exception:  # (in_order=False, say): close all the same
                logger.info("dpex: close() keeps no position", exc_info=True)
        for iterator in self._book.take_live():
            iterator._shutdown_workers()
        self._iterator = None

    def __enter__(self) -> DpexDataLoader[T_co]:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()
