"""Finding a fleet's workers: their names in Ray, their stats, the ones a new session
goes to. Shared: the trainer attaches to fleets (``worker_pool``), ``dpex fleet``
(:mod:`dpex.server._fleet`) starts, watches and stops them."""

from __future__ import annotations

import random
import time
from collections.abc import Callable
from typing import Any

import ray

from dpex._version import local_versions
from dpex.errors import FleetError

__all__ = ["NAMESPACE", "fleet_name", "fleet_workers", "sample", "choose_workers"]

NAMESPACE = "dpex"
_CALL_TIMEOUT_S = 10.0
_STRAGGLER_S = 1.0
_RETRY_S = 1.0  # how often a choice asks again while no worker answers


def fleet_name(fleet: str, index: int) -> str:
    return f"{fleet}/{index}"


def fleet_workers(fleet: str) -> list[tuple[int, Any]]:
    """The fleet's actors as ``(index, handle)``, by index; ``[]`` if there is none.
    A worker removed between the listing and its lookup (``dpex fleet scale`` or
    ``stop`` ran meanwhile) is left out, as if listed a moment later."""
    prefix = fleet + "/"
    indices = sorted(
        int(a["name"][len(prefix):]) for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NAMESPACE and a["name"].startswith(prefix)
        and a["name"][len(prefix):].isdigit()
    )
    found = []
    for i in indices:
        try:
            found.append((i, ray.get_actor(fleet_name(fleet, i), namespace=NAMESPACE)))
        except ValueError:  # Ray's "Failed to look up actor": gone since the listing
            continue
    return found


def sample(actors: list[tuple[int, Any]]) -> dict[int, dict]:
    """``fleet_stats`` of the workers that answer: the first within ``_CALL_TIMEOUT_S``,
    the rest within a second more (a dead or restarting worker must not hold up the
    choice of a replacement for long)."""
    refs = {a.fleet_stats.remote(): i for i, a in actors}
    first, rest = ray.wait(list(refs), num_returns=1, timeout=_CALL_TIMEOUT_S)
    done = list(first)
    if first and rest:
        done += ray.wait(rest, num_returns=len(rest), timeout=_STRAGGLER_S)[0]
    out = {}
    for ref in done:
        try:
            out[refs[ref]] = ray.get(ref)
        except ray.exceptions.RayError:
            pass  # died or restarting: reported as not responding
    return out


def choose_workers(fleet: str, n: int, wait_s: float = 0.0,
                   clock: Callable[[], float] = time.monotonic,
                   sleep: Callable[[float], None] = time.sleep) -> list[Any]:
    """Handles of the fleet workers that ``n`` logical workers run on: the least busy
    first (ties at random), reused in turn when ``n`` exceeds the fleet; a draining
    worker (being removed) is never chosen.

    While no worker answers (the only one died and Ray is restarting it), ask again
    every second for ``wait_s`` seconds (the loader's ``startup_timeout``). Raises
    :class:`FleetError` when there is no such fleet, when none answered within the
    wait, when every worker drains (the fleet is being stopped), or when its dpex or
    Python differs."""
    deadline = clock() + wait_s
    while True:
        actors = fleet_workers(fleet)
        if not actors:
            raise FleetError(f"no dpex fleet named {fleet!r} in this Ray cluster: start one "
                             f"with `dpex fleet start --name {fleet} --workers N`")
        stats = sample(actors)
        if stats:
            break
        left = deadline - clock()
        if left <= 0:
            if wait_s <= 0:
                raise FleetError(f"no worker of fleet {fleet!r} answered within "
                                 f"{_CALL_TIMEOUT_S:g} s")
            raise FleetError(
                f"no worker of fleet {fleet!r} answered within startup_timeout={wait_s:g} s: "
                f"its {len(actors)} worker(s) did not come back (Ray restarts a dead fleet "
                f"worker where its resources are free; see `dpex fleet status --name "
                f"{fleet}`)")
        sleep(min(_RETRY_S, left))
    ours = local_versions()
    for i, info in stats.items():
        if info.get("versions") != ours:
            raise FleetError(
                f"fleet {fleet!r} worker {i} (node {info.get('node_ip')}) runs "
                f"{info.get('versions')}, but this trainer runs {ours}: restart the fleet "
                "with the trainer's dpex and Python")
    handles = dict(actors)
    # A draining worker is being removed (its sessions move off it) or the whole fleet
    # is being stopped; it ends any session it is given at once.
    usable = [i for i in stats if not stats[i].get("draining")]
    if not usable:
        raise FleetError(f"fleet {fleet!r} is being stopped (every worker that answered is "
                         "draining): it takes no new session")
    order = sorted(usable, key=lambda i: (stats[i]["sessions_active"], random.random()))
    return [handles[order[k % len(order)]] for k in range(n)]
