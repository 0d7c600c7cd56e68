"""A host's fork bases (:mod:`dpex.server._fork_base`): which it holds, by shipment
digest (:class:`BaseCache`), and how it starts them (:class:`BaseStarter`).

A session of a loader forks from the base that holds that loader's shipment; the first
session of a shipment on this host starts one (from the bytes its ``serve`` call
brought: the trainer's memfd, or the object store's copy). One start runs per digest at
a time; sessions arriving meanwhile wait for it.

Invariants: a digest maps to a base that is starting, alive, or known unusable (None:
its loader left threads running, so each session unpickles its own); a start that
failed (the memfd gone before the base mapped it:
:class:`~dpex._shipfile.ShipmentUnavailable`) or a base that died is never handed out
again: the next session with bytes starts another. A base no session uses is stopped,
but those of the :data:`IDLE_BASES` latest digests (a train and a validation loader
take turns), and a changed dataset's at once (:meth:`forget`).

:class:`BaseCache` is pure but for the ``start`` it is given (a blocking call, run on
the loop's executor: a host's is :meth:`BaseStarter.start`). A base starts from a
*library base* that imported the installed libraries earlier bases' loaders imported,
else from the host's forkserver; a fleet's through the node's shared registry
(:mod:`dpex.server._node_bases`).

The host wing's processes, what each holds and when it ends: NOTE [ The worker
host's processes ] in :mod:`dpex.server._fork_base`.
"""

from __future__ import annotations

import asyncio
import functools
import logging
import sys
import threading
from collections.abc import Callable, Iterable
from typing import TYPE_CHECKING, Any, Protocol

from dpex._spec import Parcel
from dpex.server._fork_base import BaseUnsafe, ForkBase
from dpex.server._node_bases import NodeBases, Published
from dpex.server._session_process import START_STATE, mp_context, restore_state

if TYPE_CHECKING:
    from dpex._ray_connect import JobView

__all__ = ["IDLE_BASES", "Base", "BaseCache", "BaseStarter"]

logger = logging.getLogger("dpex")

IDLE_BASES = 3  # fork bases a host keeps while no session uses them (the latest ones)


class Base(Protocol):
    sessions: int  # live sessions forked from it (counted by the cache's users)

    def alive(self) -> bool: ...

    def mark_gone(self) -> None: ...

    def stop(self) -> None: ...


class BaseCache:
    """The bases of one host. Used from its event loop only."""

    def __init__(self, start: Callable[[str, Any], Base | None], idle: int = IDLE_BASES) -> None:
        """``start(digest, data)``: a started base holding ``data`` (blocking), None when
        the loader cannot be forked from; raises when it could not start."""
        self._start = start
        self._idle = idle
        self._bases: dict[str, asyncio.Future] = {}
        self._recent: list[str] = []  # digests sessions asked for, the latest last

    def forget(self, key: str | None) -> None:
        """Shipment ``key`` was replaced (its dataset changed): not kept idle."""
        if key in self._recent:
            self._recent.remove(key)

    async def base_for(self, key: str | None, shipped: Parcel) -> Base | None:
        """The base of shipment ``key`` (counted as used: :meth:`release` it), started
        from ``shipped`` if there is none, it died or its start failed; None when it
        cannot be used (or ``key`` is None). Raises what the start raised (to every
        session waiting for it); ``LookupError`` where a start is needed and ``shipped``
        holds nothing (no copy reached this worker)."""
        if key is None:
            return None
        self.forget(key)
        self._recent.append(key)
        pending = self._bases.get(key)
        if pending is not None and pending.done():
            failed = pending.cancelled() or pending.exception() is not None
            if not failed and (pending.result() is None or pending.result().alive()):
                return self._use(pending.result())
            pending = None  # it failed to start, or died (killed): start another
        if pending is None:
            self._bases.pop(key, None)
            self.retire()
            if shipped.empty:
                raise LookupError("no copy of the dataset reached this worker")
            pending = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
                None, self._start, key, shipped))
            self._bases[key] = pending
        try:
            return self._use(await asyncio.shield(pending))
        except BaseException:
            if pending.done() and self._bases.get(key) is pending:
                del self._bases[key]  # (a failed start is not held, nor what it raised)
            raise

    @staticmethod
    def _use(base: Base | None) -> Base | None:
        if base is not None:
            base.sessions += 1
        return base

    def release(self, base: Base | None) -> None:
        """A session forked from ``base`` ended."""
        if base is not None:
            base.sessions -= 1
            self.retire()

    def retire(self) -> None:
        """Stop the bases no session uses but the latest ``idle``; drop failed starts."""
        keep = set(self._recent[-self._idle:])
        del self._recent[:-self._idle]
        for key, pending in list(self._bases.items()):
            if not pending.done():
                continue
            if pending.cancelled() or pending.exception() is not None:
                del self._bases[key]
                continue
            base = pending.result()
            if key not in keep and (base is None or base.sessions == 0):
                del self._bases[key]
                if base is not None:
                    base.stop()

    def held(self) -> dict[str, Base | None]:
        """The started bases by digest (and None for unusable loaders)."""
        return {key: pending.result() for key, pending in self._bases.items()
                if pending.done() and not pending.cancelled() and pending.exception() is None}


def _prepare_base(ray_view: JobView | None, path: list[str]) -> None:
    """A fork base's start: the worker's environment and directory as it started, its
    ``sys.path`` as it is now (``path``: Ray adds the job's code paths, the trainer
    script's directory among them, once the worker runs the job's first task), and
    Ray calls of the dataset's unpickling join the worker's cluster (a base that
    connects to Ray is then not forked from: its Ray threads would not live through a
    fork)."""
    environ, _, cwd = START_STATE
    restore_state((environ, path, cwd))
    if ray_view is not None:
        from dpex._ray_connect import join_on_first_call

        join_on_first_call(ray_view)


def _import_libraries(data: Any) -> bool:  # (its base is not watched)
    """A library base's load: import the modules named in ``data`` (one per line; a
    bytes-like object, the base's private mapping of them)."""
    from dpex.server._forkserver_preload import import_all

    import_all(bytes(data).decode().split())
    return True


class BaseStarter:
    """How a worker starts its fork bases: from a *library base* (a process forked from
    the forkserver that imported the installed libraries earlier bases' loaders
    imported: Lightning's ``worker_init_fn`` imports Lightning, ~7 s of CPU here), so
    that a new dataset's base does not import them again; from the forkserver while
    there is none (or it would leave threads running: then never)."""

    def __init__(self, ray_view: JobView | None, share_libraries: bool = True,
                 node: NodeBases | None = None) -> None:
        """``node``: a fleet's bases on this node, shared with its other workers there."""
        self._ray_view = ray_view
        self._node = node
        self._lock = threading.Lock()  # (bases start on executor threads)
        self._libraries: dict[str, None] = {}  # in import order
        self._parent: ForkBase | None = None
        self._parent_has: set[str] = set()  # the top-level packages it imported
        self._refused = not share_libraries

    def learn(self, names: Iterable[str]) -> None:
        """A shipment's classes and functions are of these installed libraries (the
        trainer found them as it pickled): the library base imports them before the
        shipment's own base is forked from it, so that they are imported once for all
        of this host's bases, not once in the first and again in the library base."""
        with self._lock:
            if not self._refused:
                self._libraries.update(dict.fromkeys(names))

    def _new_packages(self) -> bool:
        return any(name.partition(".")[0] not in self._parent_has for name in self._libraries)

    def _prepare(self) -> Any:
        return functools.partial(_prepare_base, self._ray_view, list(sys.path))

    def _library_base(self) -> ForkBase | None:
        with self._lock:
            # (a submodule of a package it imported: a base imports it on its own, cheaply)
            if self._refused or not self._new_packages():
                return self._parent
            names = list(self._libraries)
            old, self._parent = self._parent, None
        # Forked from the one it replaces (only what is new is imported); from the
        # forkserver if that one is gone.
        parent = ForkBase(mp_context(), "libraries",
                          parent=old if old is not None and old.alive() else None)
        try:
            parent.start(Parcel("\n".join(names).encode()), self._prepare(), _import_libraries,
                         watch=False)
        except BaseUnsafe as exc:
            logger.info("dpex: %s; fork bases start from the forkserver", exc)
            with self._lock:
                self._refused = True
            return None
        finally:
            if old is not None:
                old.stop()  # (the bases forked from it live on)
        with self._lock:
            self._parent = parent
            self._parent_has = {name.partition(".")[0] for name in names}
        return parent

    def start(self, key: str, shipped: Parcel) -> ForkBase | Published | None:
        """A started fork base for shipment ``key`` (blocking), None if it cannot be used;
        a fleet's: the one this node's workers share, started here if there is none."""
        if self._node is not None:
            return self._node.start(key, functools.partial(self._start, key, shipped))
        return self._start(key, shipped)

    def _start(self, key: str, shipped: Parcel) -> ForkBase | None:
        from dpex.server._task_runner import BASE_LOAD  # (torch: not at the host's start)

        base = ForkBase(mp_context(), key, parent=self._library_base())
        try:
            base.start(shipped, self._prepare(), BASE_LOAD)
        except BaseUnsafe as exc:
            logger.warning("%s: each session unpickles the dataset itself", exc)
            return None
        if base.per_worker is not None:
            logger.info("dpex: %s, so each worker unpickles its own copy of the dataset "
                        "(as under torch's spawn); its tensors and arrays stay shared",
                        base.per_worker)
        with self._lock:
            self._libraries.update(dict.fromkeys(base.libraries))
        return base
