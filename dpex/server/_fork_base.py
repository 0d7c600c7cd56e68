"""A fork base: one process per shipped loader on a worker host, holding the loader's
shipment (and, where that is exact, the loader unpickled once); the host's sessions of
that loader are forked from it.

NOTE [ The worker host's processes ]  (the other modules of the wing point here)

One shipment goes: the trainer pickles the loader at ``iter()``
(``client/_shipment.ship``), writes it into a sealed memfd (``_shipfile.Delivery``),
hands each worker on its node a reference to it (``client/_workers.deliver``), the
host finds or starts the base of that digest (``_base_cache.BaseCache``), the base maps
the memfd and unpickles, and the session is forked from the base
(``_session_process``) and serves (``_session``, ``_task_runner``).

[ trainer process ]
  Holds the loader, and per iterator one ``Delivery``: the memfd (sealed, written
  straight from the tensors' memory) and, put only when first needed, the object
  store's copy (a worker on another node, a host that could not use the memfd), which
  the loader keeps for its next iterator. Starts the hosts (``client/_workers``, early
  at construction while Ray runs: ``start_hosts_early``) and keeps them idle for
  ``warm_worker_timeout`` (``client/_warm``). Its copy of the dataset: the memfd
  closes once every first worker said HELLO, or at the iterator's end where it is
  kept (``Delivery.kept``: its pages are the base's own); a worker whose host could
  not use it starts again from the object store (``ShipmentUnavailable``).
[ host actor ]  ``_actor.DpexWorker(host=True)``, one per node and actor options
  A Ray actor reserving nothing; dies with the trainer's job (Ray), or when the warm
  pool lets it go. Holds no copy of the dataset: a serve call's bytes (the object
  store's view) go to a base and are dropped. Owns its forkserver, the library base,
  its fork bases (``BaseCache``: the 3 latest digests kept idle, a replaced one
  stopped at once) and its sessions' handles; kills a hung session alone.
[ forkserver ]  multiprocessing's, started by the host (``prestart``)
  torch, Ray and dpex imported; no dataset. Watches its pipe to the host.
[ library base ]  a ``ForkBase`` forked from the forkserver
  Imports the installed libraries earlier bases' loaders imported, so a new
  dataset's base imports nothing again; no dataset. Watches its pipe to the host;
  replaced when another library is needed (the bases forked from it live on).
[ fork base ]  a ``ForkBase`` per digest, forked from the library base or forkserver
  Maps the trainer's memfd copy-on-write (from the object store: a private copy of its
  bytes), unpickles the loader once under an ``UnpicklingWatch``, freezes the garbage
  collector's view and runs multiprocessing's forkserver loop. Holds the shipment's
  pages; and the unpickled loader, unless unpickling ran the dataset's own code or
  left a descriptor open (then each session unpickles its own over those pages, as
  under torch's ``spawn``: ``_unpickling``). Says ``unavailable`` and exits when the
  memfd is gone, ``unsafe`` when unpickling left threads. Ends when the host closes
  its pipe (retired by the ``BaseCache``) or dies; its copy of the dataset goes with
  it and with the last session that shares its pages. A fleet's: the node's fleet
  workers share it (``_node_bases``: its owner started it; the others fork from it).
[ session process ]  ``_session_process.SessionProcess``, forked from the base
  One worker of one iterator: its seeds, ``get_worker_info()``, ``worker_init_fn``,
  ring and sockets, as a fresh torch worker. Its dataset: the base's pages until it
  writes them (or its own unpickling over them). In its own host's process group
  (``_session_process._join``: forked from another fleet worker's base, it moves
  there), which Ray ends with the host. Ends when its trainer ends the session, when
  its pipe to the host reports stop or end of file (the host died), or when the host
  kills it (hung).

torch's workers are forks of the trainer and share its dataset copy-on-write. A dpex
host (a worker actor serving several sessions, each in a process of its own) gets
the same: for each shipped loader it serves, it forks one process from its
forkserver (torch, Ray and dpex imported), hands it the pickled loader once, and that
process unpickles it (with the trainer's directory and environment applied), freezes
the garbage collector's view of what it holds (``gc.freeze()``: a collection in a
session then writes to none of those objects' pages) and runs multiprocessing's own
forkserver loop (``multiprocessing.forkserver.main``). Each session of that loader is
a fork of it: ``get_worker_info()``, seeds and ``worker_init_fn`` are set up in the
session as in a fresh torch worker, and the dataset's pages are shared until written
(a Python object's pages are written when its reference count changes: the list of
strings torch users know from pytorch/pytorch#13246 is copied page by page into a
session that reads it, as into torch's forks).

A dataset whose unpickling leaves a thread running (it connected to Ray, started a
pool) would make every session a fork of a multi-threaded process; such a base says
so (``unsafe``) and exits, and the host serves that loader's sessions as before, each
unpickling its own copy (:class:`~dpex.server._session_process.SessionProcess`
without a base).
"""

from __future__ import annotations

import gc
import io
import mmap
import multiprocessing.context
import multiprocessing.forkserver
import multiprocessing.popen_forkserver
import multiprocessing.util
import os
import socket
import sys
import sysconfig
import threading
from collections.abc import Callable, Iterable
from multiprocessing import connection, reduction, spawn
from multiprocessing.connection import Connection
from typing import Any

from dpex._shipfile import ShipmentUnavailable, map_shipment
from dpex._spec import Parcel
from dpex._start_trace import mark
from dpex.server._unpickling import UnpicklingWatch

__all__ = ["ForkBase", "BaseUnsafe", "enter_base_state"]

_READY_S = 600.0  # how long a host waits for a base to unpickle its loader

# In a base and the sessions forked from it: its directory and sys.path once the
# trainer's were applied.
_STATE: tuple[str, list[str]] | None = None


class BaseUnsafe(RuntimeError):
    """A base could not be used (its loader left threads running): serve without."""


def enter_base_state() -> None:
    """In a session forked from a base: the base's directory and sys.path (the trainer's,
    applied there; multiprocessing's start put back the host's)."""
    if _STATE is not None:
        cwd, path = _STATE
        sys.path[:] = path
        try:
            os.chdir(cwd)
        except OSError:
            pass  # gone since: stay where the host is


def libraries_since(before: Iterable[str]) -> list[str]:
    """The modules imported since ``before`` (names) that belong to installed libraries
    (the standard library's and site-packages' directories, never ``__main__`` or the
    user's own code), in the order they were imported."""
    paths = sysconfig.get_paths()
    roots = tuple({os.path.join(os.path.realpath(paths[k]), "")
                   for k in ("stdlib", "platstdlib", "purelib", "platlib") if k in paths})
    before = set(before)
    names = []
    for name, module in list(sys.modules.items()):
        if name in before or name in ("__main__", "__mp_main__"):
            continue
        file = getattr(module, "__file__", None)
        if isinstance(file, str) and os.path.realpath(file).startswith(roots):
            names.append(name)
    return names


def _threads() -> int:
    try:
        return len(os.listdir("/proc/self/task"))
    except OSError:
        return threading.active_count()


def _base_main(address: str, alive: Connection, link: Connection,
               prepare: Callable[[], None], load: Any, watch: bool = True) -> None:
    """The base: ``prepare()`` the process, take the pickled loader from ``link`` and
    ``load`` it (``watch``-ed: see :mod:`dpex.server._unpickling`; ``load`` holds what it
    made where its sessions read it, :class:`~dpex.server._task_runner.BaseLoad`), say
    there whether it is ready, then fork sessions until ``alive`` reaches its end."""
    global _STATE
    mark("base forked")
    prepare()  # (as the host started, not as its forkserver did)
    before = set(sys.modules)
    per_worker: str | None = None
    try:
        source = link.recv()  # the trainer's memfd (dpex._shipfile), or bytes to follow
        data = map_shipment(source) if source is not None else _private(link.recv_bytes())
    except ShipmentUnavailable as exc:  # (gone before this base could map it: the host
        link.send(("unavailable", str(exc)))  # gets the object store's copy instead)
        return
    watching = UnpicklingWatch() if watch else None
    if watching is not None:
        with watching:
            loaded = load(data, unpickler=watching.unpickler)
    else:
        loaded = load(data)
    gc.collect()  # (one collection: a file the loader dropped is closed before counting)
    if watching is not None and loaded:
        opened = watching.opened()
        if watching.foreign is not None or opened:
            per_worker = (f"unpickling it runs {watching.foreign}" if watching.foreign
                          else f"unpickling it opens {', '.join(opened)}")
            load.each_worker(data, per_worker)
            gc.collect()  # the trial copy goes (before gc.freeze() would keep it)
    del data  # (a shared loader holds what it needs of it)
    mark("base loaded")
    threads = _threads()
    if threads > 1 or ("ray" in sys.modules and sys.modules["ray"].is_initialized()):
        link.send(("unsafe", f"{threads} threads ran after it unpickled the loader"))
        return
    gc.freeze()  # a session's collections leave the loader's objects' pages alone
    _STATE = (os.getcwd(), list(sys.path))
    listener = socket.socket(socket.AF_UNIX)
    listener.bind(address)
    os.chmod(address, 0o600)
    listener.listen()
    # Bare descriptors from here on: a Connection object left in a session (forked
    # with this frame) would close its number again when collected.
    alive_fd = os.dup(alive.fileno())
    alive.close()
    link.send(("ready", libraries_since(before), per_worker))
    link.close()
    multiprocessing.forkserver.main(listener.detach(), alive_fd, [])


def _private(data: bytes) -> memoryview:
    """``data`` copied into a private anonymous mapping: the base's forks share its pages
    until they write them (a worker that unpickles its own loader lends its buffers from
    it, where ``bytes`` would make it copy each)."""
    mapped = mmap.mmap(-1, max(len(data), 1), flags=mmap.MAP_PRIVATE,
                       prot=mmap.PROT_READ | mmap.PROT_WRITE)
    mapped[:len(data)] = data
    return memoryview(mapped)[:len(data)]


class _Pid:
    """A base another process started (:meth:`ForkBase.attached`): alive while its pid is."""

    def __init__(self, pid: int) -> None:
        self.pid = pid

    def is_alive(self) -> bool:
        try:
            os.kill(self.pid, 0)
        except (ProcessLookupError, PermissionError):
            return False
        return True

    def join(self, timeout: float | None = None) -> None:
        pass  # (not this process's child)


_SPARE_FD: int | None = None  # what a process that does not own a base sends as its
_SPARE_LOCK = threading.Lock()  # "alive" descriptor (the forked child only keeps it)


def _spare_fd() -> int:
    global _SPARE_FD
    with _SPARE_LOCK:
        if _SPARE_FD is None:
            r, _SPARE_FD = os.pipe()
            os.close(r)
        return _SPARE_FD


class _Server(multiprocessing.forkserver.ForkServer):
    """The host's side of a base: multiprocessing's forkserver client, aimed at it."""

    def __init__(self, address: str, alive_fd: int, proc: Any) -> None:
        super().__init__()
        self._forkserver_address = address
        self._forkserver_alive_fd = alive_fd
        self._proc = proc

    def ensure_running(self) -> None:
        if not self._proc.is_alive():
            raise BaseUnsafe(f"the fork base (pid {self._proc.pid}) is gone")


class _Popen(multiprocessing.popen_forkserver.Popen):
    """multiprocessing's forkserver ``Popen``, asking a base instead of its forkserver
    (``_launch`` is the standard library's, with ``self._server`` for the module's)."""

    def __init__(self, process_obj: Any, server: _Server) -> None:
        self._server = server
        super().__init__(process_obj)

    def _launch(self, process_obj: Any) -> None:
        prep_data = spawn.get_preparation_data(process_obj._name)
        buf = io.BytesIO()
        multiprocessing.context.set_spawning_popen(self)
        try:
            reduction.dump(prep_data, buf)
            reduction.dump(process_obj, buf)
        finally:
            multiprocessing.context.set_spawning_popen(None)
        self.sentinel, w = self._server.connect_to_new_process(self._fds)
        _parent_w = os.dup(w)
        self.finalizer = multiprocessing.util.Finalize(
            self, multiprocessing.util.close_fds, (_parent_w, self.sentinel))
        with open(w, "wb", closefd=True) as f:
            f.write(buf.getbuffer())
        self.pid = multiprocessing.forkserver.read_signed(self.sentinel)


class _Process(multiprocessing.context.ForkServerProcess):
    """A process forked from a base (``server``; not pickled to the child)."""

    def __init__(self, server: _Server, **kwargs: Any) -> None:
        super().__init__(**kwargs)
        self._server = server

    def _Popen(self, process_obj: Any) -> _Popen:  # noqa: N802 - multiprocessing's name
        return _Popen(process_obj, self._server)

    def __getstate__(self) -> dict:
        state = dict(self.__dict__)
        state.pop("_server", None)
        return state


class ForkBase:
    """The host's handle on one base. :meth:`start` blocks (run it on a thread)."""

    def __init__(self, ctx: Any, key: str, parent: ForkBase | None = None) -> None:
        """Forked from ``parent`` (a base that imported libraries), else from ``ctx``'s
        forkserver."""
        self.key = key
        self.sessions = 0  # live sessions forked from it (the host's count)
        self.libraries: list[str] = []  # what loading imported from installed libraries
        self.per_worker: str | None = None  # why each session unpickles its own loader
        self._ctx = ctx
        self._parent = parent
        self._proc: Any = None
        self._alive: Connection | None = None
        self._server: _Server | None = None
        self._address: str | None = None
        self._gone = False  # a fork through it failed (mark_gone)
        self.on_gone: Callable[[], None] | None = None  # (a found base: its registry's)
        self._lock = threading.Lock()

    def start(self, shipped: Parcel, prepare: Callable[[], None], load: Any,
              timeout: float = _READY_S, watch: bool = True) -> None:
        """Fork the base, hand it ``shipped`` (the pickled loader's bytes, or the trainer's
        memfd holding it, which the base maps itself; ``shipped`` keeps what it holds) and
        wait until ``load(data)`` is done there (after ``prepare()``; both pickled by
        reference; ``watch``: ``load`` takes an ``unpickler`` keyword, says whether it
        loaded, has an ``each_worker(data, why)`` (a
        :class:`~dpex.server._task_runner.BaseLoad`), and the base watches what
        unpickling does, :mod:`dpex.server._unpickling`); raises
        :class:`BaseUnsafe` when it cannot be used, :class:`ShipmentUnavailable` when
        the memfd ``data`` names is gone (then nothing is left running)."""
        address = connection.arbitrary_address("AF_UNIX")
        alive_r, alive_w = self._ctx.Pipe(duplex=False)
        link, base_link = self._ctx.Pipe()
        start = self._ctx.Process if self._parent is None else self._parent.process
        proc = start(target=_base_main, name=f"dpex-fork-base-{self.key[:8]}", daemon=True,
                     args=(address, alive_r, base_link, prepare, load, watch))
        proc.start()
        alive_r.close()
        base_link.close()
        try:
            link.send(shipped.ref)  # the trainer's memfd: the base maps it itself
            if shipped.ref is None:
                link.send_bytes(shipped.view())  # (the object store's copy: nothing kept)
            said = link.recv() if link.poll(timeout) else ("unsafe", "no answer")
        except (EOFError, OSError):
            proc.join(1.0)
            said = ("unsafe", f"it died with exit code {proc.exitcode}")
        finally:
            link.close()
        if said[0] != "ready":
            alive_w.close()
            proc.join(5.0)
            if proc.exitcode is None:
                proc.kill()
                proc.join(5.0)
            if said[0] == "unavailable":
                raise ShipmentUnavailable(said[1])
            raise BaseUnsafe(f"dpex fork base for this loader: {said[1]}")
        with self._lock:
            self._proc, self._alive = proc, alive_w
            self._server = _Server(address, alive_w.fileno(), proc)
            self._address = address
            self.libraries = list(said[1])
            self.per_worker = said[2]

    @classmethod
    def attached(cls, key: str, address: str, pid: int, per_worker: str | None,
                 libraries: list[str]) -> ForkBase:
        """A base another process of this user started (a fleet worker on this node:
        :mod:`dpex.server._node_bases`), reached at its forkserver socket ``address``;
        sessions fork from it as from one's own, and :meth:`stop` leaves it be."""
        base = cls(None, key)
        base._proc = _Pid(pid)
        base._address = address
        base._server = _Server(address, _spare_fd(), base._proc)
        base.per_worker, base.libraries = per_worker, list(libraries)
        return base

    @property
    def pid(self) -> int | None:
        return None if self._proc is None else self._proc.pid

    @property
    def address(self) -> str | None:
        """Its forkserver's socket (what another worker of this node forks through)."""
        return self._address

    def alive(self) -> bool:
        with self._lock:
            return self._proc is not None and not self._gone and self._proc.is_alive()

    def mark_gone(self) -> None:
        """A fork through it failed (its socket closed, the base ending as its owner
        did): never used again, though its pid may live on a moment; an own base is
        let end (:meth:`stop`)."""
        with self._lock:
            self._gone = True
        self.stop()
        if self.on_gone is not None:
            self.on_gone()

    def process(self, **kwargs: Any) -> Any:
        """A ``multiprocessing.Process`` to be forked from this base."""
        if self._server is None:
            raise BaseUnsafe("dpex fork base not started")
        return _Process(self._server, **kwargs)

    def wait_stopped(self, timeout: float) -> None:
        """After :meth:`stop`: until the base's process is gone (at most ``timeout``)."""
        proc = self._proc
        if proc is not None:
            proc.join(timeout)

    def stop(self) -> None:
        """Let the base end: once its sessions have ended it exits (idempotent)."""
        with self._lock:
            alive, self._alive = self._alive, None
            proc = self._proc
        if alive is not None:
            alive.close()
        if proc is not None and not proc.is_alive():
            proc.join(0)
