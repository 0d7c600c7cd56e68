"""Where a loader's workers run and what they reserve. Pure: no Ray calls here.

torch's workers reserve nothing: any number of loaders × workers, ranks × workers
and iterators not yet collected share a machine's cores, and the OS shares them
out. dpex's workers do the same by default: each actor asks Ray for no CPU
(``num_cpus=0``), so no dpex worker ever waits for another one's reservation, and
dpex chooses each worker's node itself, spreading the workers over the nodes that
have CPUs in proportion to their CPU count (Ray's own SPREAD would also use nodes
that have no CPU at all, such as a head started with ``--num-cpus 0``).

A user who asks Ray to reserve something (``num_cpus``, ``num_gpus``, ``memory``,
``resources``, ``accelerator_type``) or to place the actors (``scheduling_strategy``,
``placement_group``) gets exactly that, placed by Ray; then, and only then, a
request can wait for free resources or never fit, and :func:`never_fits` /
:func:`shortfall` say so.
"""

from __future__ import annotations

import random
from collections.abc import Mapping, Sequence
from dataclasses import dataclass
from typing import Any

__all__ = ["Node", "reserves", "per_worker_demand", "choose_nodes", "never_fits", "matches",
           "shortfall", "describe"]

# Actor options that reserve something or choose the placement: the user's choice wins.
_RESERVING = ("num_cpus", "num_gpus", "memory", "resources", "accelerator_type")
_PLACING = ("scheduling_strategy", "placement_group", "label_selector")


@dataclass(frozen=True)
class Node:
    """A live Ray node as placement sees it."""

    node_id: str
    cpus: float


def _positive(value: Any) -> bool:
    try:
        return float(value) > 0
    except (TypeError, ValueError):
        return bool(value)


def reserves(ray_remote_args: Mapping[str, Any]) -> bool:
    """True when the user asked Ray to reserve resources or to choose the placement."""
    for key in _RESERVING:
        value = ray_remote_args.get(key)
        if key == "resources":
            if value and any(_positive(v) for v in value.values()):
                return True
        elif key == "accelerator_type":
            if value:
                return True
        elif value is not None and _positive(value):
            return True
    return any(ray_remote_args.get(key) is not None for key in _PLACING)


def per_worker_demand(ray_remote_args: Mapping[str, Any]) -> dict[str, float]:
    """What one worker actor reserves, in Ray's resource names (``{}``: nothing)."""
    demand: dict[str, float] = {}
    for key, name in (("num_cpus", "CPU"), ("num_gpus", "GPU"), ("memory", "memory")):
        value = ray_remote_args.get(key)
        if value is not None and float(value) > 0:
            demand[name] = float(value)
    for name, value in (ray_remote_args.get("resources") or {}).items():
        if float(value) > 0:
            demand[name] = float(value)
    return demand


def choose_nodes(nodes: Sequence[Node], held: Mapping[str, int], n: int,
                 rng: random.Random) -> list[str | None]:
    """A node for each of ``n`` workers that reserve nothing.

    Each worker goes to the node with the fewest dpex workers per CPU, counting
    ``held`` (live workers already there) and the workers chosen before it; ties are
    broken at random, so ranks that place their workers at the same moment do not
    all pick the same node. Nodes without CPUs get none. With no CPU node at all the
    answer is ``None`` for every worker: Ray places them.
    """
    candidates = [node for node in nodes if node.cpus > 0]
    if not candidates:
        return [None] * n
    load = {node.node_id: held.get(node.node_id, 0) for node in candidates}
    chosen: list[str | None] = []
    for _ in range(n):
        tie = {node.node_id: rng.random() for node in candidates}
        best = min(candidates, key=lambda node: ((load[node.node_id] + 1) / node.cpus,
                                                 tie[node.node_id]))
        load[best.node_id] += 1
        chosen.append(best.node_id)
    return chosen


def describe(demand: Mapping[str, float]) -> str:
    """``{'CPU': 1.0}`` as ``CPU 1``; nothing as ``nothing``."""
    if not demand:
        return "nothing"
    return ", ".join(f"{name} {amount:g}" for name, amount in sorted(demand.items()))


def never_fits(demand: Mapping[str, float], n: int, totals: Mapping[str, float],
               largest_node: Mapping[str, float],
               autoscaling_max: Mapping[str, float] | None) -> str | None:
    """Why ``n`` workers that each reserve ``demand`` can never be placed, or ``None``.

    ``totals`` is what the cluster has now and ``largest_node`` the most of each
    resource one node has. On an autoscaling cluster (``autoscaling_max``: the most
    its configuration can ever hold) only that maximum counts: today's nodes say
    nothing about tomorrow's, so a request is refused only when even the largest
    cluster the autoscaler may build is too small.
    """
    problems = []
    for name, need in sorted(demand.items()):
        if autoscaling_max is not None:
            limit = max(float(autoscaling_max.get(name, 0)), float(totals.get(name, 0)))
            if need * n > limit + 1e-9:
                problems.append(f"{name}: {need * n:g} asked, at most {limit:g} after autoscaling")
            continue
        have = float(totals.get(name, 0))
        biggest = float(largest_node.get(name, 0))
        if need > biggest + 1e-9:
            problems.append(f"{name}: {need:g} asked per worker, the largest node has {biggest:g}")
        elif need * n > have + 1e-9:
            problems.append(f"{name}: {need * n:g} asked, {have:g} in the cluster")
    return "; ".join(problems) or None


def matches(demand: Mapping[str, float], request: Mapping[str, float]) -> bool:
    """Whether a pending resource ``request`` has the shape a worker reserving
    ``demand`` asks for (Ray may add resources of its own to the request)."""
    return all(abs(float(request.get(name, -1)) - need) < 1e-9 for name, need in demand.items())


def shortfall(demand: Mapping[str, float], free: Mapping[str, float]) -> dict[str, float]:
    """The resources of which less than one more worker's ``demand`` is free now."""
    return {name: float(free.get(name, 0)) for name, need in demand.items()
            if float(free.get(name, 0)) + 1e-9 < need}
