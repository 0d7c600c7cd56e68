"""Imported by a warm worker's forkserver, last of its preloads: imports the library
modules the worker's first session imported, so that later sessions, forked from it,
find them imported (a dataset whose ``worker_init_fn`` comes from Lightning imports
Lightning, transformers and matplotlib: ~10 s of CPU per session here).

The list comes in a file named by ``DPEX_FORKSERVER_PRELOAD`` (a list of thousands of
module names may be longer than one environment variable may be). A module that fails
to import here is skipped: the session imports it itself, as it would have.

A library that starts a thread when it is imported (a poller, a watchdog) would leave
the forkserver multi-threaded, and every session a fork of a multi-threaded process:
a lock that thread holds at the fork stays held in the child for good. So after the
imports the forkserver forks once, a child that exits at once, and counts its own
threads (``/proc/self/task``) after that fork: those that live through a fork. Native
thread pools that stop around a fork do not count (numpy's and scipy's OpenBLAS
start one on import, Lightning's imports include scipy, and OpenBLAS joins its pool
before each fork: counting threads right after the imports would refuse the
Lightning case its preload, ~6 s per session). When a thread one of the imports
started lives through the fork, a warning names the modules and their threads, and
the forkserver starts again in place without the list: ``exec`` of its own command
line, with the environment it started with (minus the list), so the same pid,
listening socket and pipe (inherited descriptors survive ``exec``; a request that
comes meanwhile waits in the socket's backlog) and only the base preloads (torch,
Ray, dpex). Its sessions then import those libraries themselves, as with
``DPEX_FORKSERVER_PRELOAD=0``. The forkserver decides, since it knows first: the
worker would have to wait for the preload to end to learn the verdict, and then
restart a process that is serving.
"""

import logging
import os
import signal
import sys
import threading
import time
import warnings

_FORK_PROBE_S = 10.0  # a child that only exits: its at-fork hooks are all it runs


def _thread_ids() -> set[int]:
    """This process's threads, by native id (Linux's task list; elsewhere the threads
    that Python knows of)."""
    try:
        return {int(t) for t in os.listdir("/proc/self/task")}
    except OSError:
        return {t.native_id for t in threading.enumerate() if t.native_id is not None}


def _thread_name(tid: int) -> str:
    for thread in threading.enumerate():
        if thread.native_id == tid:
            return thread.name
    try:
        with open(f"/proc/self/task/{tid}/comm", encoding="utf-8") as f:
            return f"native {f.read().strip()}"
    except OSError:
        return f"thread {tid}"


def import_all(names: list[str]) -> dict[int, str]:
    """Import ``names`` in order, skipping those that fail; the threads each import
    started (by native id) with the module's name."""
    started: dict[int, str] = {}
    for name in names:
        before = _thread_ids()
        try:
            __import__(name)
        except Exception:  # noqa: BLE001 - any failure: the session imports it itself
            pass
        started.update(dict.fromkeys(_thread_ids() - before, name))
    return started


def _threads_through_a_fork() -> set[int]:
    """The threads besides this one that live through a fork: fork a child that exits
    at once (killed if its at-fork hooks hang), then look."""
    with warnings.catch_warnings():  # (Python >= 3.12 warns of a multi-threaded fork)
        warnings.simplefilter("ignore", DeprecationWarning)
        pid = os.fork()
    if pid == 0:
        os._exit(0)
    deadline = time.monotonic() + _FORK_PROBE_S
    try:
        while os.waitpid(pid, os.WNOHANG) == (0, 0):
            if time.monotonic() > deadline:
                os.kill(pid, signal.SIGKILL)
                os.waitpid(pid, 0)  # (killed: reaped at once)
                break
            time.sleep(0.005)
    except ChildProcessError:
        pass  # reaped already (SIGCHLD ignored)
    return _thread_ids() - {threading.get_native_id()}


def _start_again(environ: dict[str, str]) -> None:
    """Replace this process with a fresh forkserver (see the module's docstring)."""
    for stream in (sys.stdout, sys.stderr):
        try:
            stream.flush()
        except (AttributeError, OSError, ValueError):
            pass
    os.execve(sys.executable, [sys.executable, *sys.orig_argv[1:]], environ)


def _preload(path: str) -> None:
    environ = dict(os.environ)  # as the forkserver started (the list's variable gone)
    try:
        with open(path, encoding="utf-8") as f:
            names = f.read().split()
    except OSError:
        return
    started = import_all(names)
    if not started:
        return
    kept = sorted(t for t in _threads_through_a_fork() if t in started)
    if not kept:
        return
    said = ", ".join(f"{_thread_name(t)!r} from {started[t]}" for t in kept)
    log = logging.getLogger("dpex")
    log.warning("dpex: importing the libraries this warm worker's first session imported "
                "started threads (%s): sessions forked from this forkserver would be "
                "forks of a multi-threaded process; it starts again without them, and "
                "each session imports them itself", said)
    try:
        _start_again(environ)
    except OSError as exc:
        log.warning("dpex: the forkserver could not start again (%s): its sessions are "
                    "forks of a multi-threaded process", exc)


_PATH = os.environ.pop("DPEX_FORKSERVER_PRELOAD", None)
if _PATH:
    _preload(_PATH)
