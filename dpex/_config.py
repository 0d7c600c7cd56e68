"""The arguments dpex adds to torch's DataLoader, validated in one place."""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from dpex._protocol import DEFAULT_MAX_MESSAGE_BYTES
from dpex._shm import DEFAULT_RING_BYTES

__all__ = ["DpexConfig", "WORKER_SEEDINGS", "prefetch_window"]

WORKER_SEEDINGS = ("torch", "per_batch", "per_sample")


def prefetch_window(prefetch_factor: int, num_workers: int) -> int:
    """The credit window: how many batches may be asked for and not yet taken by the
    training loop, ``prefetch_factor`` per worker (torch's rule). The one definition for
    whatever is sized by it (the scheduler's credits; the RNG states a worker keeps for
    ``state_dict()``), each caller adding its own margin."""
    return prefetch_factor * num_workers


@dataclass(frozen=True)
class DpexConfig:
    """dpex's own loader settings.

    ``distribute_mode``: run workers as Ray actors (``num_workers > 0``).
    ``head_address``: Ray cluster to join; ``"auto"`` joins a running one or starts a local one.
    ``ray_remote_args``: actor options (``num_cpus``, ``resources``, ``runtime_env``, scheduling).
    ``startup_timeout``: seconds the workers may take to start; not counted in ``timeout``.
    ``max_message_bytes``: the largest batch message accepted (bigger ones are an error
    in the worker, and dropped and counted if they arrive anyway).
    ``max_worker_restarts``: how often one worker may be replaced per iterator after
    dying; one death more is a ``WorkerDiedError``.
    ``shm_ring_bytes``: the shared-memory ring of each worker on the trainer's node
    (the same-node fast path); 0 turns it off.
    ``worker_pool``: the name of a running fleet (``dpex fleet start``) whose workers
    serve this loader's sessions instead of workers of its own.
    ``lost_batch_timeout``: seconds a result may stay missing, from a worker that holds
    tasks and sends nothing, or whose progress reports show it past that task, before
    it is presumed lost (a frame dropped with a connection) and computed again; None
    derives it from the batch times seen (10 x the usual, at least 10 s, 60 s for an
    IterableDataset, whose worker is replaced); 0 never presumes a batch lost.
    ``hung_batch_timeout``: seconds a worker may compute one batch (a first batch: with
    loading the dataset and ``worker_init_fn``), alive and reporting progress, before it
    is presumed hung (a read that never returns) and replaced; None never (torch's
    loader waits for any batch). A worker that is computing is never presumed lost.
    ``straggler_timeout``: seconds a worker may compute one map-style batch before the
    batch is computed again on another worker with room (a *backup*: the first result
    counts, the other is dropped; the slow worker is not killed, takes no new task
    until it is done, and is replaced only past ``hung_batch_timeout``); ``"auto"``
    derives it from the batch times seen (4 x the usual, at least 5 s); None never
    backs up. An IterableDataset's batches have one owner (its shard): never.
    ``warm_worker_timeout``: seconds a worker process that reserves nothing is kept
    idle after its iterator ends, for this process's next iterator to start on (in
    milliseconds instead of seconds); 0 ends every worker with its iterator, as torch
    does. Idle workers never outlive this process (``dpex.release_warm_workers()``
    ends them at once).
    ``worker_seeding``: ``"torch"`` seeds each worker once, as torch does (``base_seed +
    worker_id``); ``"per_batch"`` seeds torch, ``random`` and NumPy before every batch
    from (base seed, epoch, batch number), so a batch's random draws do not depend on
    which worker, or how many, computed it (docs/AUTOSCALE.md); ``"per_sample"`` seeds
    them before every sample from (seed, epoch, its position in the epoch), so a sample's
    draws do not depend on which rank, worker or batch took it, nor on how many ranks
    there are (a map-style dataset; docs/RESUME.md).
    ``encryption``: whether batches crossing a socket are encrypted (ZeroMQ CURVE); None
    follows Ray (encrypted when ``RAY_USE_TLS`` is on). Either way only this iterator's
    workers may connect and every message is authenticated (docs/FAULTS_AND_SECURITY.md).
    """

    distribute_mode: bool = False
    head_address: str = "auto"
    ray_remote_args: Mapping[str, Any] | None = None  # None: {} (each worker reserves nothing)
    startup_timeout: float = 120.0
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    max_worker_restarts: int = 3
    shm_ring_bytes: int = DEFAULT_RING_BYTES
    worker_pool: str | None = None
    lost_batch_timeout: float | None = None
    hung_batch_timeout: float | None = 600.0
    straggler_timeout: float | str | None = "auto"
    warm_worker_timeout: float = 60.0
    worker_seeding: str = "torch"
    encryption: bool | None = None

    def __post_init__(self) -> None:
        if self.ray_remote_args is None:  # the loader's default
            object.__setattr__(self, "ray_remote_args", {})
        if not isinstance(self.distribute_mode, bool):
            raise TypeError(f"distribute_mode must be a bool, got {self.distribute_mode!r}")
        if not isinstance(self.head_address, str) or not self.head_address:
            raise ValueError(f"head_address must be a non-empty string, got {self.head_address!r}")
        if not isinstance(self.ray_remote_args, Mapping):
            raise TypeError(f"ray_remote_args must be a dict, got {type(self.ray_remote_args).__name__}")
        object.__setattr__(self, "ray_remote_args", dict(self.ray_remote_args))  # a copy
        if not self.startup_timeout > 0:
            raise ValueError(f"startup_timeout must be > 0 seconds, got {self.startup_timeout!r}")
        if (not isinstance(self.max_message_bytes, int) or isinstance(self.max_message_bytes, bool)
                or self.max_message_bytes < 1024):
            raise ValueError(
                f"max_message_bytes must be an int >= 1024, got {self.max_message_bytes!r}")
        if (not isinstance(self.max_worker_restarts, int)
                or isinstance(self.max_worker_restarts, bool) or self.max_worker_restarts < 0):
            raise ValueError(
                f"max_worker_restarts must be an int >= 0, got {self.max_worker_restarts!r}")
        if (not isinstance(self.shm_ring_bytes, int) or isinstance(self.shm_ring_bytes, bool)
                or not (self.shm_ring_bytes == 0 or self.shm_ring_bytes >= 1 << 20)):
            raise ValueError(
                f"shm_ring_bytes must be 0 (off) or an int >= 1 MiB, got {self.shm_ring_bytes!r}")
        if self.lost_batch_timeout is not None and (
                isinstance(self.lost_batch_timeout, bool)
                or not isinstance(self.lost_batch_timeout, (int, float))
                or not self.lost_batch_timeout >= 0):
            raise ValueError("lost_batch_timeout must be None (derived), 0 (off) or a number "
                             f"of seconds > 0, got {self.lost_batch_timeout!r}")
        if self.hung_batch_timeout is not None and (
                isinstance(self.hung_batch_timeout, bool)
                or not isinstance(self.hung_batch_timeout, (int, float))
                or not self.hung_batch_timeout > 0):
            raise ValueError("hung_batch_timeout must be None (never) or a number of seconds "
                             f"> 0, got {self.hung_batch_timeout!r}")
        if self.straggler_timeout is not None and self.straggler_timeout != "auto" and (
                isinstance(self.straggler_timeout, bool)
                or not isinstance(self.straggler_timeout, (int, float))
                or not self.straggler_timeout > 0):
            raise ValueError("straggler_timeout must be \"auto\" (derived), None (no backups) "
                             f"or a number of seconds > 0, got {self.straggler_timeout!r}")
        if (isinstance(self.warm_worker_timeout, bool)
                or not isinstance(self.warm_worker_timeout, (int, float))
                or not self.warm_worker_timeout >= 0):
            raise ValueError("warm_worker_timeout must be a number of seconds >= 0 (0: no "
                             f"reuse), got {self.warm_worker_timeout!r}")
        if self.worker_seeding not in WORKER_SEEDINGS:
            raise ValueError(f"worker_seeding must be one of {WORKER_SEEDINGS}, got "
                             f"{self.worker_seeding!r}")
        if self.encryption is not None and not isinstance(self.encryption, bool):
            raise TypeError("encryption must be True, False or None (follow Ray's TLS), got "
                            f"{self.encryption!r}")
        if self.worker_pool is not None:
            if not isinstance(self.worker_pool, str) or not self.worker_pool:
                raise ValueError(f"worker_pool must be a fleet's name, got {self.worker_pool!r}")
            if self.ray_remote_args:
                raise ValueError("ray_remote_args has no effect with worker_pool: the fleet's "
                                 "workers were placed by `dpex fleet start`")
