"""Where a trainer's sockets listen: the address its workers reach it at, the ports it
may bind (both overridable for multi-homed hosts, Ray Client and firewalls), and the
peers it accepts connections from."""

from __future__ import annotations

import ipaddress
import logging
import os
import resource
import socket
from collections.abc import Callable, Iterable

import ray

from dpex.errors import RayConnectionError

__all__ = ["ADVERTISE_ENV", "PORT_RANGE_ENV", "ACCEPT_FROM_ENV", "node_address",
           "tcp_endpoint", "port_range", "accept_from", "AcceptSet", "accept_set",
           "cluster_nodes", "subnet_of", "raise_fd_limit"]

_log = logging.getLogger("dpex")

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
    override = os.environ.get(ADVERTISE_ENV, "").strip()
    if override:
        return _advertised(override)
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


def _advertised(value: str) -> str:
    """``$DPEX_ADVERTISE_ADDRESS`` as the one IP address the sockets bind, the workers
    dial and the accepted set is made around: an address as given, a host name resolved
    once here (its first IPv4 address, else its first IPv6 one). It must be an address
    of this machine (the trainer binds it)."""
    try:
        address = ipaddress.ip_address(value)
    except ValueError:
        try:
            infos = socket.getaddrinfo(value, None, proto=socket.IPPROTO_TCP)
        except OSError as exc:
            raise ValueError(f"{ADVERTISE_ENV}={value!r}: not an IP address, and the name "
                             f"does not resolve here ({exc}): give an address of this "
                             "machine that the workers can reach") from None
        found = [ipaddress.ip_address(info[4][0].split("%")[0]) for info in infos]
        address = min(found, key=lambda a: a.version)  # (stable: the first of IPv4)
    if address.is_unspecified:
        raise ValueError(f"{ADVERTISE_ENV}={value!r}: the workers cannot dial a wildcard "
                         "address: give an address of this machine that they can reach")
    local = _local_addresses()
    if local is not None and str(address) not in local:
        raise ValueError(f"{ADVERTISE_ENV}={value!r}: {address} is not an address of this "
                         f"machine ({', '.join(sorted(local))}), so the trainer cannot bind "
                         "it: give the address of one of its interfaces that the workers "
                         "can reach")
    return str(address)


def _local_addresses() -> set[str] | None:
    """This machine's interface addresses (None where psutil is missing)."""
    try:
        import psutil  # (Ray's dependency)
    except ImportError:
        return None
    return {addr.address.split("%")[0] for addrs in psutil.net_if_addrs().values()
            for addr in addrs if addr.family in (socket.AF_INET, socket.AF_INET6)}


def tcp_endpoint(host: str, port: int | None = None) -> str:
    """``tcp://host`` (``tcp://[host]`` for IPv6, as libzmq reads it), with ``:port``."""
    text = f"[{host}]" if ":" in host else host
    return f"tcp://{text}" if port is None else f"tcp://{text}:{port}"


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
    """The peers a trainer's sockets on ``host`` (an IP address) accept a TCP
    connection from; empty: any.

    ``$DPEX_ACCEPT_FROM`` when set: addresses and ``address/bits`` subnets, comma
    separated, or ``any``. Loopback: any (only this machine can connect). Otherwise
    the subnet of this machine's interface that carries ``host`` (nodes an autoscaler
    adds later are usually there) and every node of the Ray cluster now (a node that
    joins later is looked up when it connects: :class:`AcceptSet`). An entry of the
    other IP family than ``host``'s is left out with a warning: no such peer can reach
    a socket bound there; a ``$DPEX_ACCEPT_FROM`` left with none is an error.
    """
    version = ipaddress.ip_address(host).version
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
        kept = _of_family(out, version, f"{ACCEPT_FROM_ENV}={value!r}")
        if not kept:
            raise ValueError(
                f"{ACCEPT_FROM_ENV}={value!r}: no IPv{version} address or subnet in it, and "
                f"the trainer listens on {host} (IPv{version}), where no other peer can "
                f"connect: add the workers' IPv{version} subnets, or set {ADVERTISE_ENV} to "
                "an address of this machine of the family the workers use")
        return kept
    if ipaddress.ip_address(host).is_loopback:
        return []
    subnet = subnet_of(host)
    return ([subnet] if subnet else []) + sorted(set(cluster_nodes(version)) | {host})


def cluster_nodes(version: int) -> list[str]:
    """The addresses of the Ray cluster's live nodes of IP ``version`` (4 or 6); one of
    the other family is left out with a warning (once per address)."""
    nodes = [node["NodeManagerAddress"] for node in ray.nodes() if node.get("Alive")]
    return _of_family(nodes, version, "the Ray cluster's node")


_warned: set[tuple[str, str]] = set()


def _of_family(entries: list[str], version: int, source: str) -> list[str]:
    """The ``entries`` (addresses or subnets) of IP ``version``; a warning, naming the
    ``source``, for each other one (once)."""
    kept = []
    for entry in entries:
        try:
            family = ipaddress.ip_network(entry, strict=False).version
        except ValueError:
            family = None
        if family == version:
            kept.append(entry)
        elif (source, entry) not in _warned:
            _warned.add((source, entry))
            _log.warning("dpex: %s %r left out of the accepted peers: the trainer listens "
                         "on an IPv%d address, which it cannot connect to", source, entry,
                         version)
    return kept


LOOK_UP_EVERY_S = 5.0  # an unknown peer asks Ray for the cluster's nodes at most this often


class AcceptSet:
    """The peers a trainer's sockets accept (pure: the caller looks the nodes up).

    ``anyone``: all. Otherwise an address inside one of the fixed ``networks`` or
    equal to one of the ``nodes`` (the Ray cluster's node addresses). A set with a
    ``lookup`` learns the nodes that join after it was made (an autoscaler's, maybe on
    another subnet): an address outside it makes :meth:`look_up_due` true at most once
    every ``every`` seconds, so strangers cannot make the trainer ask Ray at the rate
    they connect; the caller calls ``lookup`` (it asks Ray) and :meth:`update`.
    ``tcp_filter``: what libzmq's ``TCP_ACCEPT_FILTER`` may hold (a fixed set only:
    libzmq copies the filter into a listener when it binds, and never reads it again).
    ``version``: the IP family of the trainer's address (4 or 6).
    """

    def __init__(self, networks: Iterable[str] = (), nodes: Iterable[str] = (), *,
                 anyone: bool = False, lookup: Callable[[], list[str]] | None = None,
                 tcp_filter: Iterable[str] = (), every: float = LOOK_UP_EVERY_S,
                 version: int = 4) -> None:
        self.anyone, self.lookup, self.every = anyone, lookup, every
        self.version = version
        self.tcp_filter = list(tcp_filter)
        self._networks = [ipaddress.ip_network(n, strict=False) for n in networks]
        self._nodes: set[ipaddress.IPv4Address | ipaddress.IPv6Address] = set()
        self.update(nodes)
        self._next_look_up = float("-inf")

    def admits(self, address: str) -> bool:
        if self.anyone:
            return True
        try:
            ip = ipaddress.ip_address(address.split("%")[0])
        except ValueError:
            return False
        if isinstance(ip, ipaddress.IPv6Address) and ip.ipv4_mapped is not None:
            ip = ip.ipv4_mapped  # (an IPv4 peer of a dual-stack socket)
        return ip in self._nodes or any(ip in net for net in self._networks)

    def look_up_due(self, now: float) -> bool:
        """Whether to look the nodes up now (and if so, not again for ``every`` s)."""
        if self.lookup is None or now < self._next_look_up:
            return False
        self._next_look_up = now + self.every
        return True

    def update(self, nodes: Iterable[str]) -> None:
        """The cluster's nodes now (a node that left is no longer admitted)."""
        self._nodes = {ipaddress.ip_address(n) for n in nodes}


def accept_set(host: str) -> AcceptSet:
    """The peers a trainer's sockets on ``host`` accept (see :func:`accept_from`):
    $DPEX_ACCEPT_FROM's fixed set (also given to libzmq's filter), anyone, or this
    machine's subnet and the cluster's nodes, looked up again for an unknown peer."""
    given = os.environ.get(ACCEPT_FROM_ENV, "").strip()
    entries = accept_from(host)
    version = ipaddress.ip_address(host).version
    if not entries:
        return AcceptSet(anyone=True, version=version)
    if given:
        return AcceptSet(entries, tcp_filter=entries, version=version)
    subnet = subnet_of(host)
    return AcceptSet([*([subnet] if subnet else []), host],
                     [e for e in entries if e != subnet and e != host],
                     lookup=lambda: cluster_nodes(version), version=version)


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
