"""Where a trainer's sockets listen: the address its workers reach it at, and the ports
it may bind (both overridable for multi-homed hosts, Ray Client and firewalls)."""

from __future__ import annotations

import os

import ray

from dpex.errors import RayConnectionError

__all__ = ["ADVERTISE_ENV", "PORT_RANGE_ENV", "node_address", "port_range"]

ADVERTISE_ENV = "DPEX_ADVERTISE_ADDRESS"
PORT_RANGE_ENV = "DPEX_PORT_RANGE"


def node_address() -> str:
    """The address this process binds its data sockets on, for its workers to reach.

    ``$DPEX_ADVERTISE_ADDRESS`` when set (multi-homed hosts); loopback when this
    process started the Ray instance itself (the embedded default) and it has one node,
    so no worker can be placed elsewhere; otherwise the Ray node's IP address. A cluster
    this process joined may gain nodes at any time (an autoscaler, ``ray start
    --address``), and a worker placed on one of them could not dial loopback.
    """
    override = os.environ.get(ADVERTISE_ENV)
    if override:
        return override
    if ray.util.client.ray.is_connected():
        # Ray Client: this process runs off the cluster, so no Ray node address is its own.
        raise RayConnectionError(
            f"with Ray Client (ray://...) the workers must reach this process, which is not "
            f"a Ray node: set {ADVERTISE_ENV} to an address of this machine that the "
            f"cluster's nodes can reach, and {PORT_RANGE_ENV} to ports open to them")
    me = ray.get_runtime_context().get_node_id()
    if _started_here() and all(node["NodeID"] == me for node in ray.nodes() if node.get("Alive")):
        return "127.0.0.1"
    return ray.util.get_node_ip_address()


def _started_here() -> bool:
    """Whether this process started the Ray instance it is connected to (``ray.init()``
    with no cluster to join): Ray then runs its head node for this process alone."""
    node = getattr(ray._private.worker.global_worker, "node", None)
    return bool(getattr(node, "head", False))


def port_range() -> tuple[int, int]:
    """The ports a trainer may bind its sockets on: ``$DPEX_PORT_RANGE`` ("min-max",
    for firewalls; both ends included), else 49152-65535. Two ports per iterator."""
    value = os.environ.get(PORT_RANGE_ENV)
    if not value:
        return 49152, 65535
    try:
        low, high = (int(part) for part in value.split("-"))
    except ValueError:
        raise ValueError(f"{PORT_RANGE_ENV}={value!r}: expected MIN-MAX, e.g. 50000-50100") from None
    if not 1024 <= low < high <= 65535:
        raise ValueError(f"{PORT_RANGE_ENV}={value!r}: need 1024 <= MIN < MAX <= 65535")
    return low, high
