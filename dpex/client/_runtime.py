"""What one iterator starts: its loop thread, its trainer session, its workers.

:class:`Runtime` holds them and closes them together (idempotent); :func:`ship` puts
the pickled loader in Ray's object store once per loader; :class:`Workers` is what a
driver asks of a worker group, whoever runs the workers.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable
from typing import Any, Protocol

import ray

from dpex._addresses import node_address
from dpex._config import DpexConfig
from dpex._event_loop import LoopThread
from dpex._protocol import Wire
from dpex._security import wire_security
from dpex._shipfile import Delivery, ShipmentUnavailable
from dpex._spec import PickledLoader, WorkerSpec
from dpex.client._events import Handoff, LoopFailure
from dpex.client._fleet_group import FleetGroup
from dpex.client._session import TrainerSession
from dpex.client._workers import WorkerGroup

__all__ = ["Runtime", "Seeds", "Shipment", "Workers", "ship"]


class Workers(Protocol):
    """What an iterator's driver asks of its workers, whoever runs them: actors of its
    own (:class:`WorkerGroup`), sessions on a fleet (:class:`FleetGroup`), or an
    in-memory stand-in (tests/fake_runtime.py). Every method returns at once; a
    worker's HELLO, batches and end come as events on the queue the group was given
    (:class:`~dpex.client._events.WorkerHello`, ``WorkerExit``)."""

    options: dict  # the actor options, as errors report them
    actors: dict[int, Any]  # each worker id's current actor (handle)

    def start(self, specs: list[WorkerSpec], shipped: Any) -> None:
        """Start one worker per spec, each serving the shipped loader."""

    def restart(self, spec: WorkerSpec, shipped: Any) -> None:
        """Start the next incarnation of ``spec.worker_id`` (its last one is dead)."""

    def add(self, spec: WorkerSpec, shipped: Any) -> None:
        """Start one more worker (a new id) while the iterator runs."""

    def retire(self, worker_id: int) -> None:
        """End a worker's session; its exit is expected."""

    def kill(self, worker_id: int) -> None:
        """End a worker that hangs, now; its replacement follows its exit event."""

    def placement_warning(self, waiting: list[int]) -> str | None:
        """Why the workers ``waiting`` may not start soon (None if nothing says so)."""

    def stop(self) -> None:
        """End every worker's session (idempotent)."""


class Runtime:
    """Everything one iterator started: loop thread, sockets, actors. Idempotent close."""

    def __init__(self, name: str, handoff: Handoff, config: DpexConfig,
                 label: str, worker_class: type) -> None:
        host = node_address()  # may raise: before anything that needs closing exists
        self.loop = LoopThread(name, on_error=lambda exc: handoff.put(LoopFailure(exc)))
        self.session = TrainerSession(Wire.new(config.max_message_bytes), host, handoff,
                                      wire_security(config.encryption))
        self.workers: Workers = (
            FleetGroup(config.worker_pool, handoff, config.startup_timeout) if config.worker_pool
            else WorkerGroup(worker_class, config.ray_remote_args, handoff, label,
                             keep_s=config.warm_worker_timeout))
        self._close_shipment: Callable[[], None] = lambda: None  # (the memfd's)
        self.closed = False

    def open(self) -> None:
        # Generous: the garbage collector may run other objects' finalizers on the new
        # thread before its loop starts; a torch iterator kept by a reference cycle (an
        # exception's traceback) joins its worker processes there, 5 s each.
        self.loop.start(timeout=60.0)
        self.loop.run(self.session.open(), timeout=60.0)

    def start(self, specs: Any, shipped: Any) -> None:
        """Start the workers of ``specs`` with ``shipped`` (a :class:`Delivery` is
        closed with this runtime)."""
        if isinstance(shipped, Delivery):
            self._close_shipment = shipped.closer()
        self.workers.start(specs, shipped)

    def close(self) -> None:
        if self.closed:
            return
        self.closed = True
        self.workers.stop()
        self.loop.stop(cleanup=self.session.close)
        self._close_shipment()  # no worker will read the memfd any more


def _store(data: Any, refs: tuple) -> Any:
    """The object store's copy of a pickled loader (see :class:`PickledLoader`)."""
    if isinstance(data, PickledLoader):
        return ray.put(data)
    return ray.put(PickledLoader(*getattr(data, "parts", (data,)), refs=refs))


# The digests this process shipped (the latest last): bytes shipped again are likely
# held by a host already, in a base that maps the first shipment's memfd.
_SHIPPED: dict[bytes, bool] = {}
_SHIPPED_KEPT = 256


def ship(loader: Any, shipped: Any, repickle: Callable[[], Any]) -> tuple[Delivery, bool,
                                                                          str | None, str]:
    """The iterator's :class:`~dpex._shipfile.Delivery` of ``shipped`` (a memfd for the
    hosts on this node, Ray's object store for the others: kept, replacements load the
    same bytes), whether it is the loader's previous iterator's (the same bytes: its
    hosts hold it already, nothing is put or moved again), the digest of the one it
    replaces if the dataset changed (hosts drop what they hold of that one: it is never
    served again), and its own digest (hosts hold one unpickled copy per digest: a
    loader Lightning rebuilds with the same dataset finds it there). ``repickle()``:
    the loader pickled again, for a worker started after the memfd was closed."""
    digest = shipped.digest()
    previous = getattr(loader, "_shipped", None)
    reused = previous is not None and previous[0] == digest
    shipped_before = _SHIPPED.pop(digest, False)  # (by any loader of this process)
    _SHIPPED[digest] = True
    while len(_SHIPPED) > _SHIPPED_KEPT:
        _SHIPPED.pop(next(iter(_SHIPPED)))
    loader._shipped = (digest, previous[1] if reused else None)

    def stored(ref: Any) -> None:  # the loader's next iterator reuses this copy
        if loader._shipped is not None and loader._shipped[0] == digest:
            loader._shipped = (digest, ref)

    delivery = Delivery(shipped, ray.get_runtime_context().get_node_id(), digest,
                        stored=loader._shipped[1], put=_store, repickle=repickle,
                        on_stored=stored, keep=not shipped_before)
    replaced = previous[0].hex() if previous is not None and not reused else None
    return delivery, reused, replaced, digest.hex()


@dataclasses.dataclass(frozen=True)
class Seeds:
    """What the iterator's workers are seeded with (torch's ``_base_seed`` and
    ``_shared_seed``)."""

    base: int
    shared: Any


@dataclasses.dataclass(frozen=True)
class Shipment:
    """The shipped loader: its delivery (:class:`~dpex._shipfile.Delivery`; a fleet's
    or a test's object ref), whether it is the loader's previous iterator's, and its
    size."""

    ref: Any
    reused: bool
    size: int

    def release_local(self) -> None:
        """Every first worker started: the memfd may go (:meth:`Delivery.release_local`)."""
        if isinstance(self.ref, Delivery):
            self.ref.release_local()

    def undelivered(self, cause: BaseException | None) -> bool:
        """Whether a worker's exit (``cause``) says its host could not use the trainer's
        memfd (:class:`~dpex._shipfile.ShipmentUnavailable`): not the worker's own
        failure; it and every later worker take the object store's copy."""
        if isinstance(cause, ShipmentUnavailable) and isinstance(self.ref, Delivery):
            self.ref.refuse_local()
            return True
        return False

    @property
    def fallbacks(self) -> int:
        """Worker starts that took the object store's copy for want of the memfd."""
        return self.ref.fallbacks if isinstance(self.ref, Delivery) else 0
