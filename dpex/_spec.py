"""What the trainer tells a worker: the loader parts it ships at each iterator's start,
the small per-worker spec that travels as a Ray argument, and a task's sample positions
(``worker_seeding="per_sample"``). Neutral ground: the trainer (``dpex.client``) builds
these and the workers (``dpex.server``) read them, but for :class:`Parcel`, which a
worker makes as Ray unpickles a :class:`PickledLoader`; :func:`stateful_dataset` and
:func:`own_state` serve both sides."""

from __future__ import annotations

import copy
import pickle
from collections.abc import Iterable
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, NamedTuple

from dpex._protocol import Wire
from dpex._security import ClientKeys
from dpex._shipfile import ShipmentRef, ShipmentUnavailable, map_shipment

if TYPE_CHECKING:  # (a worker host reads specs without importing torch: _shm does)
    from dpex._shm import RingRef

__all__ = ["DATASET_ITER_STATE", "DATASET_STATE", "FINISH_EPOCH", "restores_dataset", "PRELOADED", "Parcel", "PickledLoader", "Positioned", "ShippedLoader", "WorkerSpec", "own_state",
           "stateful_dataset"]


def stateful_dataset(dataset: Any) -> bool:
    """Whether an IterableDataset keeps its own position (``state_dict`` and
    ``load_state_dict``, torchdata's convention: load, then ``iter()`` goes on)."""
    return callable(getattr(dataset, "state_dict", None)) and callable(
        getattr(dataset, "load_state_dict", None))


def own_state(obj: Any) -> Any:
    """A dataset's (or its iterator's) own ``state_dict()``, copied (it goes on
    changing what it returned); None for one without."""
    return copy.deepcopy(obj.state_dict()) if stateful_dataset(obj) else None


class Positioned(NamedTuple):
    """worker_seeding="per_sample": a task's indices with their positions in the epoch
    (``first``, then every ``stride``) and the epoch they belong to (a
    DistributedSampler's ``set_epoch``, else the loader's epoch count); the worker seeds
    each sample from (``WorkerSpec.sample_seed``, epoch, position)."""

    indices: Any
    first: int
    stride: int
    epoch: int


@dataclass(frozen=True)
class ShippedLoader:
    """The parts of a DataLoader a worker needs. Cloudpickled at each iterator's start
    (:func:`dpex.client._shipping.ship_loader`), and again if the object store needs a
    copy once the trainer's memfd is closed (:class:`dpex._shipfile.Delivery`);
    unpickled by :mod:`dpex.server._task_runner` or a host's fork base."""

    dataset: Any
    dataset_kind: int
    auto_collation: bool
    collate_fn: Any
    drop_last: bool
    worker_init_fn: Any


class Parcel:
    """The pickled loader as a worker holds it until it unpickles it: the one type every
    worker-side signature takes (``shipped``). It comes in one of three forms:

    - **bytes**: the object store's copy. In a worker actor a read-only view of Ray's
      buffer (a pickle-5 buffer: zero-copy, one copy per node, shared by the node's
      workers); sent to a session's own process it travels as ``bytes``.
    - **the trainer's memfd** (:meth:`delivered` with no stored copy), on its node: a
      :class:`~dpex._shipfile.ShipmentRef`, mapped where it is read (:meth:`take`,
      :meth:`map_now`), or handed as it is to a fork base that maps it itself.
    - **preloaded** (:data:`PRELOADED`): a session forked from a fork base that
      unpickled the loader already.

    Taken once (:meth:`take`) or dropped (:meth:`drop`), after which nothing here keeps
    its bytes: a worker's ``serve`` call (and Ray, which holds the call's arguments)
    lives as long as its session; holding the bytes there kept a dataset-sized copy in
    every worker for nothing."""

    __slots__ = ("_data", "_ref", "preloaded")

    def __init__(self, data: Any = None, ref: ShipmentRef | None = None,
                 preloaded: bool = False) -> None:
        self._data, self._ref, self.preloaded = data, ref, preloaded

    @classmethod
    def delivered(cls, stored: Parcel | None, local: ShipmentRef | None,
                  node_id: str) -> Parcel:
        """What a ``serve`` call got: the object store's copy (``stored``), or None for
        the trainer's memfd (``local``, its spec's), which must be on this node."""
        if stored is not None:
            return stored
        if local is not None and local.node_id != node_id:
            raise ShipmentUnavailable(
                f"the trainer's copy of the dataset is on node {local.node_id}, "
                f"this worker on {node_id}")
        return cls(ref=local)

    @property
    def ref(self) -> ShipmentRef | None:
        """The trainer's memfd, not mapped yet (a fork base maps it itself)."""
        return self._ref

    @property
    def empty(self) -> bool:
        """Nothing held: taken, dropped, preloaded, or a fleet worker given no bytes."""
        return self._ref is None and self._data is None

    def view(self) -> Any:
        """The bytes, not taken (None for a memfd not mapped yet, or once taken)."""
        return self._data

    def map_now(self) -> None:
        """Read the trainer's memfd now (a session's own process does so before its
        HELLO, after which the trainer may close it); raises
        :class:`~dpex._shipfile.ShipmentUnavailable` if it is gone."""
        if self._ref is not None:
            self._data, self._ref = map_shipment(self._ref), None

    def take(self) -> Any:
        """The bytes (a bytes-like object, the memfd mapped if it is one); None once
        taken or dropped."""
        self.map_now()
        data, self._data = self._data, None
        return data

    def drop(self) -> None:
        """Keep nothing of it here (a fork base or a session's process holds its own)."""
        self._data = self._ref = None

    def __len__(self) -> int:
        if self._ref is not None:
            return self._ref.size
        return 0 if self._data is None else memoryview(self._data).nbytes

    def __reduce__(self) -> tuple:
        data = None if self._data is None else bytes(self._data)
        return Parcel, (data, self._ref, self.preloaded)


PRELOADED = Parcel(preloaded=True)  # a session forked from a fork base that holds it


def _loader_bytes(data: Any, refs: tuple) -> Parcel:
    """A :class:`PickledLoader` as a worker gets it: a :class:`Parcel` of its bytes, a
    view of the object store's buffer when Ray hands one (no copy). ``refs`` were there
    for Ray to count (it registered them as it unpickled them); the pickle holds its
    own."""
    return Parcel(memoryview(data).toreadonly() if not isinstance(data, bytes) else data)


class PickledLoader(bytearray):
    """What the trainer puts in the object store for its workers: the pickled loader
    (with the trainer's state in front) and the Ray object refs pickled in it.

    Why a type of its own: ``ray.put`` of plain ``bytes`` stores them raw, and a ref
    pickled inside them is one Ray cannot see, so Ray pins what it names for the life of
    the process that pickled it ("out-of-band" serialization). This object is pickled by
    Ray instead (not ``bytes``, so not raw), with ``refs`` in band: Ray records them as
    contained in it, and what they name lives exactly as long as the stored copy does
    (while the loader or one of its iterators holds it, or a worker's session is given
    it), then goes, as it does without dpex. The bytes travel out of band (a pickle-5
    buffer, no copy); a worker gets a :class:`Parcel` of them (:func:`_loader_bytes`).
    Built from ``parts`` in one copy.
    """

    def __init__(self, *parts: Any, refs: Iterable[Any] = ()) -> None:
        super().__init__()
        for part in parts:
            self += part
        self.refs = tuple(refs)

    def __reduce_ex__(self, protocol: int) -> tuple:
        data = pickle.PickleBuffer(self) if protocol >= 5 else bytes(self)
        return _loader_bytes, (data, self.refs)


# A resumed worker's saved state (``WorkerSpec.rng_state``) holds its RNG states and,
# for a stateful IterableDataset, the dataset's own states under these keys
# (torchdata's split: the dataset's, loaded before ``iter()``, and its iterator's,
# after); FINISH_EPOCH marks a state taken between epochs (the worker runs what was
# left of that epoch, nothing but its end, first).
DATASET_STATE, DATASET_ITER_STATE, FINISH_EPOCH = "dataset", "dataset_iter", "finish_epoch"


def restores_dataset(saved: dict | None) -> bool:
    """Whether a worker resuming from ``saved`` restores its dataset's own state (so
    it does not pass over the batches it delivered before: the state put it there)."""
    return bool(saved) and (DATASET_STATE in saved or DATASET_ITER_STATE in saved)


@dataclass(frozen=True)
class WorkerSpec:
    """Where and who a worker is for one session (small; travels as a Ray argument).
    Built by the trainer's :class:`~dpex.client._driver.EpochDriver` (a replacement's
    and an added worker's from the ones before), adjusted by :mod:`dpex.client._workers`
    as it starts each worker (``own_process``, ``shipment``, ``local``); read by the worker
    (:mod:`dpex.server`: its actor, its session, its task runner)."""

    # Session id, session key and size limit; its ``incarnation`` is left 0 here, and
    # the worker stamps its own there before it sends (``SessionServer.serve``).
    wire: Wire
    worker_id: int
    num_workers: int
    base_seed: int
    data_address: str
    control_address: str
    keys: ClientKeys  # how it connects: the iterator's password, or its CURVE keys
    niceness: int = 0  # the trainer's: workers run at its priority, as torch's do
    # torch's IterDataPipe seed: the first epoch's, or the current epoch's for a
    # replacement or an added worker
    shared_seed: int | None = None
    incarnation: int = 0  # 0 for a worker id's first start, +1 per replacement
    # The trainer's shared-memory ring for this incarnation (used only on the trainer's
    # node); None: none offered (shm_ring_bytes=0, or the trainer could not make one).
    ring: RingRef | None = None
    # Served in a process of its own (dpex.server._session_process), forked from the
    # fork base holding its loader, else from the host's forkserver: a fleet's sessions,
    # and every session on a host (a worker that reserves no resources).
    own_process: bool = False
    # Resuming (DpexDataLoader.load_state_dict): the states this worker had right after
    # its last batch that the saved run's loop took (else those it started from): the
    # RNG states, with a stateful IterableDataset's own (``dataset``, ``dataset_iter``),
    # restored after worker_init_fn. Kept by a replacement in the resumed epoch only.
    rng_state: Any = None
    # How many recent batches' RNG states the worker keeps for state_dict(): the
    # iterator's whole credit window at its start (prefetch_factor x its workers) and
    # dpex.client._launch.RNG_MARGIN more; 0 keeps none (batches or samples seeded by
    # their number or position, over a map-style dataset).
    rng_keep: int = 0
    # worker_seeding="per_batch": (epochs this base seed served before this iterator's
    # first, batches of that first epoch yielded before it: a resumed epoch's), so that
    # batch ``seq`` of epoch ``e`` is seeded from (base_seed, epochs_before + e,
    # seq + (skip if e == 1 else 0)), what the uninterrupted run seeded it from.
    batch_seeds: tuple[int, int] | None = None
    # worker_seeding="per_sample": the seed every sample's is made from (a
    # DistributedSampler's ``seed``, else the iterator's base seed; tasks come as
    # Positioned); None: not seeded per sample.
    sample_seed: int | None = None
    # Which shipped loader this is (its bytes' digest, else its object ref's id): a
    # host's sessions of the same one fork from one process that holds it unpickled
    # (dpex.server._fork_base).
    shipment: str | None = None
    # The installed libraries the shipped loader's classes and functions are of: its
    # host imports them in its library base before the shipment's base forks from it.
    libraries: tuple[str, ...] = ()
    # The shipment this one replaces (its loader's dataset changed): a host keeps no
    # fork base of it idle.
    replaces: str | None = None
    # A worker on a host on the trainer's node while the memfd is open (one of the
    # iterator's first workers, or any later one where the delivery keeps it): the
    # trainer's memfd holding the pickled loader (then the serve call carries no copy
    # of it; dpex._shipfile).
    local: ShipmentRef | None = None
    # The trainer's Ray namespace, for a fleet's session (set by the trainer's
    # FleetGroup): the Ray calls of its dataset's code join it, as a loader's own
    # workers' do (``ray.get_actor`` of the trainer's named actors). None: the worker's.
    namespace: str | None = None
