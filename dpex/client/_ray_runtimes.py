"""Ray's world for a dpex iterator (:class:`~dpex.client._runtime.Runtimes`, the
default): the workers are actors of the iterator's own, or a fleet's sessions. Every
method imports what it needs when called: the loader's constructor (which asks
:meth:`RayRuntimes.prestart`) returns at once, and the imports of Ray and dpex's
client run on the start thread (:mod:`dpex.client._early`).
"""

from __future__ import annotations

import functools
from typing import TYPE_CHECKING, Any

from dpex.client._early import EARLY

if TYPE_CHECKING:
    from dpex._config import DpexConfig
    from dpex.client._events import Handoff
    from dpex.client._runtime import Runtime
    from dpex.client._shipment import Shipment

__all__ = ["RayRuntimes"]

_EARLY_WAIT_S = 300.0  # at most, for the start the loader's constructor began


def _start_hosts(worker_class: type, num_workers: Any, remote_args: Any,
                 keep_s: float) -> None:
    from dpex.client._workers import start_hosts_early

    start_hosts_early(worker_class, num_workers, remote_args, keep_s)


class RayRuntimes:
    """Ray's (the default): the workers are actors of the iterator's own, or a fleet's
    sessions."""

    def prestart(self, worker_class: type, num_workers: Any, remote_args: Any,
                 keep_s: float, head_address: str) -> None:
        EARLY.begin(head_address, functools.partial(
            _start_hosts, worker_class, num_workers, remote_args, keep_s))

    def handed_off(self) -> None:
        EARLY.handed_off()

    def connect(self, head_address: str) -> None:
        from dpex._ray_connect import connect_ray

        EARLY.wait(head_address, _EARLY_WAIT_S)  # (the loader's constructor began it)
        connect_ray(head_address)

    def node_id(self) -> str:
        import ray

        return ray.get_runtime_context().get_node_id()

    def ship(self, loader: Any, contents: Any, fleet: bool) -> Shipment:
        from dpex.client._shipment import ship

        return ship(loader, contents, fleet=fleet)

    def make(self, name: str, handoff: Handoff, config: DpexConfig, label: str,
             worker_class: type) -> Runtime:
        from dpex.client._runtime import Runtime

        return Runtime(name, handoff, config, label, worker_class)

    def free_resources(self) -> dict:
        import ray

        return ray.available_resources()
