"""Joining (or starting) the Ray cluster, once per process."""

from __future__ import annotations

import socket
import threading
import urllib.parse

import ray

from dpex.errors import RayConnectionError

__all__ = ["connect_ray", "node_address"]

_lock = threading.Lock()
_REACH_TIMEOUT_S = 10.0


def _check_reachable(address: str) -> None:
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
            f"cannot reach the Ray cluster at head_address={address!r}: {exc}"
        ) from None


def connect_ray(head_address: str = "auto") -> None:
    """Make sure this process is connected to Ray.

    Reuses an existing connection (``ray.is_initialized()``); ``"auto"`` joins a
    running cluster (``RAY_ADDRESS`` or a local ``ray start``) and otherwise
    starts a local instance on loopback; any other address must be reachable,
    or :class:`~dpex.errors.RayConnectionError` names it.
    """
    with _lock:
        if ray.is_initialized():
            return
        if head_address in ("auto", "", None):
            try:
                ray.init(address="auto", log_to_driver=True)
                return
            except ConnectionError:
                pass
            ray.init(_node_ip_address="127.0.0.1", include_dashboard=False)
            return
        _check_reachable(head_address)
        try:
            ray.init(address=head_address)
        except Exception as exc:
            raise RayConnectionError(
                f"cannot join the Ray cluster at head_address={head_address!r}: {exc}"
            ) from exc


def node_address() -> str:
    """The address of this process's Ray node, where its sockets are bound."""
    return ray.util.get_node_ip_address()
