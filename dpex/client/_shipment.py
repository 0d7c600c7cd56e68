"""The shipped loader: what the process shipped (:data:`SHIPPED`, one memo), the
iterator's delivery of it (:func:`ship`) and what every worker start takes
(:class:`Shipment`).

The wing's processes, what each holds and when it ends: NOTE [ The worker host's
processes ] in :mod:`dpex.server._fork_base`.
"""

from __future__ import annotations

import dataclasses
import functools
import threading
import weakref
from collections.abc import Callable
from typing import Any, NamedTuple

import ray

from dpex._shipfile import Delivery, ShipmentUnavailable
from dpex._spec import PickledLoader, ShippedLoader
from dpex.client._shipping import ship_loader

__all__ = ["SHIPPED", "Shipment", "ShipmentMemo", "ship"]


class Seen(NamedTuple):
    """What the memo knew of a shipment when it was recorded."""

    previous: bytes | None  # the loader's last shipment's digest (None: its first)
    stored: Any  # the object store's copy of that one, if one was put
    before: bool  # this process shipped these bytes before (any loader)


class ShipmentMemo:
    """What this process shipped, in one place: the digests any of its loaders shipped
    (the latest :attr:`keep`), and each live loader's last shipment with the object
    store's copy of it, if one was put (its next iterator of the same bytes reuses it).
    Bytes shipped before are likely held by a host already, in a base that maps the
    first shipment's memfd: a later delivery of them does not keep its memfd.
    Thread-safe."""

    def __init__(self, keep: int = 256) -> None:
        self.keep = keep
        self._lock = threading.Lock()
        self._digests: dict[bytes, None] = {}  # the latest last
        self._loaders: dict[int, tuple[bytes, Any]] = {}  # id(loader) -> (digest, stored)

    def record(self, loader: Any, digest: bytes) -> Seen:
        """``loader`` ships ``digest`` now."""
        with self._lock:
            before = digest in self._digests
            self._digests.pop(digest, None)  # (moved to the end: the latest)
            self._digests[digest] = None
            while len(self._digests) > self.keep:
                self._digests.pop(next(iter(self._digests)))
            key = id(loader)
            if key not in self._loaders:
                weakref.finalize(loader, self._loaders.pop, key, None)
            previous, stored = self._loaders.get(key, (None, None))
            self._loaders[key] = (digest, stored if previous == digest else None)
            return Seen(previous, stored if previous == digest else None, before)

    def stored(self, loader: Any, digest: bytes, ref: Any) -> None:
        """The object store's copy of ``loader``'s shipment ``digest`` was put."""
        with self._lock:
            if self._loaders.get(id(loader), (None,))[0] == digest:
                self._loaders[id(loader)] = (digest, ref)

    def last(self, loader: Any) -> tuple[bytes, Any] | None:
        """``loader``'s last shipment: (digest, the object store's copy or None)."""
        with self._lock:
            return self._loaders.get(id(loader))


SHIPPED = ShipmentMemo()


def _store(data: Any, refs: tuple) -> Any:
    """The object store's copy of a pickled loader (see :class:`PickledLoader`)."""
    if isinstance(data, PickledLoader):
        return ray.put(data)
    return ray.put(PickledLoader(*getattr(data, "parts", (data,)), refs=refs))


def ship(loader: Any, contents: ShippedLoader, *, fleet: bool = False,
         pickle: Callable[..., Any] = ship_loader) -> Shipment:
    """The iterator's :class:`Shipment` of ``contents`` (``loader``'s parts): pickled
    here (:func:`~dpex.client._shipping.ship_loader`, for a fleet's workers if
    ``fleet``), then delivered (:class:`~dpex._shipfile.Delivery`: a memfd for the hosts
    on this node, Ray's object store for the others; kept, replacements load the same
    bytes, and pickled again for a worker started after the memfd was closed).
    ``pickle``: what pickles it (a test's stand-in)."""
    again = functools.partial(pickle, contents, fleet=fleet)
    parts = again()
    digest = parts.digest()
    memo = SHIPPED
    seen = memo.record(loader, digest)
    owner = weakref.ref(loader)

    def stored(ref: Any) -> None:  # the loader's next iterator reuses this copy
        if owner() is not None:
            memo.stored(owner(), digest, ref)

    delivery = Delivery(parts, ray.get_runtime_context().get_node_id(), digest,
                        stored=seen.stored, put=_store, repickle=again,
                        on_stored=stored, keep=not seen.before)
    reused = seen.previous == digest
    replaced = seen.previous.hex() if seen.previous is not None and not reused else None
    return Shipment(delivery, reused, len(parts), replaced, parts.libraries)


@dataclasses.dataclass(frozen=True)
class Shipment:
    """One iterator's shipped loader, what every worker start takes
    (:class:`Workers`): its :class:`~dpex._shipfile.Delivery` (the memfd, the object
    store's copy put when first needed), whether it is the loader's previous
    iterator's, and its size. The wing's processes: NOTE [ The worker host's
    processes ] in :mod:`dpex.server._fork_base`."""

    delivery: Delivery
    reused: bool  # the same bytes as the loader's previous iterator's: its hosts hold them
    size: int
    # The digest of the loader's previous shipment where the dataset changed: hosts drop
    # what they hold of it (it is never served again).
    replaced: str | None = None
    # The installed libraries its classes and functions are of: a host imports them in
    # its library base, which the dataset's base is forked from (one import for all).
    libraries: tuple[str, ...] = ()

    @property
    def digest(self) -> str:
        """What a host keys its fork base by (hex): one unpickled copy per digest, so a
        loader Lightning rebuilds with the same dataset finds it there."""
        return self.delivery.digest.hex()

    def release_local(self) -> None:
        """Every first worker started: the memfd may go (:meth:`Delivery.release_local`)."""
        self.delivery.release_local()

    def undelivered(self, cause: BaseException | None) -> bool:
        """Whether a worker's exit (``cause``) says its host could not use the trainer's
        memfd (:class:`~dpex._shipfile.ShipmentUnavailable`): not the worker's own
        failure; it and every later worker take the object store's copy."""
        if isinstance(cause, ShipmentUnavailable):
            self.delivery.refuse_local()
            return True
        return False

    @property
    def fallbacks(self) -> int:
        """Worker starts that took the object store's copy for want of the memfd."""
        return self.delivery.fallbacks
