"""Finding a fleet's workers: their names in Ray, their stats, the ones a new session
goes to. Shared: the trainer attaches to fleets (``worker_pool``), ``dpex fleet``
(:mod:`dpex.server._fleet`) starts, watches and stops them."""

from __future__ import annotations

import random
from typing import Any

import ray

from dpex._version import local_versions
from dpex.errors import FleetError

__all__ = ["NAMESPACE", "fleet_name", "fleet_workers", "sample", "choose_workers"]

NAMESPACE = "dpex"
_CALL_TIMEOUT_S = 10.0
_STRAGGLER_S = 1.0


def fleet_name(fleet: str, index: int) -> str:
    return f"{fleet}/{index}"


def fleet_workers(fleet: str) -> list[tuple[int, Any]]:
    """The fleet's actors as ``(index, handle)``, by index; ``[]`` if there is none."""
    prefix = fleet + "/"
    indices = sorted(
        int(a["name"][len(prefix):]) for a in ray.util.list_named_actors(all_namespaces=True)
        if a["namespace"] == NAMESPACE and a["name"].startswith(prefix)
        and a["name"][len(prefix):].isdigit()
    )
    return [(i, ray.get_actor(fleet_name(fleet, i), namespace=NAMESPACE)) for i in indices]


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


def choose_workers(fleet: str, n: int) -> list[Any]:
    """Handles of the fleet workers that ``n`` logical workers run on: the least busy
    first (ties at random), reused in turn when ``n`` exceeds the fleet. Raises
    :class:`FleetError` when there is no such fleet or its dpex or Python differs."""
    actors = fleet_workers(fleet)
    if not actors:
        raise FleetError(f"no dpex fleet named {fleet!r} in this Ray cluster: start one with "
                         f"`dpex fleet start --name {fleet} --workers N`")
    stats = sample(actors)
    if not stats:
        raise FleetError(f"no worker of fleet {fleet!r} answered within {_CALL_TIMEOUT_S:g} s")
    ours = local_versions()
    for i, info in stats.items():
        if info.get("versions") != ours:
            raise FleetError(
                f"fleet {fleet!r} worker {i} (node {info.get('node_ip')}) runs "
                f"{info.get('versions')}, but this trainer runs {ours}: restart the fleet "
                "with the trainer's dpex and Python")
    handles = dict(actors)
    # (not a worker being removed, whose sessions are moving off it, unless it is all)
    usable = [i for i in stats if not stats[i].get("draining")] or list(stats)
    order = sorted(usable, key=lambda i: (stats[i]["sessions_active"], random.random()))
    return [handles[order[k % len(order)]] for k in range(n)]
