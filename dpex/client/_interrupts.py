"""Ctrl-C inside ``next()``: held while the epoch's bookkeeping runs, raised where the
epoch is whole (issue 48, docs/FAULTS_AND_SECURITY.md, "Ctrl-C").

Python raises KeyboardInterrupt at whatever bytecode the main thread runs when SIGINT
comes. Inside ``next()`` that can be between two steps that belong together: a
result recorded as received and not yet buffered (the epoch then waits for a batch
nobody holds), a batch popped from the ordering buffer and not yet returned (lost),
half of a multipart message written to the ROUTER (glued to the next). So while the
training thread runs dpex's bookkeeping (a :class:`held` section), SIGINT is only
remembered, and it is raised:

- at once, inside the waits (:class:`interruptible`: nothing is half done while the
  thread blocks), where ``next()`` spends most of its time;
- when the section ends with an exception (a worker's error, the end of the epoch):
  the interrupt replaces it (chained);
- when the section ends by returning a batch: as the next section starts (the loop's
  next ``next()``), so the batch is not lost; the loop runs one more step first.

How: the first section wraps SIGINT's Python handler (once, and again whenever
someone has installed another: a notebook kernel does per cell) in :func:`_handler`,
which calls the wrapped one at once outside a section: outside ``next()`` Ctrl-C
behaves as without dpex. A section is a counter, no system call. Leaving the section
is its last store (``depth = 0``), followed by no call, so CPython's next check for
signals is in the caller, which then holds the batch.

Only the main thread receives signals: elsewhere, and where SIGINT's handler is not
a Python callable (ignored, or the default action), sections change nothing.
"""

from __future__ import annotations

import _signal  # signal's C half: signal.getsignal converts to an enum, ~3 µs here
import signal
import threading
from typing import Any

__all__ = ["held", "interruptible"]


class _State:
    depth = 0  # held sections entered on the main thread (nested ones only count)
    open = False  # inside a wait of the outermost one (interruptible)
    wrapped: Any = None  # SIGINT's handler as it was (what _handler calls)
    pending: tuple[int, Any] | None = None  # (signum, frame) held back


_STATE = _State()


def _handler(signum: int, frame: Any) -> None:
    if _STATE.depth and not _STATE.open:
        _STATE.pending = (signum, frame)
        return
    _STATE.wrapped(signum, frame)


def _deliver() -> None:
    """Run the wrapped handler for the interrupt held back, if there is one (it raises
    KeyboardInterrupt, as the default handler does)."""
    pending, _STATE.pending = _STATE.pending, None
    if pending is not None:
        _STATE.wrapped(*pending)


def _main_thread() -> bool:
    return threading.get_ident() == threading.main_thread().ident


class held:  # noqa: N801 - a context manager, named as the functions of contextlib
    """A section of dpex's bookkeeping on the training thread: SIGINT held back (see the
    module's docstring). ``keep_on_return``: the section returns what the caller must not
    lose (a batch), so an interrupt that came during it is raised as the next section
    starts; otherwise as this one ends."""

    __slots__ = ("keep", "role")

    def __init__(self, keep_on_return: bool = False) -> None:
        self.keep = keep_on_return
        self.role = ""

    def __enter__(self) -> None:
        if not _main_thread():
            return
        if _STATE.depth:
            self.role = "nested"
            _STATE.depth += 1
            return
        current = _signal.getsignal(signal.SIGINT)
        if current is not _handler:
            if not callable(current):
                return
            _STATE.wrapped = current
            signal.signal(signal.SIGINT, _handler)
        _deliver()  # held back as the last section returned a batch: raised here
        self.role = "outer"
        _STATE.depth = 1

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.role == "nested":
            _STATE.depth -= 1
        elif self.role == "outer":
            if _STATE.pending is not None and (exc_type is not None or not self.keep):
                _STATE.depth = 0
                _deliver()
            _STATE.depth = 0  # (the last store: see the module's docstring)


class interruptible:  # noqa: N801
    """Inside a held section, a wait: SIGINT raised at once again (one held back so
    far is raised as the wait starts)."""

    __slots__ = ("on",)

    def __enter__(self) -> None:
        self.on = bool(_STATE.depth) and _main_thread()
        if self.on:
            _deliver()
            _STATE.open = True

    def __exit__(self, exc_type: Any, exc: Any, tb: Any) -> None:
        if self.on:
            _STATE.open = False
