"""Joining (or starting) the Ray cluster, once per process."""

from __future__ import annotations

import functools
import os
import socket
import threading
import urllib.parse
from typing import Any, NamedTuple

import ray

from dpex.errors import RayConnectionError

__all__ = ["JobView", "connect_ray", "join_on_first_call", "load_ray_handle",
           "ray_handle_reducer", "worker_job_view"]

_lock = threading.Lock()
_REACH_TIMEOUT_S = 10.0


def _check_reachable(address: str, named: str) -> None:
    """Fail fast, naming the address, when nothing listens at ``host:port``."""
    target = address.split("://", 1)[-1]
    parsed = urllib.parse.urlsplit(f"//{target}")
    if not parsed.hostname or not parsed.port:
        return  # not host:port (e.g. a session dir): let Ray judge it
    try:
        with socket.create_connection((parsed.hostname, parsed.port), timeout=_REACH_TIMEOUT_S):
            pass
    except OSError as exc:
        raise RayConnectionError(
            f"cannot reach the Ray cluster at {named}: {exc}"
        ) from None


def connect_ray(head_address: str = "auto") -> None:
    """Make sure this process is connected to Ray.

    Reuses an existing connection (``ray.is_initialized()``). ``"auto"`` joins the
    cluster named by ``$RAY_ADDRESS`` (which must then be reachable), else a cluster
    started on this machine with ``ray start``, else starts a Ray instance of this
    process's own (the embedded default, see :func:`_start_embedded`). Any other
    address must be reachable, or :class:`~dpex.errors.RayConnectionError` names it.
    """
    with _lock:
        if ray.is_initialized():
            return
        if head_address in ("auto", "", None):
            explicit = os.environ.get("RAY_ADDRESS", "")
            if explicit and explicit != "auto":
                # The user named a cluster: join it or say why, never start another.
                _join(explicit, f"RAY_ADDRESS={explicit!r}")
                return
            started = _started_cluster()
            if started is not None:
                _join(started, f"the cluster that `ray start` runs on this machine ({started})")
                return
            _start_embedded()
            return
        _join(head_address, f"head_address={head_address!r}")


def _started_cluster() -> str | None:
    """The address of a live cluster that ``ray start`` runs on this machine, if any.

    Only ``ray start`` records its cluster (in Ray's ``ray_current_cluster`` file); a
    Ray instance that another script started with ``ray.init()`` is not recorded, and
    joining it would tie this process's workers to that script's lifetime.
    """
    try:
        from ray._private.services import find_bootstrap_address
    except ImportError:  # a Ray that moved it: no shared cluster is found, never a wrong one
        return None
    try:
        address = find_bootstrap_address(None)
    except OSError:
        return None
    if not address:
        return None
    try:
        _check_reachable(address, address)
    except RayConnectionError:
        return None  # stale: that cluster was stopped without `ray stop`
    return address


def _start_embedded() -> None:
    """Start a Ray instance that belongs to this process alone (the embedded default).

    No other process joins it (``ray start`` alone records a cluster for others to
    find) and it ends with this process. So ranks that start together (``torchrun``,
    ``mp.spawn``) or a second script each get their own, and one that exits early
    takes no one else's workers with it. Workers reserve no CPUs by default, so the
    instance's size never limits them.
    """
    # Ray lowers its workers' priority to niceness 15 by default; dpex's workers are
    # the trainer's data workers, as torch's forked ones (which keep its niceness).
    ray.init(address="local", include_dashboard=False, _system_config={"worker_niceness": 0})


def _join(address: str, named: str) -> None:
    _check_reachable(address, named)
    try:
        ray.init(address=address)
    except Exception as exc:
        hint = ""
        if not any(k.startswith("RAY_AUTH") for k in os.environ):
            hint = (" (if the cluster uses token authentication, which Ray >= 2.59 turns on "
                    "for clusters started on this machine, give this process the same "
                    "RAY_AUTH_MODE=token and RAY_AUTH_TOKEN as the cluster)")
        raise RayConnectionError(
            f"cannot join the Ray cluster at {named}: {exc}{hint}") from exc


def ray_handle_reducer(obj: object) -> tuple | None:
    """How dpex ships a Ray actor handle (or, where Ray lacks in-band pickling, an
    object ref) inside a dataset: pickled by Ray itself (with its owner, so a worker can
    use it; what it names is then kept for as long as its owner lives, Ray's rule for
    handles pickled out of band), restored by :func:`load_ray_handle`. Object refs
    normally travel in band (``client/_shipping.py``), so Ray counts their borrow.
    None for anything else."""
    if not isinstance(obj, (ray.ObjectRef, ray.actor.ActorHandle)):
        return None
    return load_ray_handle, (ray.cloudpickle.dumps(obj),)


def load_ray_handle(data: bytes) -> object:
    """A shipped object ref or actor handle, in a worker: in a session's own process
    (warm workers, fleets) Ray is not connected yet, and joins the worker's cluster
    (``RAY_ADDRESS``) first, as :func:`join_on_first_call` set it up."""
    if not ray.is_initialized():
        address = os.environ.get("RAY_ADDRESS")
        if not address:
            raise RayConnectionError("a Ray object ref or actor handle reached a process "
                                     "that knows no Ray cluster (RAY_ADDRESS is not set)")
        with _lock:
            if not ray.is_initialized():
                ray.init(address=address, logging_level="ERROR", log_to_driver=False)
    return ray.cloudpickle.loads(data)


class JobView(NamedTuple):
    """What a Ray connection of a session's own process is made of, so that its Ray
    calls see what they would see in the worker that forked it: the cluster (``address``,
    the GCS), the job's ``namespace`` (named actors are looked up there) and the worker's
    ``runtime_env`` (which the tasks and actors it starts inherit). None: Ray's default
    (a namespace of its own, no runtime_env)."""

    address: str
    namespace: str | None = None
    runtime_env: dict | None = None


def worker_job_view(own_job: bool = True) -> JobView | None:
    """This Ray worker's view (None outside one: a test's direct instance). ``own_job``
    False: the cluster alone (a fleet worker's sessions serve other jobs' trainers)."""
    try:
        ctx = ray.get_runtime_context()
        address = ctx.gcs_address
    except Exception:  # noqa: BLE001 - not in a Ray worker
        return None
    if not own_job:
        return JobView(address)
    runtime_env = dict(ctx.runtime_env or {})
    return JobView(address, ctx.namespace, runtime_env or None)


def join_on_first_call(view: JobView) -> None:
    """In a session's own process, not connected to Ray (its forkserver never was):
    make its first Ray connection join ``view``. That connection is a new Ray job (a
    process joins as a driver), made by the first Ray call of the dataset's code (Ray's
    automatic ``ray.init()``), by an explicit ``ray.init()`` there, or by a shipped
    handle (:func:`load_ray_handle`); each goes through ``ray.init``, which takes the
    view's namespace and runtime_env unless its caller names its own. Ray reads no
    namespace from the environment outside Ray Client, hence the wrapper; connecting
    at once instead would cost every session ~0.3 s and Ray's threads."""
    os.environ["RAY_ADDRESS"] = view.address
    original = ray.init

    @functools.wraps(original)
    def init(*args: Any, **kwargs: Any) -> Any:
        if view.namespace is not None:
            kwargs.setdefault("namespace", view.namespace)
        if view.runtime_env:
            kwargs.setdefault("runtime_env", view.runtime_env)
        return original(*args, **kwargs)

    ray.init = init
