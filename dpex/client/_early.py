"""What a loader's construction starts for its first iterator: Ray (joined, or the
embedded default started) and then the worker hosts, on one background thread, so
that the constructor returns at once and the start runs beside the trainer's own
set-up (its model, its optimizer) and the dataset's pickling at ``iter()``.

``iter()`` waits for that start (:meth:`EarlyStart.wait`) before it connects; a start
that failed is raised there, as the iterator's own connection would have raised it.

The thread that started Ray lives as long as Ray is connected: Ray's own processes
(the embedded default's GCS, raylet, ...) are started with ``PR_SET_PDEATHSIG``, which
the kernel fires when the *thread* that started them ends, not the process. It waits
for the next loader's start meanwhile, and ends once ``ray.shutdown()`` ran.
Call ``ray.init()`` before building a loader to give Ray options of your own: built
first, the loader has already joined or started Ray (README, "Example").
"""

from __future__ import annotations

import logging
import os
import signal
import sys
import threading
from collections.abc import Callable
from typing import Any

from dpex._start_trace import mark

logger = logging.getLogger("dpex")

__all__ = ["EARLY", "EARLY_START", "EarlyStart", "ray_connected"]

EARLY_START = "DPEX_EARLY_START"  # "0": nothing starts before iter()

# Ray says so when ray.init() runs off the main thread; dpex sets the same handler
# itself (see EarlyStart.begin), so the warning would only mislead.
_RAY_SIGTERM_WARNING = "SIGTERM handler is not set"


class _DropSigtermWarning(logging.Filter):
    def filter(self, record: logging.LogRecord) -> bool:
        return not str(record.msg).startswith(_RAY_SIGTERM_WARNING)


def _exit_on_sigterm(signum: int, frame: Any) -> None:
    sys.exit(signum)  # (as ray.init() sets it on the main thread: atexit ends Ray)


_PARK_S = 1.0  # how often a parked start thread looks whether Ray was shut down


class EarlyStart:
    """This process's background start: one thread at a time, which connects to Ray and
    then runs what loaders built meanwhile asked for (their hosts), in order."""

    def __init__(self, connect: Callable[[str], None], initialized: Callable[[], bool],
                 park_s: float = _PARK_S, shutdown: Callable[[], None] | None = None) -> None:
        self._connect, self._initialized, self._park_s = connect, initialized, park_s
        self._shutdown = shutdown or _shutdown
        self._lock = threading.Condition()
        self._pending: list[tuple[str, Callable[[], None]]] = []
        self._thread: threading.Thread | None = None
        self._failed: dict[str, BaseException] = {}  # by head address, raised at iter()
        self._started_ray = False  # whether the thread connected this process to Ray
        self._waited = False  # whether an iterator of this process waited for the start
        self._drop_ray = False  # handed off: the Ray it connected is let go (handed_off)
        self._dropping = False  # (an iterator's connect waits until it is)

    def begin(self, head_address: str, then: Callable[[], None]) -> None:
        """Connect to ``head_address`` (unless Ray is connected) and then run ``then``,
        in the background (Ray's first actor start in a process takes ~0.3 s: not the
        constructor's); never raises. ``DPEX_EARLY_START=0``: nothing starts before
        ``iter()`` (a launcher that builds loaders only to hand them to the ranks it
        spawns, which start their own)."""
        if os.environ.get(EARLY_START, "1") == "0":
            return
        if not self._initialized() and threading.current_thread() is threading.main_thread():
            try:  # what ray.init() does on the main thread, which this start is not on
                if signal.getsignal(signal.SIGTERM) is signal.SIG_DFL:
                    signal.signal(signal.SIGTERM, _exit_on_sigterm)
            except (ValueError, OSError):
                pass
        with self._lock:
            self._pending.append((head_address, then))
            self._drop_ray = False  # (a loader built after a hand-off: this one may iterate)
            self._lock.notify()
            if self._thread is None:
                self._thread = threading.Thread(target=self._run, name="dpex-early-start",
                                                daemon=True)
                self._thread.start()

    def handed_off(self) -> None:
        """This process's loaders were pickled into processes it spawns (``mp.spawn``,
        Lightning's ``ddp_spawn``), which start their own: unless an iterator of this
        process waited for the start, the hosts not started yet are not, and the Ray the
        start connected is shut down once up (a launcher that only hands its loaders
        on keeps no embedded Ray and no hosts). A loader built later starts again."""
        with self._lock:
            if self._waited or (self._thread is None and not self._pending):
                return
            self._pending = [(head, _nothing) for head, _ in self._pending]
            self._drop_ray = True
            self._lock.notify_all()
        mark("handed off")

    def _run(self) -> None:
        while True:
            with self._lock:
                # Parked while the Ray it connected runs (see the module's docstring);
                # new work wakes it.
                while not self._pending and self._started_ray and self._initialized() \
                        and not self._drop_ray:
                    self._lock.wait(self._park_s)
                drop = not self._pending and self._drop_ray and self._started_ray
                if not self._pending:
                    self._drop_ray, self._dropping = False, drop
                    if not drop:
                        self._thread, self._started_ray = None, False
                        return
                head_address = self._pending[0][0] if self._pending else ""
            if drop:
                _quietly(self._shutdown)  # (then parked no more: Ray is not connected)
                with self._lock:
                    self._dropping = False
                    self._lock.notify_all()
                continue
            if self._joined(head_address):
                with self._lock:
                    then = self._pending[0][1]  # (a hand-off meanwhile made it nothing)
                _quietly(then)
            with self._lock:
                self._pending.pop(0)
                self._lock.notify_all()

    def _joined(self, head_address: str) -> bool:
        if self._initialized():
            return True
        ray_logger = logging.getLogger("ray._private.worker")
        quiet = _DropSigtermWarning()
        ray_logger.addFilter(quiet)
        try:
            mark("ray start")
            self._connect(head_address)
            mark("ray up")
            with self._lock:
                self._started_ray = True
            return True
        except BaseException as exc:  # (raised at iter(), where it would have been)
            logger.debug("dpex: the early start of Ray failed", exc_info=True)
            with self._lock:
                self._failed[head_address] = exc
            return False
        finally:
            ray_logger.removeFilter(quiet)

    def wait(self, head_address: str, timeout: float) -> None:
        """Until what loaders asked for so far is done (at most ``timeout`` s); raise
        what the start met connecting to ``head_address``, if Ray is still not
        connected."""
        with self._lock:
            self._waited = True
            self._drop_ray = False
            self._lock.wait_for(lambda: not self._pending and not self._dropping, timeout)
            failed = self._failed.pop(head_address, None)
        if failed is not None and not self._initialized():
            raise failed


def _quietly(then: Callable[[], None]) -> None:
    try:
        then()
    except Exception:  # only an early start: the iterator starts its hosts itself
        logger.debug("dpex: the early start's %s failed", getattr(then, "__name__", then),
                     exc_info=True)


def _nothing() -> None:
    pass


def _shutdown() -> None:
    import ray

    ray.shutdown()


def _connect(head_address: str) -> None:
    from dpex._ray_connect import connect_ray

    connect_ray(head_address)


def ray_connected() -> bool:
    """Whether this process is connected to Ray, without importing Ray: not imported, or
    still being imported on the start thread (a module partly made), is not connected."""
    is_initialized = getattr(sys.modules.get("ray"), "is_initialized", None)
    return is_initialized is not None and is_initialized()


EARLY = EarlyStart(_connect, ray_connected)
