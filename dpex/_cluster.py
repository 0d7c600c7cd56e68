"""What the Ray cluster has: its live nodes, what an autoscaler could add, which requests
wait; and where new workers go (the policy is :mod:`dpex._placement`, pure). Used by a
trainer's own workers and by ``dpex fleet start``."""

from __future__ import annotations

import random
from collections.abc import Mapping
from typing import Any

import ray
from ray.util.scheduling_strategies import NodeAffinitySchedulingStrategy

from dpex import _placement
from dpex.errors import WorkerStartupError

__all__ = ["check_placeable", "choose_nodes", "on_node", "pending_requests"]

_tie_break = random.Random()  # never the user's random module state


def _autoscaling_max() -> dict[str, float] | None:
    """The most of each resource an autoscaling cluster's configuration can hold, or
    ``None`` on a cluster without an autoscaler (as Ray Train checks it)."""
    try:
        from ray._private.state import state
        found = state.get_max_resources_from_cluster_config()
    except Exception:  # a Ray without it, or no GCS answer: judge by today's nodes
        return None
    return {k: float(v) for k, v in found.items()} if found else None


def pending_requests() -> list[dict[str, float]] | None:
    """The resource shapes that wait in the cluster for resources to be freed (what
    ``ray status`` lists as demands), or ``None`` when this Ray cannot tell."""
    try:
        from ray._raylet import GcsClient
        from ray.autoscaler.v2.sdk import get_cluster_resource_state

        client = GcsClient(ray.get_runtime_context().gcs_address)
        state = get_cluster_resource_state(client)
        return [dict(r.request.resources_bundle) for r in state.pending_resource_requests]
    except Exception:  # an older or newer Ray without it: judge by free resources
        return None


def _live_nodes() -> list[dict]:
    return [node for node in ray.nodes() if node.get("Alive")]


def check_placeable(ray_remote_args: Mapping[str, Any], num_workers: int) -> None:
    """Raise at once when ``num_workers`` actors that reserve what ``ray_remote_args``
    asks for can never be placed (see :func:`dpex._placement.never_fits`)."""
    demand = _placement.per_worker_demand(ray_remote_args)
    if not demand:
        return
    nodes = _live_nodes()
    largest: dict[str, float] = {}
    for node in nodes:
        for name, amount in node.get("Resources", {}).items():
            largest[name] = max(largest.get(name, 0.0), float(amount))
    why = _placement.never_fits(demand, num_workers, ray.cluster_resources(), largest,
                                _autoscaling_max())
    if why:
        raise WorkerStartupError(
            f"the Ray cluster cannot place {num_workers} dpex workers ({why}); use fewer "
            "workers, or ask for less in ray_remote_args (without num_cpus a worker "
            "reserves no CPU, as torch's workers do)"
        )


def choose_nodes(n: int, held: Mapping[str, int]) -> list[str | None]:
    """Nodes for ``n`` new workers that reserve nothing (``None``: Ray's choice), spread
    over the CPU nodes counting the workers ``held`` on each node already."""
    nodes = [_placement.Node(node["NodeID"], float(node.get("Resources", {}).get("CPU", 0)))
             for node in _live_nodes()]
    if len(nodes) <= 1:
        return [None] * n
    return _placement.choose_nodes(nodes, held, n, _tie_break)


def on_node(node_id: str) -> NodeAffinitySchedulingStrategy:
    # Hard: Ray ignores a soft affinity for an actor that reserves nothing (Ray 2.60: 12
    # soft-pinned 0-CPU actors landed evenly on all three nodes of a test cluster). A node
    # lost before its worker is placed makes that worker unschedulable; the iterator
    # then places it again (ActorUnschedulableError counts as a worker death).
    return NodeAffinitySchedulingStrategy(node_id, soft=False)
