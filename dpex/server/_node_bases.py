"""The fork bases a fleet's workers on one node share: one per shipment digest.

A fleet worker is a host of its own (:mod:`dpex.server._fork_base`), and a host forks
its sessions from a base that holds the dataset. Without sharing, a node running 16
fleet workers would hold 16 bases, 16 copies, of every attached trainer's dataset.
Here the first fleet worker of a node that needs a digest's base starts it (its
*owner*: the base is its child and watches its pipe) and publishes it in a directory of
this user's on the node (:class:`NodeBases`: ``<digest>.json``, its forkserver socket
and pid); the node's other workers of that fleet find it there and fork their sessions
from it too (multiprocessing's forkserver protocol over its socket, as the owner does).
Each fleet worker keeps its CPU reservation and its sessions stay isolated as before:
a session is a process of its own, whoever's base it was forked from.

Who may stop a base: each session holds a shared ``flock`` on the digest's ``.use``
file for its life; the owner stops a base it retires only when it can take that lock
exclusively (nobody's session uses it), else it keeps it and tries again at its next
start or retirement (:meth:`NodeBases.sweep`). Starts of one digest are serialised by
an exclusive lock on its ``.start`` file, so two workers never start two bases of one
dataset. A base whose owner died goes with it (it watches its owner's pipe): the
sessions forked from it live on; the registry entry is stale (its pid gone) and the
next worker that needs it starts another.

The wing's processes, what each holds and when it ends: NOTE [ The worker host's
processes ] in :mod:`dpex.server._fork_base`.
"""

from __future__ import annotations

import contextlib
import fcntl
import functools
import hashlib
import json
import logging
import os
import stat
import tempfile
import threading
import time
from collections.abc import Callable, Iterator
from typing import Any

from dpex.server._fork_base import ForkBase

__all__ = ["NodeBases", "Published"]

logger = logging.getLogger("dpex")

_LOCK_POLL_S = 0.05


class Published:
    """A base this worker started and published: the cache's handle on it. ``stop()``
    stops it only when no session of any worker uses it (:meth:`NodeBases.retire`)."""

    def __init__(self, node: NodeBases, key: str, base: ForkBase) -> None:
        self.node, self.key, self.base = node, key, base
        self.sessions = 0
        self.per_worker = base.per_worker
        self.libraries = base.libraries

    @property
    def pid(self) -> int | None:
        return self.base.pid

    def alive(self) -> bool:
        return self.base.alive()

    def process(self, **kwargs: Any) -> Any:
        return self.base.process(**kwargs)

    def mark_gone(self) -> None:
        """A fork through it failed: withdrawn from the registry, never used again."""
        self.node._withdraw(self)
        self.base.mark_gone()

    def stop(self) -> None:
        self.node.retire(self)


class NodeBases:
    """The bases the workers of one fleet share on this node (see the module's
    docstring). Thread-safe; every wait has a timeout."""

    def __init__(self, directory: str) -> None:
        self.directory = directory
        self._lock = threading.Lock()
        self._held: list[Published] = []  # retired but in use: stopped when unused
        self._gone: set[int] = set()  # pids of found bases a fork through failed

    @classmethod
    def for_fleet(cls, cluster: str, fleet: str) -> NodeBases | None:
        """The registry of fleet ``fleet`` of Ray cluster ``cluster`` on this node, in
        ``<tmp>/dpex-mp-<uid>/``; None where that directory is not this user's own."""
        name = hashlib.sha256(f"{cluster}\0{fleet}".encode()).hexdigest()[:20]
        top = os.path.join(tempfile.gettempdir(), f"dpex-mp-{os.getuid()}")
        directory = os.path.join(top, f"fleet-bases-{name}")
        try:
            for path in (top, directory):
                os.makedirs(path, mode=0o700, exist_ok=True)
                info = os.lstat(path)
                if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
                    return None  # someone else's (or a link): not ours to trust
        except OSError:
            return None
        return cls(directory)

    def _path(self, key: str, suffix: str) -> str:
        if not key.isalnum():
            raise ValueError(f"not a shipment digest: {key!r}")
        return os.path.join(self.directory, key + suffix)

    def _take(self, key: str, suffix: str, how: int, timeout: float) -> int:
        """A descriptor of ``key``'s ``suffix`` file holding ``how`` (its close releases
        it); TimeoutError after ``timeout`` s."""
        fd = os.open(self._path(key, suffix), os.O_RDWR | os.O_CREAT | os.O_CLOEXEC, 0o600)
        try:
            deadline = time.monotonic() + timeout
            while True:
                try:
                    fcntl.flock(fd, how | fcntl.LOCK_NB)
                    return fd
                except BlockingIOError:
                    if time.monotonic() >= deadline:
                        raise TimeoutError(f"dpex: {key[:12]}'s base lock held over "
                                           f"{timeout:g} s") from None
                    time.sleep(_LOCK_POLL_S)
        except BaseException:
            os.close(fd)
            raise

    @contextlib.contextmanager
    def _flock(self, key: str, suffix: str, how: int, timeout: float) -> Iterator[int]:
        fd = self._take(key, suffix, how, timeout)
        try:
            yield fd
        finally:
            os.close(fd)  # (releases the lock)

    def start(self, key: str, start: Callable[[], ForkBase | None],
              timeout: float = 600.0) -> ForkBase | Published | None:
        """The node's base of ``key``: another worker's, found; else ``start()``-ed here
        and published (None: the loader cannot be forked from)."""
        self.sweep()
        with self._flock(key, ".start", fcntl.LOCK_EX, timeout):
            found = self.find(key)
            if found is not None:
                return found
            base = start()
            if base is None:
                return None
            self._publish(key, base)
            return Published(self, key, base)

    def find(self, key: str) -> ForkBase | None:
        """The base another worker published for ``key``, if it still runs."""
        try:
            with open(self._path(key, ".json"), encoding="utf-8") as f:
                entry = json.load(f)
        except (OSError, ValueError):
            return None
        pid, address = entry.get("pid"), entry.get("address")
        if not isinstance(pid, int) or not isinstance(address, str) \
                or not os.path.exists(address):
            return None
        with self._lock:
            if pid in self._gone:  # (ending with its owner: its entry outlived it)
                return None
        base = ForkBase.attached(key, address, pid, entry.get("per_worker"),
                                 entry.get("libraries", []))
        base.on_gone = functools.partial(self._mark_gone, pid)
        return base if base.alive() else None

    def _mark_gone(self, pid: int) -> None:
        with self._lock:
            self._gone.add(pid)

    def _publish(self, key: str, base: ForkBase) -> None:
        path = self._path(key, ".json")
        entry = {"pid": base.pid, "address": base.address, "per_worker": base.per_worker,
                 "libraries": base.libraries}
        partial = f"{path}.{os.getpid()}"
        with open(partial, "w", encoding="utf-8") as f:
            json.dump(entry, f)
        os.replace(partial, path)

    def use(self, key: str, timeout: float = 60.0) -> int:
        """A session of ``key`` starts (before it asks for the base): its shared lock,
        held until :meth:`unuse` (the owner stops no base under it). Blocking."""
        return self._take(key, ".use", fcntl.LOCK_SH, timeout)  # (waits only on a retirement)

    @staticmethod
    def unuse(fd: int) -> None:
        """The session that took ``fd`` (:meth:`use`) ended."""
        os.close(fd)

    def retire(self, published: Published) -> None:
        """Stop ``published`` if no session uses it, else keep it until one sweep finds
        it unused."""
        if not self._stop_if_unused(published):
            with self._lock:
                self._held.append(published)

    def sweep(self) -> None:
        """Stop the retired bases nobody uses any more."""
        with self._lock:
            held, self._held = self._held, []
        for published in held:
            self.retire(published)

    def _stop_if_unused(self, published: Published) -> bool:
        try:
            with self._flock(published.key, ".use", fcntl.LOCK_EX, 0.0):
                self._withdraw(published)
                published.base.stop()
                # (gone before the lock is released: a session that takes it next
                # finds the base dead and starts another, never forks from a dying one)
                published.base.wait_stopped(5.0)
                return True
        except TimeoutError:
            return False  # a session of some worker still uses it

    def _withdraw(self, published: Published) -> None:
        path = self._path(published.key, ".json")
        try:
            with open(path, encoding="utf-8") as f:
                mine = json.load(f).get("pid") == published.base.pid
        except (OSError, ValueError):
            return
        if mine:
            with contextlib.suppress(OSError):
                os.unlink(path)
