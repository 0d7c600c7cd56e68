"""Teardown on a thread dpex owns, never on whatever thread collects garbage.

A dropped iterator is finalized wherever the garbage collector happens to run: on a
thread of Ray's, inside a lock of some library, or in a forked child that exits.
Stopping actors (``ray.kill``), closing sockets and joining a loop thread from there
can deadlock, or reach into the parent's workers. So a finalizer only hands the work
to the reaper thread here, and in a forked child it does nothing at all: the parent's
workers, sockets and threads are the parent's.
"""

from __future__ import annotations

import atexit
import logging
import os
import queue
import threading
from collections.abc import Callable

__all__ = ["reap", "flush", "finalizer_for"]

logger = logging.getLogger("dpex")


class _Reaper:
    def __init__(self) -> None:
        self._queue: queue.SimpleQueue = queue.SimpleQueue()  # put() is safe in __del__
        self._lock = threading.RLock()  # re-entrant: garbage may be collected in submit
        self._thread: threading.Thread | None = None

    def submit(self, fn: Callable[[], None]) -> None:
        with self._lock:
            if self._thread is None or not self._thread.is_alive():
                self._thread = threading.Thread(target=self._run, name="dpex-reaper",
                                                daemon=True)
                self._thread.start()
        self._queue.put(fn)

    def _run(self) -> None:
        while True:
            fn = self._queue.get()
            if fn is None:
                return
            try:
                fn()
            except Exception:  # one teardown's failure must not stop the others
                logger.exception("dpex: a teardown failed")

    def flush(self, timeout: float) -> bool:
        """Wait until everything handed over so far has run (``release_warm_workers()``:
        a dropped iterator's teardown gives its workers back to the pool, and must do
        so while Ray is up). False on timeout, or when called on the reaper thread itself
        (a teardown cannot wait for those queued after it)."""
        thread = self._thread
        if thread is None or not thread.is_alive():
            return True  # nothing was handed over, or all of it ran
        if thread is threading.current_thread():
            return False
        done = threading.Event()
        self._queue.put(done.set)
        return done.wait(timeout)

    def stop(self, timeout: float = 10.0) -> None:
        """Finish what was handed over (at exit), then end the thread."""
        thread = self._thread
        if thread is not None and thread.is_alive():
            self._queue.put(None)
            thread.join(timeout)


_REAPER = _Reaper()
atexit.register(_REAPER.stop)


def reap(fn: Callable[[], None]) -> None:
    """Run ``fn`` on the reaper thread (soon, in submission order)."""
    _REAPER.submit(fn)


def flush(timeout: float = 10.0) -> bool:
    """Run what was handed to the reaper so far, now: see :meth:`_Reaper.flush`."""
    return _REAPER.flush(timeout)


def finalizer_for(close: Callable[[], None]) -> Callable[[], None]:
    """What a finalizer runs: ``close`` on the reaper thread, and only in the process
    that made it (a forked child's copy tears down nothing)."""
    pid = os.getpid()

    def finalize() -> None:
        if os.getpid() == pid:
            reap(close)

    return finalize
