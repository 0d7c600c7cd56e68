"""Pickling what the workers need, with an error that names what failed.

The host wing's processes, what each holds and when it ends: NOTE [ The worker
host's processes ] in :mod:`dpex.server._fork_base`.
"""

from __future__ import annotations

import contextlib
import io
import logging
import os
import re
import sys
import sysconfig
import threading
import types
from collections.abc import Iterable, Iterator
from typing import Any

import cloudpickle
import ray

from dpex._handles import describe, reduce_handle
from dpex._loader_pickle import PickleParts
from dpex._pickling import SHIPMENT, OutOfBandPickler
from dpex._process_state import SHIP_ENV, TrainerState, capture, looks_secret
from dpex._ray_connect import load_ray_handle, ray_handle_reducer
from dpex._spec import ShippedLoader
from dpex.errors import DatasetNotPicklableError

__all__ = ["ship_loader", "find_unpicklable", "installed_libraries"]


def _object_ref_in_band(ref: Any) -> tuple:
    """How a Ray object ref travels inside the pickled loader: pickled by Ray (with its
    owner; plain cloudpickle drops it, and a worker's ``ray.get`` would wait forever), as
    ``ray.put`` pickles a ref it stores ("in band"). Pickled plainly ("out of band"),
    Ray pins the object for the life of this process, as it cannot know who holds the
    bytes; here the caller keeps the ref and hands it to :class:`PickledLoader`, whose
    stored copy then holds the object for as long as it lives itself."""
    context = ray._private.worker.global_worker.get_serialization_context()
    if not hasattr(context, "set_in_band_serialization"):  # another Ray: its own rule
        return ray_handle_reducer(ref)
    context.set_in_band_serialization()
    try:
        data = ray.cloudpickle.dumps(ref)
    finally:
        context.set_out_of_band_serialization()
        context.get_and_clear_contained_object_refs()  # ours: the caller keeps the ref
    return load_ray_handle, (data,)


class _ShipPickler(OutOfBandPickler):
    """:mod:`dpex._pickling`'s pickler with the shipped loader's policy
    (:data:`~dpex._pickling.SHIPMENT`: large storages and arrays out of band, into
    ``buffers``), and Ray's object refs (pickled in band, collected in ``refs``) and
    actor handles (which Ray pickles)."""

    def __init__(self, file: io.BytesIO, refs: list, buffers: list,
                 modules: dict[str, None] | None = None) -> None:
        super().__init__(file, buffers, SHIPMENT)
        self.refs = refs
        self.modules = {} if modules is None else modules  # of the classes and functions
        self.reopened: list[Any] = []  # the handles each worker opens again (dpex._handles)

    def reducer_override(self, obj: Any) -> Any:
        kind = type(obj)
        if kind not in _ORDINARY:  # (most objects are: one set lookup each)
            reduced = self._special(obj, kind)
            if reduced is not None:
                return reduced
        return super().reducer_override(obj)

    def _special(self, obj: Any, kind: type) -> tuple | None:
        """A Ray ref or handle, an open handle (dpex._handles), or a class or function
        (whose module is noted); else None, and ``kind`` is ordinary from now on."""
        if isinstance(obj, (type, types.FunctionType, types.BuiltinFunctionType)):
            self.modules[getattr(obj, "__module__", None) or ""] = None
            return None
        if isinstance(obj, ray.ObjectRef):
            self.refs.append(obj)
            return _object_ref_in_band(obj)
        reduced = ray_handle_reducer(obj)
        if reduced is None:
            reduced = reduce_handle(obj)  # (HandleRefused: the error names the attribute)
            if reduced is not None:
                self.reopened.append(obj)
            else:
                _ORDINARY.add(kind)  # (an h5py or LMDB type only exists once imported)
        return reduced


# Types whose objects the shipment's pickler leaves to cloudpickle (none of them a Ray
# ref or handle, an open handle, a class or a function): judged once per type.
_ORDINARY: set[type] = set()


def _dumps(obj: Any, refs: list | None = None, buffers: list | None = None,
           modules: dict[str, None] | None = None, reopened: list | None = None) -> bytes:
    """``obj`` pickled for a worker; the object refs in it are appended to ``refs``,
    its large buffers (out of band) to ``buffers``, the modules of its classes and
    functions to ``modules``, the handles each worker opens again to ``reopened``."""
    buf = io.BytesIO()
    pickler = _ShipPickler(buf, [] if refs is None else refs,
                           [] if buffers is None else buffers, modules)
    pickler.dump(obj)
    if reopened is not None:
        reopened.extend(pickler.reopened)
    return buf.getvalue()


# Imported by every host's forkserver (with what they import): no library base for them.
_EVERY_FORKSERVER_HAS = frozenset({"torch", "numpy", "ray", "zmq", "cloudpickle", "dpex"})


def installed_libraries(modules: Iterable[str]) -> tuple[str, ...]:
    """The modules among ``modules`` a host imports in its *library base* before it
    forks the dataset's base from it (docs/WARM_WORKERS.md): those of installed
    libraries (site-packages: Lightning's ``worker_init_fn``, transformers' tokenizer
    classes), not the standard library (quick to import), the user's own code or
    ``__main__``, nor what every forkserver has imported."""
    paths = sysconfig.get_paths()
    roots = tuple({os.path.join(os.path.realpath(paths[k]), "")
                   for k in ("purelib", "platlib") if k in paths})
    found = []
    for name in modules:
        if not name or name.partition(".")[0] in _EVERY_FORKSERVER_HAS:
            continue
        file = getattr(sys.modules.get(name), "__file__", None)
        if isinstance(file, str) and os.path.realpath(file).startswith(roots):
            found.append(name)
    return tuple(found)


_MAX_DEPTH = 6
_logger = logging.getLogger("dpex")


def _children(obj: Any) -> list[tuple[str, Any]]:
    if isinstance(obj, dict):
        return [(f"[{k!r}]", v) for k, v in obj.items()]
    if isinstance(obj, (list, tuple, set, frozenset)):
        return [(f"[{i}]", v) for i, v in enumerate(obj)]
    state = getattr(obj, "__dict__", None)
    if isinstance(state, dict):
        return [(f".{k}", v) for k, v in state.items()]
    return []


def find_unpicklable(obj: Any, path: str, depth: int = 0) -> tuple[str, BaseException] | None:
    """The deepest attribute path under ``obj`` that fails to pickle, with its error."""
    try:
        _dumps(obj)
        return None
    except Exception as exc:
        error = exc
    if depth < _MAX_DEPTH:
        for suffix, child in _children(obj):
            found = find_unpicklable(child, path + suffix, depth + 1)
            if found is not None:
                return found
    return path, error


_registry_lock = threading.Lock()


@contextlib.contextmanager
def _spawned_script_by_value() -> Iterator[None]:
    """What the user's script defines travels by value, as cloudpickle does for
    ``__main__``, also in a process that ``mp.spawn`` or Lightning's ``ddp_spawn``
    started: there the script is the module ``__mp_main__``, which cloudpickle would
    pickle by reference and no Ray worker can import."""
    script = sys.modules.get("__mp_main__")
    with _registry_lock:
        if script is None or script.__name__ != "__mp_main__" or \
                script.__name__ in cloudpickle.list_registry_pickle_by_value():
            yield
            return
        cloudpickle.register_pickle_by_value(script)
        try:
            yield
        finally:
            cloudpickle.unregister_pickle_by_value(script)


# What cannot be pickled because it is a live handle on something of this process: an
# open file, a database connection, a socket, a lock, a thread, an h5py/zarr store.
_HANDLE_FIX = (
    " (dpex opens read-only files, sqlite3 databases, h5py files and LMDB environments "
    "again in each worker itself: docs/INTEGRATIONS.md.) If it is another open handle (a "
    "file open for writing, a database connection, a socket, a lock), do as "
    "for torch's workers under the 'spawn' start method: drop it in the class's "
    "__getstate__ (state = self.__dict__.copy(); state['{attr}'] = None; return state) "
    "and open it again in __setstate__, or open it lazily on first use in the worker "
    "(in __getitem__ / __iter__, or in a worker_init_fn)")


_said: set[tuple] = set()  # the environment names this process has logged
_said_lock = threading.Lock()


def _say_environment(state: TrainerState) -> None:
    """Log which variables travel to the workers and which stay back: their names,
    never their values; once per process for each set of names."""
    names = (tuple(state.set_env), state.unset_env, state.withheld)
    with _said_lock:
        if not any(names) or names in _said:
            return
        _said.add(names)
    listed = "; ".join(f"{how} {', '.join(some)}" for how, some in (
        ("set", names[0]), ("removed", names[1])) if some) or "none"
    message = f"dpex ships the trainer's environment changes to its workers: {listed}"
    if state.withheld:
        why = (f"names that look like secrets travel only if {SHIP_ENV} lists them"
               if all(map(looks_secret, state.withheld)) else
               f"a fleet's workers get them only with {SHIP_ENV}=1 or a list of names")
        message += f"; kept back ({why}): {', '.join(state.withheld)}"
    _logger.log(logging.WARNING if state.withheld else logging.INFO, message)


def _handle_paths(obj: Any, path: str, wanted: dict[int, Any], found: dict[int, str],
                  depth: int = 0) -> None:
    """Where under ``obj`` (``path``) the objects of ``wanted`` (by id) are: the first
    path to each, at most :data:`_MAX_DEPTH` attributes or items deep."""
    if id(obj) in wanted:
        found.setdefault(id(obj), path)
        return
    if depth < _MAX_DEPTH and len(found) < len(wanted):
        for suffix, child in _children(obj)[:1000]:
            _handle_paths(child, path + suffix, wanted, found, depth + 1)


def _say_reopened(contents: ShippedLoader, reopened: list[Any]) -> None:
    """Log, once per process for each set, which attributes each worker opens again."""
    wanted = {id(h): h for h in reopened}
    found: dict[int, str] = {}
    for name in ("dataset", "collate_fn", "worker_init_fn"):
        _handle_paths(getattr(contents, name), name, wanted, found)
    said = tuple(f"{found.get(key, '(an attribute)')} ({describe(handle)})"
                 for key, handle in wanted.items())
    with _said_lock:
        if said in _said:
            return
        _said.add(said)
    _logger.info("dpex opens these handles again in each worker, each its own: %s",
                 "; ".join(said))


def ship_loader(contents: ShippedLoader, state: TrainerState | None = None, *,
                fleet: bool = False) -> PickleParts:
    """Cloudpickle ``contents``, with this process's state (``state``, else captured now:
    at ``iter()``, for a fleet's workers if ``fleet``) in front for the workers to apply
    before they unpickle it, its large buffers out of band, and the object refs it holds
    beside, for Ray to count (a :class:`~dpex._loader_pickle.PickleParts`); raise :class:`DatasetNotPicklableError` naming the culprit
    and how to make it travel. The variable names that travel are logged once."""
    refs: list = []
    buffers: list = []
    modules: dict[str, None] = {}
    reopened: list[Any] = []
    try:
        with _spawned_script_by_value():
            loader_bytes = _dumps(contents, refs, buffers, modules, reopened)
    except Exception as exc:
        for name in ("dataset", "collate_fn", "worker_init_fn"):
            obj = getattr(contents, name)
            found = find_unpicklable(obj, name)
            if found is not None:
                path, error = found
                below = re.match(r"[^.\[]+\.([A-Za-z_]\w*)", path)  # dataset.<attr>...
                attr = below.group(1) if below else "<the attribute>"
                raise DatasetNotPicklableError(
                    f"the {name} ({type(obj).__module__}.{type(obj).__qualname__}) cannot be "
                    f"sent to the dpex workers: {path} cannot be pickled "
                    f"({type(error).__name__}: {error})." + _HANDLE_FIX.format(attr=attr)
                ) from exc
        raise DatasetNotPicklableError(f"cannot pickle the loader for the workers: {exc}") from exc
    state = capture(fleet=fleet) if state is None else state
    _say_environment(state)
    if reopened:
        _say_reopened(contents, reopened)
    return PickleParts.framed(loader_bytes, buffers, refs=refs, trainer=state.head(),
                              libraries=installed_libraries(modules))
