"""Where a trainer's sockets listen: the address its workers reach it at, and the ports
it may bind (both overridable for multi-homed hosts, Ray Client and firewalls)."""

from __future__ import annotations

import ipaddress
import logging
import os
import resource
import socket

import ray

from dpex.errors import RayConnectionError

__all__ = ["ADVERTISE_ENV", "PORT_RANGE_ENV", "ACCEPT_FROM_ENV", "node_address",
           "port_range", "accept_from", "subnet_of", "raise_fd_limit"]

ADVERTISE_ENV = "DPEX_ADVERTISE_ADDRESS"
PORT_RANGE_ENV = "DPEX_PORT_RANGE"
ACCEPT_FROM_ENV = "DPEX_ACCEPT_FROM"


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


def accept_from(host: str) -> list[str]:
    """The peers a trainer's sockets on ``host`` accept a TCP connection from (libzmq's
    ``TCP_ACCEPT_FILTER``: any other is closed as soon as it is accepted, before it
    holds a descriptor for the handshake window); empty: any.

    ``$DPEX_ACCEPT_FROM`` when set: addresses and ``address/bits`` subnets, comma
    separated, or ``any``. Loopback: any (only this machine can connect). Otherwise
    the subnet of this machine's interface that carries ``host`` (nodes an autoscaler
    adds later are usually there) and every node of the Ray cluster now.
    """
    value = os.environ.get(ACCEPT_FROM_ENV, "").strip()
    if value:
        if value.lower() == "any":
            return []
        out = [part.strip() for part in value.split(",") if part.strip()]
        for part in out:
            try:
                ipaddress.ip_network(part, strict=False)
            except ValueError:
                raise ValueError(f"{ACCEPT_FROM_ENV}={value!r}: {part!r} is not an address "
                                 "or address/bits subnet (or say 'any')") from None
        return out
    try:
        if ipaddress.ip_address(host).is_loopback:
            return []
    except ValueError:  # a host name ($DPEX_ADVERTISE_ADDRESS): the nodes alone
        pass
    nodes = [node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")]
    subnet = subnet_of(host)
    return ([subnet] if subnet else []) + sorted(set(nodes) | {host})


def subnet_of(host: str) -> str | None:
    """``network/bits`` of this machine's interface whose address is ``host``."""
    try:
        import psutil  # (Ray's dependency)
    except ImportError:
        return None
    for addresses in psutil.net_if_addrs().values():
        for addr in addresses:
            if addr.family in (socket.AF_INET, socket.AF_INET6) and addr.address == host \
                    and addr.netmask:
                return str(ipaddress.ip_network(f"{host}/{addr.netmask}", strict=False))
    return None


def raise_fd_limit() -> tuple[int, int]:
    """Raise this process's soft limit of open files to its hard limit (a stranger's
    connections, each held until its handshake fails, must not leave the training loop
    without descriptors for a checkpoint); the (soft, hard) limits after."""
    soft, hard = resource.getrlimit(resource.RLIMIT_NOFILE)
    if soft != hard and soft != resource.RLIM_INFINITY:
        try:
            resource.setrlimit(resource.RLIMIT_NOFILE, (hard, hard))
            soft = hard
        except (ValueError, OSError) as exc:  # e.g. a hard limit the kernel caps lower
            logging.getLogger("dpex").debug("could not raise the open-file limit: %s", exc)
    return soft, hard
