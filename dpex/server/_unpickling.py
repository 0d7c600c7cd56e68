"""What unpickling a shipped loader did: whether it ran code of the dataset's own, or
left a descriptor open.

A host's fork base unpickles a loader once and forks its workers from it
(:mod:`dpex.server._fork_base`). That is exact only where unpickling does nothing a
worker must do for itself: a ``__setstate__`` that reopens a file gives every fork one
open file description (one offset, shared: wrong records, no error), one that makes an
RNG from entropy gives every fork one stream, a connection opened there is shared by
processes that each think it is theirs. dpex promises what torch's ``spawn`` gives
(DESIGN.md, "Semantics to keep"): whatever unpickling does happens in each worker.

So the base watches its unpickling (:class:`UnpicklingWatch`):

- every Python function it calls, through ``sys.setprofile``: a function of the
  dataset's own code (anything outside the standard library and the packages that
  only rebuild data: torch, NumPy, cloudpickle, dpex) is *foreign*. A module's
  import-time code is not counted: the modules the pickle names are imported in the
  base once, as documented (``find_class`` runs with the watch paused);
- the descriptors it left open (a C extension's handle the profile cannot see).

Either one, and the base keeps only the shipment's bytes and its imports, and each
worker unpickles its own loader over them (the out-of-band buffers, tensors and
arrays, stay views of the base's pages: unpickling only rebuilds the small object
graph around them). Neither, and the base's unpickled loader is what every worker
forks with, which nothing can tell from unpickling it again.

The watch costs one Python call per Python function unpickling runs (torch's tensor
rebuilders, cloudpickle's class rebuilders: tens of microseconds in all); unpickling a
list of millions of strings runs none.

The host wing's processes, what each holds and when it ends: NOTE [ The worker
host's processes ] in :mod:`dpex.server._fork_base`.
"""

from __future__ import annotations

import os
import pickle
import sys
import sysconfig
from types import FrameType
from typing import Any

__all__ = ["UnpicklingWatch", "foreign_code"]

# Packages whose unpickling code only rebuilds data (no handle, no entropy, no thread).
_REBUILDERS = ("torch", "numpy", "cloudpickle", "dpex")


def _stdlib_roots() -> tuple[str, ...]:
    paths = sysconfig.get_paths()
    return tuple({os.path.join(os.path.realpath(paths[k]), "")
                  for k in ("stdlib", "platstdlib") if k in paths})


def _package_roots() -> tuple[str, ...]:
    roots = []
    for name in _REBUILDERS:
        module = sys.modules.get(name)
        file = getattr(module, "__file__", None)
        if isinstance(file, str):
            roots.append(os.path.join(os.path.dirname(os.path.realpath(file)), ""))
    return tuple(roots)


class _Trust:
    """Which source files are trusted to only rebuild data, cached per file name."""

    def __init__(self) -> None:
        self._stdlib = _stdlib_roots()
        self._packages = _package_roots()
        self._known: dict[str, bool] = {}

    def __call__(self, filename: str) -> bool:
        known = self._known.get(filename)
        if known is None:
            known = self._known[filename] = self._judge(filename)
        return known

    def _judge(self, filename: str) -> bool:
        # The import machinery, and what the standard library makes with exec (a
        # namedtuple's __new__). Not cloudpickle's "<dynamic-code>": the training
        # script's own functions and classes, shipped by value.
        if filename.startswith("<frozen ") or filename == "<string>":
            return True
        path = os.path.realpath(filename)
        if path.startswith(self._packages):
            return True
        if not path.startswith(self._stdlib):
            return False
        # (site-packages often lies under the standard library's directory)
        return "site-packages" not in path and "dist-packages" not in path


def foreign_code(frame: FrameType) -> str:
    """A function's name and place, as the log says it."""
    code = frame.f_code
    return f"{getattr(code, 'co_qualname', code.co_name)} ({code.co_filename}:{code.co_firstlineno})"


def _descriptors() -> set[int]:
    """This process's open descriptors (not the listing's own)."""
    try:
        listing = os.open("/proc/self/fd", os.O_RDONLY | os.O_DIRECTORY | os.O_CLOEXEC)
    except OSError:
        return set()
    try:
        return {int(name) for name in os.listdir(listing)} - {listing}
    finally:
        os.close(listing)


class UnpicklingWatch:
    """Watches one unpickling (``with watch: ...``) in the thread that runs it; use
    :attr:`unpickler` for it. Afterwards :attr:`foreign` names the first function of
    the dataset's own code that ran (None: none did) and :meth:`opened` the descriptors
    left open since the watch began."""

    def __init__(self) -> None:
        self.foreign: str | None = None
        self._trust = _Trust()
        self._before: set[int] = set()
        self._paused = 0
        watch = self

        class Unpickler(pickle.Unpickler):
            def find_class(self, module: str, name: str) -> Any:
                # Imports run here: a module's import-time code is the base's, once.
                watch._pause()
                try:
                    return super().find_class(module, name)
                finally:
                    watch._resume()

        self.unpickler: type[pickle.Unpickler] = Unpickler

    def _hook(self, frame: FrameType, event: str, arg: Any) -> None:
        if event == "call" and not self._trust(frame.f_code.co_filename):
            self.foreign = foreign_code(frame)
            sys.setprofile(None)  # one is enough: no more cost

    def _pause(self) -> None:
        self._paused += 1
        sys.setprofile(None)

    def _resume(self) -> None:
        self._paused -= 1
        if not self._paused and self.foreign is None:
            sys.setprofile(self._hook)

    def __enter__(self) -> UnpicklingWatch:
        self._before = _descriptors()
        sys.setprofile(self._hook)
        return self

    def __exit__(self, *exc: Any) -> None:
        sys.setprofile(None)

    def opened(self) -> list[str]:
        """The descriptors opened since the watch began and still open, as what they
        point to (collect garbage first: a dropped file closes then)."""
        opened = []
        for fd in sorted(_descriptors() - self._before):
            try:
                opened.append(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                continue  # (closed meanwhile, or the listing's own)
        return opened
