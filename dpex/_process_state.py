"""The trainer's process state that travels to its workers, as torch's workers inherit
it: the working directory, and the environment variables the trainer's program changed.

torch's workers are forks (or spawns) of the trainer at ``iter()``: they see its
directory and its whole environment. dpex's workers are Ray's processes, started with
the environment Ray had, on nodes that may be other machines. Shipping the trainer's
whole environment would overwrite what differs by node for good reasons (``PATH``,
``HOME``, library paths, the devices Ray gave the worker), so what travels is the
*difference*: each variable the trainer's program set, changed or removed since the
process started (its initial environment, ``/proc/self/environ``; where that cannot be
read, the environment when dpex was imported). Variables Ray sets per process
(``RAY_*``, ``PYTHONBREAKPOINT``, the accelerators it assigned) never travel.

Secrets stay back: a variable whose name looks like one (it contains ``TOKEN``,
``SECRET``, ``PASSWORD``, ``KEY`` or ``CREDENTIAL``, in any case: ``HF_TOKEN``, the
cloud keys, what ``load_dotenv()`` read) travels only if the trainer lists it in
``DPEX_SHIP_ENV`` (names, comma-separated). A fleet's workers (``worker_pool``) serve
other people's trainers too: they get no variables unless ``DPEX_SHIP_ENV`` is ``1`` or
a list. ``DPEX_SHIP_ENV=0`` ships no variables anywhere (the directory still travels).
Module globals never travel: see README, "What a worker sees".

Pure apart from reading the process's own state in :func:`capture`; the worker side
(applying and undoing it) is :mod:`dpex.server._trainer_state`. The state travels in
the shipment's header (:meth:`TrainerState.head`, :mod:`dpex._loader_pickle`), as
JSON: it must be applied before the dataset is unpickled, and it is never itself
unpickled.
"""

from __future__ import annotations

import os
from collections.abc import Mapping
from dataclasses import dataclass, field
from typing import Any

__all__ = ["TrainerState", "capture", "environment_changes", "initial_environment",
           "SHIP_ENV", "looks_secret", "shipped_variable"]

# "0": ship no environment variables; "1": ship them (to a fleet's workers too); a list
# of names (comma-separated): ship them, and those names even if they look like secrets.
SHIP_ENV = "DPEX_SHIP_ENV"
_SECRET_WORDS = ("TOKEN", "SECRET", "PASSWORD", "KEY", "CREDENTIAL")
# Set by Ray in each process (the driver's differ from a worker's), or the shell's
# bookkeeping of a directory that travels on its own.
_NEVER_PREFIXES = ("RAY_",)
_NEVER = frozenset({
    "PYTHONBREAKPOINT", "PWD", "OLDPWD",
    "CUDA_VISIBLE_DEVICES", "ROCR_VISIBLE_DEVICES", "HIP_VISIBLE_DEVICES",
    "NEURON_RT_VISIBLE_CORES", "TPU_VISIBLE_CHIPS", "ONEAPI_DEVICE_SELECTOR",
    "HABANA_VISIBLE_MODULES",
})


def shipped_variable(name: str) -> bool:
    """Whether a variable of this name may travel (Ray's per-process ones never do)."""
    return name not in _NEVER and not name.startswith(_NEVER_PREFIXES)


def looks_secret(name: str) -> bool:
    """Whether a variable's name looks like a secret's (``HF_TOKEN``, ``aws_secret_key``):
    it travels only if the trainer lists it in ``DPEX_SHIP_ENV``."""
    upper = name.upper()
    return any(word in upper for word in _SECRET_WORDS)


@dataclass(frozen=True)
class TrainerState:
    """The trainer's working directory and its environment changes, as of ``iter()``."""

    cwd: str | None = None
    set_env: Mapping[str, str] = field(default_factory=dict)  # name -> value
    unset_env: tuple[str, ...] = ()  # removed by the trainer since it started
    # Changed but kept back (secret-looking names; all, for a fleet by default): named in
    # the trainer's log, never shipped (not part of its head()).
    withheld: tuple[str, ...] = ()

    @property
    def empty(self) -> bool:
        return self.cwd is None and not self.set_env and not self.unset_env

    def head(self) -> dict:
        """What travels to the workers (JSON-ready; ``withheld`` never does): the same
        state gives the same dict, in the same order (the loader reuses a shipment by
        its digest)."""
        return {"cwd": self.cwd, "set": dict(self.set_env), "unset": list(self.unset_env)}

    @classmethod
    def from_head(cls, head: Mapping[str, Any]) -> TrainerState:
        """The state a worker was shipped (:meth:`head`'s inverse)."""
        return cls(cwd=head["cwd"], set_env=dict(head["set"]), unset_env=tuple(head["unset"]))


def _read_initial_environment() -> dict[str, str] | None:
    try:
        with open("/proc/self/environ", "rb") as f:
            raw = f.read()
    except OSError:
        return None
    env: dict[str, str] = {}
    for entry in raw.split(b"\0"):
        name, sep, value = entry.partition(b"=")
        if sep and name:
            env[os.fsdecode(name)] = os.fsdecode(value)
    return env


# Where /proc is not there (macOS): the environment when dpex was imported.
_AT_IMPORT = dict(os.environ)
_INITIAL = _read_initial_environment()


def initial_environment() -> dict[str, str]:
    """The environment this process started with (``/proc/self/environ``), or, where
    that cannot be read, the one it had when dpex was imported."""
    return dict(_INITIAL if _INITIAL is not None else _AT_IMPORT)


def environment_changes(now: Mapping[str, str], before: Mapping[str, str]
                        ) -> tuple[dict[str, str], tuple[str, ...]]:
    """What changed from ``before`` to ``now``: (set or changed, removed), leaving out
    the variables that never travel (:func:`shipped_variable`). Sorted, so the same
    changes give the same bytes (the loader reuses a shipped object by its digest)."""
    changed = {k: now[k] for k in sorted(now) if before.get(k) != now[k] and shipped_variable(k)}
    removed = tuple(k for k in sorted(before) if k not in now and shipped_variable(k))
    return changed, removed


def capture(environ: Mapping[str, str] | None = None, before: Mapping[str, str] | None = None,
            cwd: str | None = None, fleet: bool = False) -> TrainerState:
    """This process's state to give its workers (a fleet's: ``fleet``): its directory
    and what its program changed in the environment, less the secret-looking names it
    does not list in ``DPEX_SHIP_ENV``; nothing with ``DPEX_SHIP_ENV=0``, nor for a fleet
    unless ``DPEX_SHIP_ENV`` is ``1`` or a list."""
    environ = os.environ if environ is None else environ
    if cwd is None:
        try:
            cwd = os.getcwd()
        except OSError:  # the directory was removed under the trainer
            cwd = None
    choice = environ.get(SHIP_ENV, "").strip()
    if choice == "0":
        return TrainerState(cwd=cwd)
    changed, removed = environment_changes(
        environ, initial_environment() if before is None else before)
    if fleet and not choice:
        return TrainerState(cwd=cwd, withheld=tuple(sorted([*changed, *removed])))
    listed = {name.strip() for name in choice.split(",")}
    withheld = tuple(k for k in changed if looks_secret(k) and k not in listed)
    shipped = {k: v for k, v in changed.items() if k not in withheld}
    return TrainerState(cwd=cwd, set_env=shipped, unset_env=removed, withheld=withheld)
