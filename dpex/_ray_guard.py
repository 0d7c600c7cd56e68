"""Ray calls for dpex's background threads and exit hooks: they never start Ray.

Ray's public API (``ray.get``, ``wait``, ``kill``, ``cancel``, an actor method's
``.remote``) calls ``ray.init()`` first when the process is not connected. After the
user's ``ray.shutdown()``, such a call from the warm pool's thread, the reaper thread
or an exit hook started a new local Ray inside the user's process (at exit too, where
nothing shuts it down again: its agents were left orphaned). Code that runs on its
own, after the user may have shut Ray down, calls Ray through here instead:

- each call checks :func:`ray_up` first and raises :class:`RayDown` rather than call;
- ``get``, ``wait``, ``kill`` and ``cancel`` call Ray's function without its
  automatic ``ray.init()`` (Ray's wrapper is stripped), so a shutdown that lands
  between the check and the call raises there instead of starting Ray. An actor
  method's ``.remote`` keeps Ray's wrapper: between the check and its own check
  lie a few microseconds.

The training thread's own calls (``iter()``, ``next()``) keep Ray's behaviour: there
the user is present, and dpex connects first anyway (``connect_ray``).
"""

from __future__ import annotations

from collections.abc import Callable
from typing import Any

import ray

__all__ = ["RayDown", "actor_id", "ray_up", "job_id", "get", "wait", "kill", "cancel", "call"]


class RayDown(RuntimeError):
    """Ray is not connected (the user shut it down): the call would have started it."""


def actor_id(actor: Any) -> str:
    """An actor handle's id (hex): the one reader of Ray's private ``_actor_id``, which
    a handle has from its creation, so no call is made."""
    return actor._actor_id.hex()


def ray_up() -> bool:
    """Whether this process is connected to Ray now."""
    return ray.is_initialized()


def _no_autostart(fn: Callable) -> Callable:
    """Ray's API function without its automatic ``ray.init()`` (``auto_init_wrapper``,
    a ``functools.wraps`` wrapper); any other function as it is."""
    code = getattr(fn, "__code__", None)
    if code is not None and code.co_name == "auto_init_wrapper":
        return getattr(fn, "__wrapped__", fn)
    return fn


def _checked(name: str) -> Callable:
    """The API function ``ray.<name>`` (looked up at each call: tests stub it)."""
    if not ray_up():
        raise RayDown(f"ray.{name}() after ray.shutdown()")
    return _no_autostart(getattr(ray, name))


def job_id() -> str:
    """This driver's job id: a new one for each ``ray.init()``, so it tells actors of
    an earlier (shut down) connection from this one's."""
    return _checked("get_runtime_context")().get_job_id()


def get(refs: Any, timeout: float) -> Any:
    return _checked("get")(refs, timeout=timeout)


def wait(refs: list, *, num_returns: int = 1, timeout: float) -> tuple[list, list]:
    return _checked("wait")(refs, num_returns=num_returns, timeout=timeout)


def kill(actor: Any) -> None:
    _checked("kill")(actor, no_restart=True)


def cancel(ref: Any) -> None:
    _checked("cancel")(ref)


def call(method: Any, *args: Any) -> Any:
    """``method.remote(*args)`` for an actor method."""
    if not ray_up():
        raise RayDown("an actor call after ray.shutdown()")
    return method.remote(*args)
