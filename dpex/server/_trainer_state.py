"""Giving a session the trainer's working directory and environment changes (see
:mod:`dpex._process_state`), and taking them back when it ends.

A directory and an environment belong to a process, so this is process-wide state:
a session applies its trainer's before its dataset is unpickled
(:func:`enter_trainer_state`, from ``TaskRunner``'s load) and undoes it when it ends
(:func:`leave_trainer_state`, from the actor's session), so a worker kept warm for
another iterator (or serving a fleet's sessions) starts each session from its node's
own state. A process serves one session at a time in itself (a warm worker's or a
fleet's further sessions run in processes of their own, forked from its forkserver).

What was there before is also written into the environment (``DPEX_ENV_BEFORE_TRAINER``,
JSON): a process started while a session's state was applied (the forkserver, started
on a thread as the first session begins) inherits it, and the sessions forked from it
undo it first, so nothing of one trainer's state stays for the next.
"""

from __future__ import annotations

import json
import logging
import os
import threading
from collections.abc import Callable, MutableMapping

from dpex._process_state import TrainerState

__all__ = ["AppliedState", "apply_state", "enter_trainer_state", "leave_trainer_state",
           "BEFORE_ENV"]

logger = logging.getLogger("dpex")

BEFORE_ENV = "DPEX_ENV_BEFORE_TRAINER"
_logged_missing: set[str] = set()  # directories said missing once already (per process)


class AppliedState:
    """A trainer's state applied to one process; :meth:`undo` puts back what was there
    (each variable's value or absence, and the directory, if it still exists)."""

    def __init__(self, before_env: dict[str, str | None], before_cwd: str | None,
                 environ: MutableMapping[str, str], chdir: Callable[[str], None]) -> None:
        self.before_env = before_env
        self.before_cwd = before_cwd
        self._environ = environ
        self._chdir = chdir
        self._undone = False

    def undo(self) -> None:
        if self._undone:
            return
        self._undone = True
        _put_back(self._environ, self.before_env)
        self._environ.pop(BEFORE_ENV, None)
        if self.before_cwd is not None and os.path.isdir(self.before_cwd):
            self._chdir(self.before_cwd)


def _put_back(environ: MutableMapping[str, str], before: dict[str, str | None]) -> None:
    for name, value in before.items():
        if value is None:
            environ.pop(name, None)
        else:
            environ[name] = value


def apply_state(state: TrainerState, environ: MutableMapping[str, str] | None = None,
                chdir: Callable[[str], None] = os.chdir,
                getcwd: Callable[[], str] = os.getcwd) -> AppliedState:
    """Apply ``state``: first undo a state this process inherited (``BEFORE_ENV``), then
    set and remove the trainer's variables and enter its directory where it exists on
    this node (else keep this one and log it once per directory)."""
    environ = os.environ if environ is None else environ
    inherited = environ.pop(BEFORE_ENV, None)
    if inherited is not None:
        try:
            _put_back(environ, json.loads(inherited))
        except (ValueError, AttributeError, TypeError):
            pass  # not ours to read: leave the environment as it is
    before_env: dict[str, str | None] = {}
    for name, value in state.set_env.items():
        before_env[name] = environ.get(name)
        environ[name] = value
    for name in state.unset_env:
        if name in environ:
            before_env[name] = environ.pop(name)
    if before_env:
        environ[BEFORE_ENV] = json.dumps(before_env)
    try:
        before_cwd: str | None = getcwd()
    except OSError:
        before_cwd = None
    if state.cwd is not None and state.cwd != before_cwd:
        try:
            chdir(state.cwd)
        except OSError as exc:  # not on this node (another machine), or not ours to enter
            if state.cwd not in _logged_missing:
                _logged_missing.add(state.cwd)
                logger.warning(
                    "dpex worker (pid %d): cannot enter the trainer's working directory "
                    "on this node (%s); the dataset's relative paths are taken from %s "
                    "instead", os.getpid(), exc, before_cwd)
    return AppliedState(before_env, before_cwd, environ, chdir)


_lock = threading.Lock()
_applied: AppliedState | None = None  # this process's session's, until it ends


def enter_trainer_state(state: TrainerState | None) -> None:
    """Apply the trainer's ``state`` (carried in the shipment's header:
    :func:`dpex._loader_pickle.loads` hands it here) to this process, undoing a previous
    session's, if one was left; None (bytes that carried none) changes nothing."""
    global _applied
    if state is None:
        return
    with _lock:
        if _applied is not None:
            _applied.undo()
        _applied = apply_state(state)


def leave_trainer_state() -> None:
    """Undo what :func:`enter_trainer_state` applied (idempotent)."""
    global _applied
    with _lock:
        if _applied is not None:
            _applied.undo()
            _applied = None
