"""A fleet session in a process of its own.

A fleet worker serves the sessions of several trainers. torch's worker semantics
(the seeds of ``torch``, ``random`` and NumPy, ``get_worker_info()``, whatever a
dataset does to module state) are process-wide, so each session runs in a child
process forked from a forkserver that the fleet worker starts once, with torch
and dpex imported: a session whose dataset is slow, hangs or crashes the
interpreter holds up no other session, and each one sees a process of its own,
as a worker of torch's does.

Ownership: the ``serve`` call that starts a :class:`SessionProcess` stops it
(``stop()``: ask, wait, kill). The child watches its end of a pipe to the fleet
worker and ends its session when the worker asks or dies (end of file).

The host wing's processes, what each holds and when it ends: NOTE [ The worker
host's processes ] in :mod:`dpex.server._fork_base`.
"""

from __future__ import annotations

import asyncio
import multiprocessing
import multiprocessing.forkserver
import multiprocessing.util
import os
import shutil
import stat
import sys
import tempfile
import threading
import time
from multiprocessing.connection import Connection
from typing import TYPE_CHECKING, Any

from dpex._spec import PRELOADED, Parcel
from dpex._start_trace import mark, process_started
from dpex.server._fork_base import ForkBase, enter_base_state, libraries_since

if TYPE_CHECKING:
    from dpex._ray_connect import JobView
    from dpex._spec import WorkerSpec

__all__ = ["START_STATE", "SessionProcess", "SessionWorker", "mp_context", "prestart",
           "restore_state"]

COUNTERS = ("batches_sent", "bytes_sent", "control_rejected")
# What every session would import again: Ray, the host's modules and the session's
# (torch among them; the host itself imports torch only once it serves).
_PRELOAD = ["ray", "dpex.server._actor", "dpex.server._session"]
PRELOAD_LIBRARIES = "DPEX_FORKSERVER_PRELOAD"  # 0: the forkserver imports only _PRELOAD
STOP_GRACE_S = 15.0  # the session's own clean-up waits 10 s at most for its fetch


def _process_state() -> tuple[dict, list, str | None]:
    try:
        cwd: str | None = os.getcwd()
    except OSError:  # (removed under it)
        cwd = None
    return dict(os.environ), list(sys.path), cwd


# This process's state as the worker started (this module is imported with the actor
# class, before any session). Each session's process starts from it: the forkserver
# inherits the environment, working directory and sys.path of the moment it starts,
# and a warm worker starts it only after its first session, which ran in the actor
# and may have changed them (a worker_init_fn setting a variable).
START_STATE = _process_state()
_START_MODULES = frozenset(sys.modules)


def restore_state(state: tuple[dict, list, str | None]) -> None:
    environ, path, cwd = state
    os.environ.clear()
    os.environ.update(environ)
    sys.path[:] = path
    if cwd is not None:
        try:
            os.chdir(cwd)
        except OSError:
            pass  # gone since: stay where the forkserver is


def mp_context() -> Any:
    config = multiprocessing.current_process()._config  # (where get_temp_dir() looks)
    if config.get("tempdir") is None:
        mine = _temp_dir()
        if mine is not None:
            config["tempdir"] = mine
    ctx = multiprocessing.get_context("forkserver")
    ctx.set_forkserver_preload(_PRELOAD)
    return ctx


def _temp_dir() -> str | None:
    """multiprocessing's temp directory for this process (the forkserver's socket lives
    there): ``<tmp>/dpex-mp-<uid>/<pid>``. multiprocessing's own ``pymp-*`` is removed
    only at a clean exit, and Ray ends its actors with SIGKILL, so each worker left one
    behind; here each start removes those of processes that are gone. None (keep
    multiprocessing's) when the base directory is not this user's own."""
    base = os.path.join(tempfile.gettempdir(), f"dpex-mp-{os.getuid()}")
    try:
        os.makedirs(base, mode=0o700, exist_ok=True)
        info = os.lstat(base)
        if not stat.S_ISDIR(info.st_mode) or info.st_uid != os.getuid():
            return None  # someone else's (or a link): not ours to use or clean
        for name in os.listdir(base):
            if name.isdigit() and int(name) != os.getpid() and not _alive(int(name)):
                shutil.rmtree(os.path.join(base, name), ignore_errors=True)
        mine = os.path.join(base, str(os.getpid()))
        os.makedirs(mine, mode=0o700, exist_ok=True)
    except OSError:
        return None
    multiprocessing.util.Finalize(None, shutil.rmtree, args=(mine, True), exitpriority=-100)
    return mine


def _alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        pass  # another user's
    return True


def prestart() -> None:
    """Start the forkserver (imports torch: seconds) before the first session needs it.
    It also imports the library modules this process imported since it started (a
    warm worker's first session ran here): each later session would import them again
    (docs/WARM_WORKERS.md). Only modules of installed libraries, never the user's own
    code or ``__main__``; a session still gets them with no state of the first one's,
    since the forkserver only imported them."""
    ctx = mp_context()
    listed = _preload_file(library_modules())
    if listed is None:
        multiprocessing.forkserver.ensure_running()
    else:
        ctx.set_forkserver_preload([*_PRELOAD, "dpex.server._forkserver_preload"])
        os.environ[PRELOAD_LIBRARIES] = listed  # the forkserver starts with this environment
        try:
            multiprocessing.forkserver.ensure_running()
        finally:
            os.environ.pop(PRELOAD_LIBRARIES, None)
    pid = getattr(multiprocessing.forkserver._forkserver, "_forkserver_pid", None)
    mark("forkserver ready", started=process_started(pid) if pid else None, child=pid)


def library_modules() -> list[str]:
    """The modules imported since this process started that belong to installed
    libraries (the standard library's and site-packages' directories), in the order
    they were imported; none with ``DPEX_FORKSERVER_PRELOAD=0``."""
    if os.environ.get(PRELOAD_LIBRARIES, "1") == "0":
        return []
    return libraries_since(_START_MODULES)


def _preload_file(names: list[str]) -> str | None:
    """Write ``names`` to a file in multiprocessing's temp directory of this process
    (see :func:`mp_context`); its path, or None when there is nothing to write or
    nowhere to write it."""
    if not names:
        return None
    try:
        path = os.path.join(multiprocessing.util.get_temp_dir(), "forkserver-preload.txt")
        with open(path, "w", encoding="utf-8") as f:
            f.write("\n".join(names))
    except OSError:
        return None
    return path


class SessionProcess:
    """The fleet worker's handle on one session's child process."""

    def __init__(self, worker_class: type, spec: Any, shipped: Parcel, placement: dict,
                 session_timeout: float, ray_view: JobView | None = None,
                 base: ForkBase | None = None) -> None:
        """``worker_class(placement, session_timeout, counts)`` serves the session in the
        child (:class:`SessionWorker`, passed by reference: pickled by name). ``ray_view``: the worker's
        cluster and job, which Ray calls in the child's dataset code join
        (:func:`dpex._ray_connect.join_on_first_call`). ``base``: the fork base that
        holds this session's loader unpickled (:mod:`dpex.server._fork_base`), which the
        child is forked from; without, it is forked from the worker's forkserver and
        unpickles ``shipped`` itself."""
        ctx = mp_context()
        self.counts = ctx.RawArray("q", len(COUNTERS))  # written by the child
        self._conn, child_end = ctx.Pipe()
        self._child_end: Connection | None = child_end
        if base is not None:
            shipped = PRELOADED  # (its base holds the loader)
        self._proc = (ctx.Process if base is None else base.process)(
            target=_main, name=f"dpex-session-{spec.worker_id}", daemon=True,
            args=(worker_class, spec, shipped, placement, session_timeout, self.counts,
                  child_end, ray_view, None if base is not None else START_STATE,
                  os.getpgrp()))
        self.worker_id = spec.worker_id
        self.session_id = getattr(spec.wire, "session_id", None)
        self._lock = threading.Lock()  # start and stop run on executor threads
        self._stopped = False
        self._outcome: BaseException | None = None
        self._shipped = shipped  # (dropped once the child has its copy)

    def counters(self) -> dict[str, int]:
        return dict(zip(COUNTERS, self.counts, strict=True))

    def start(self) -> None:
        """Fork the child (a round trip to the forkserver). Blocking: run it in a thread."""
        with self._lock:
            if self._stopped:
                return
            self._proc.start()
            self._child_end.close()
            self._child_end = None
            self._shipped.drop()  # the child has its own copy: this process keeps none

    async def wait(self, stop: asyncio.Event) -> None:
        """Until the child ends or ``stop`` is set. The child is watched by its pid (a
        pidfd), not by the status pipe of the base that forked it: a base another fleet
        worker of this node owns ends with that worker, and its pipe's end of file
        would read as this session's end (:mod:`dpex.server._node_bases`)."""
        loop = asyncio.get_running_loop()
        ended = loop.create_future()
        pidfd = self._pidfd()
        fd = pidfd if pidfd is not None else self._proc.sentinel
        loop.add_reader(fd, lambda: ended.done() or ended.set_result(None))
        stopper = asyncio.ensure_future(stop.wait())
        try:
            await asyncio.wait({ended, stopper}, return_when=asyncio.FIRST_COMPLETED)
        finally:
            loop.remove_reader(fd)
            stopper.cancel()
            if pidfd is not None:
                os.close(pidfd)

    def _pidfd(self) -> int | None:
        """A descriptor readable once the child ends (None: no pidfd here, Linux < 5.3,
        or the child is gone already: its sentinel says so)."""
        try:
            return os.pidfd_open(self._proc.pid)
        except (AttributeError, OSError):
            return None

    def kill(self) -> None:
        """SIGKILL the child (a session presumed hung); :meth:`wait` then returns."""
        if self._child_end is None and self._proc.pid is not None:  # (started)
            try:  # (not under the lock: stop() may hold it while it waits)
                self._proc.kill()
            except (OSError, ValueError):
                pass  # ended already

    def stop(self, grace: float = STOP_GRACE_S) -> None:
        """Ask the child to end its session, wait ``grace`` seconds, then kill it; keep
        what it reported. Blocking and idempotent: run it in a thread."""
        with self._lock:
            if self._stopped:
                return
            self._stopped = True
            if self._child_end is not None:  # never started
                self._child_end.close()
                self._conn.close()
                return
            try:
                self._conn.send_bytes(b"stop")
            except OSError:
                pass  # the child is gone already
            deadline = time.monotonic() + grace
            self._outcome = self._receive(grace)
            self._proc.join(max(0.0, deadline - time.monotonic()))
            if self._proc.exitcode is None:
                self._proc.kill()
                self._proc.join(5.0)
            self._conn.close()
            if self._outcome is None and self._proc.exitcode not in (0, None):
                self._outcome = RuntimeError(
                    f"the process of this dpex fleet session (pid {self._proc.pid}) died "
                    f"with exit code {self._proc.exitcode} before reporting how it ended")

    def _receive(self, timeout: float) -> BaseException | None:
        """What the child reported: ``None`` for a clean end, else its exception."""
        try:
            if self._conn.poll(timeout):
                return self._conn.recv()
        except (EOFError, OSError):
            pass  # it died without a word: see the exit code
        return None

    def raise_outcome(self) -> None:
        if self._outcome is not None:
            raise self._outcome


def _join(group: int | None) -> None:
    """Move this session into its own fleet worker's process group. A session forked
    from a base another fleet worker of the node started (:mod:`dpex.server._node_bases`)
    is born in that worker's group, and Ray ends a dead worker's group (SIGTERM): the
    session would end with a worker it does not belong to, and its own worker's end
    would not reach it. Ray starts each worker in a group of its own within one
    session, so the move is allowed; where it is not (another session), it stays."""
    if group is None or os.getpgrp() == group:
        return
    try:
        os.setpgid(0, group)
    except OSError:
        pass


def _main(worker_class: type, spec: Any, shipped: Parcel, placement: dict,
          session_timeout: float, counts: Any, conn: Connection,
          ray_view: JobView | None = None,
          start_state: tuple[dict, list, str | None] | None = None,
          group: int | None = None) -> None:
    """The child: serve one session until it ends, the fleet worker asks, or dies.
    ``group``: its fleet worker's process group, which it joins (see :func:`_join`)."""
    mark("session forked", worker=spec.worker_id)
    _join(group)
    if start_state is not None:
        restore_state(start_state)  # as the worker started, not as its forkserver did
    if shipped.preloaded:  # forked from a fork base: the trainer's state, applied there
        enter_base_state()
    if ray_view is not None:
        # Ray is imported here but not connected: the first Ray call of the dataset's
        # code joins the worker's cluster, namespace and runtime_env, instead of
        # starting a new local Ray or joining as a stranger. A dataset that makes no
        # Ray call connects nothing (a connection takes ~0.3 s here).
        from dpex._ray_connect import join_on_first_call

        join_on_first_call(ray_view)
    outcome: BaseException | None = None
    try:
        shipped.map_now()  # the trainer's memfd, if it is one: read before HELLO, after
        # which the trainer may close it (ShipmentUnavailable goes back as it is: the
        # trainer starts it again)
        worker = worker_class(placement, session_timeout, counts)
        asyncio.run(worker.serve_until_told(spec, shipped, conn))
    except BaseException as exc:
        outcome = exc
    try:
        conn.send(outcome)
    except OSError:
        pass  # the worker stopped listening (its session was ended): nobody to tell
    except Exception:  # an exception that cannot be pickled: keep its text
        try:
            conn.send(RuntimeError(f"{type(outcome).__name__}: {outcome}"))
        except OSError:
            pass
    finally:
        conn.close()


class SessionWorker:
    """A session's own process (:mod:`dpex.server._session_process`; a fleet's, or one
    on a warm worker): serves one session and counts its traffic into memory the worker
    reads."""

    def __init__(self, placement: dict, session_timeout: float, counts: Any) -> None:
        self.placement = {**placement, "session_pid": os.getpid()}
        self._counts = counts  # COUNTERS order: batches, bytes, control rejected
        from dpex.server._session import SessionServer  # (the forkserver imported it)

        self._server = SessionServer(self.placement, session_timeout, self._count,
                                     self._count_rejected)

    def _count(self, nbytes: int) -> None:
        self._counts[0] += 1  # one writer: this session's compute thread
        self._counts[1] += nbytes

    def _count_rejected(self) -> None:
        self._counts[2] += 1  # one writer: this session's control reader

    async def serve_until_told(self, spec: WorkerSpec, shipped: Parcel, conn: Any) -> None:
        """Serve until the session ends, or the fleet worker says stop or dies."""
        loop = asyncio.get_running_loop()
        task = asyncio.ensure_future(self._server.serve(spec, shipped))

        def told() -> None:  # "stop", or end of file: the fleet worker is gone
            loop.remove_reader(conn.fileno())
            task.cancel()

        loop.add_reader(conn.fileno(), told)
        try:
            await task
        except asyncio.CancelledError:
            if not task.cancelled():
                raise
        finally:
            loop.remove_reader(conn.fileno())
