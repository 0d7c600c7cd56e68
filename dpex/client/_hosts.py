"""A trainer process's worker hosts: the actor options they start with, and which
live host each (options, node) has (:mod:`dpex.client._workers` starts and uses them;
docs/WARM_WORKERS.md).

The host wing's processes, what each holds and when it ends: NOTE [ The worker
host's processes ] in :mod:`dpex.server._fork_base`.
"""

from __future__ import annotations

import os
import threading
from collections.abc import Mapping
from typing import Any

from dpex import _cluster, _placement, _ray_guard
from dpex._start_trace import mark

__all__ = ["EARLY", "SHARED", "SharedHosts", "host_options", "new_host", "options_key"]

EARLY: set[str] = set()  # ids of hosts started early (start_hosts), not yet taken


class SharedHosts:
    """The hosts this process's live worker groups use, by (options, node): loaders
    that iterate at once (a validation loop inside a training epoch, two persistent
    loaders) share their node's host instead of starting one each. The last group to
    stop hands it to the warm pool."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._hosts: dict[tuple[str, str | None], tuple[Any, set[int], str | None]] = {}

    def take(self, key: str, node: str | None, group: int) -> Any | None:
        job = _job()
        with self._lock:
            entry = self._hosts.get((key, node))
            if entry is None or entry[2] != job:  # (an earlier Ray connection's: gone)
                return None
            entry[1].add(group)
            return entry[0]

    def add(self, key: str, node: str | None, group: int, host: Any) -> None:
        job = _job()
        with self._lock:
            self._hosts[(key, node)] = (host, {group}, job)

    def leave(self, key: str, node: str | None, group: int, host: Any) -> bool:
        """``group`` no longer uses ``host``; whether it was the last to."""
        with self._lock:
            entry = self._hosts.get((key, node))
            if entry is None or entry[0] is not host:
                return True  # (forgotten: lost, and another took its place)
            entry[1].discard(group)
            if entry[1]:
                return False
            del self._hosts[(key, node)]
            return True

    def has(self, key: str, node: str | None) -> bool:
        job = _job()
        with self._lock:
            entry = self._hosts.get((key, node))
            return entry is not None and entry[2] == job

    def lost(self, host_id: str) -> None:
        """A host died: no group takes it again."""
        with self._lock:
            for where, (host, _, _) in list(self._hosts.items()):
                if _ray_guard.actor_id(host) == host_id:
                    del self._hosts[where]


def _job() -> str | None:
    try:
        return _ray_guard.job_id()
    except Exception:
        return None  # Ray shut down


SHARED = SharedHosts()


def host_options(ray_remote_args: Mapping[str, Any]) -> dict[str, Any]:
    """The actor options of a loader's workers (a host's, when they reserve nothing)."""
    options = {"num_cpus": 0, **ray_remote_args}
    if _placement.reserves(options):
        options.setdefault("scheduling_strategy", "SPREAD")
    return options


def new_host(actor_class: Any, options: Mapping[str, Any], node: str | None,
             keep_s: float) -> Any:
    """Start a host actor on ``node`` (its forkserver starts at once)."""
    mark("host asked")
    options = dict(options)
    if node is not None:
        options["scheduling_strategy"] = _cluster.on_node(node)
    return actor_class.options(**options).remote(host=True, warm=keep_s > 0,
                                                 niceness=os.getpriority(os.PRIO_PROCESS, 0))


def options_key(options: Mapping[str, Any]) -> str:
    """Actor options as a key: warm workers are reused only for the same options."""
    return repr(sorted((k, repr(v)) for k, v in options.items()))
