"""How a host starts its fork bases (:mod:`dpex.server._fork_base`): from a *library
base* that imported the installed libraries earlier bases' loaders imported, else from
the host's forkserver; a fleet's through the node's shared registry
(:mod:`dpex.server._node_bases`).

The host wing's processes, what each holds and when it ends: NOTE [ The worker
host's processes ] in :mod:`dpex.server._fork_base`.
"""

from __future__ import annotations

import functools
import logging
import sys
import threading
from typing import TYPE_CHECKING, Any

from dpex._spec import Parcel
from dpex.server._fork_base import BaseUnsafe, ForkBase
from dpex.server._node_bases import NodeBases, Published
from dpex.server._session_process import START_STATE, mp_context, restore_state
from dpex.server._task_runner import load_pickled

if TYPE_CHECKING:
    from dpex._ray_connect import JobView

__all__ = ["BaseStarter"]

logger = logging.getLogger("dpex")


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


def _import_libraries(data: bytes) -> None:  # (its base is not watched)
    """A library base's load: import the modules named in ``data`` (one per line)."""
    from dpex.server._forkserver_preload import import_all

    import_all(data.decode().split())


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
        self._parent_has = 0  # how many of _libraries it imported
        self._refused = not share_libraries

    def _prepare(self) -> Any:
        return functools.partial(_prepare_base, self._ray_view, list(sys.path))

    def _library_base(self) -> ForkBase | None:
        with self._lock:
            if self._refused or len(self._libraries) == self._parent_has:
                return self._parent
            names = list(self._libraries)
            old, self._parent = self._parent, None
        if old is not None:
            old.stop()  # (the bases forked from it live on)
        parent = ForkBase(mp_context(), "libraries")
        try:
            parent.start(Parcel("\n".join(names).encode()), self._prepare(), _import_libraries,
                         watch=False)
        except BaseUnsafe as exc:
            logger.info("dpex: %s; fork bases start from the forkserver", exc)
            with self._lock:
                self._refused = True
            return None
        with self._lock:
            self._parent, self._parent_has = parent, len(names)
        return parent

    def start(self, key: str, shipped: Parcel) -> ForkBase | Published | None:
        """A started fork base for shipment ``key`` (blocking), None if it cannot be used;
        a fleet's: the one this node's workers share, started here if there is none."""
        if self._node is not None:
            return self._node.start(key, functools.partial(self._start, key, shipped))
        return self._start(key, shipped)

    def _start(self, key: str, shipped: Parcel) -> ForkBase | None:
        base = ForkBase(mp_context(), key, parent=self._library_base())
        try:
            base.start(shipped, self._prepare(), load_pickled)
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
