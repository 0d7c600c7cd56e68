"""Standalone worker fleets: detached, named dpex workers that training ranks share.

A fleet ``NAME`` is the Ray actors ``NAME/0`` … ``NAME/N-1`` in the ``dpex``
namespace, created detached (they outlive the script that started them and
every trainer) and restartable (Ray starts a dead one again, with the same
name). Each is an ordinary :class:`~dpex.server._actor.DpexWorker`: every loader
iterator that attaches opens one session per logical worker on it, with its own
sockets, key, dataset and compute thread.

These functions need a connected Ray (``dpex.cli`` connects, the loader does).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Mapping
from typing import Any

import ray

from dpex._cluster import check_placeable, choose_nodes, on_node
from dpex._fleet_registry import NAMESPACE, fleet_name, fleet_workers, sample
from dpex._placement import reserves
from dpex.errors import FleetError, WorkerStartupError
from dpex.server._actor import DpexWorker

__all__ = ["start_fleet", "fleet_status", "stop_fleet"]


def start_fleet(fleet: str, workers: int, cpus_per_worker: float = 1.0,
                resources: Mapping[str, float] | None = None, session_timeout: float = 30.0,
                timeout: float = 120.0, progress: Callable[[str], None] = print) -> list[dict]:
    """Start ``workers`` detached workers named ``fleet/i``; return their stats once
    all are up. Raises :class:`FleetError` (and leaves nothing behind) when the
    fleet exists already or the cluster cannot place every worker in ``timeout``.

    Each worker reserves ``cpus_per_worker`` CPUs and ``resources``, and Ray spreads
    them over the nodes where those are free and restarts a dead one wherever they are
    free. With nothing reserved (``cpus_per_worker=0``) dpex spreads them over the
    CPU nodes in proportion to their CPUs, as a loader's own workers, and a worker
    restarts on its node (so one whose node is lost is not moved)."""
    if not fleet or "/" in fleet:
        raise FleetError(f"fleet name {fleet!r}: give a non-empty name without '/'")
    if workers < 1:
        raise FleetError(f"--workers must be >= 1, got {workers}")
    if fleet_workers(fleet):
        raise FleetError(f"a dpex fleet named {fleet!r} is running already; stop it first "
                         f"(dpex fleet stop --name {fleet})")
    options = {"num_cpus": cpus_per_worker, "resources": dict(resources or {})}
    try:
        check_placeable(options, workers)
    except WorkerStartupError as exc:
        raise FleetError(str(exc).replace("ray_remote_args", "--cpus-per-worker and --resources")
                         .replace("without num_cpus", "with --cpus-per-worker 0")) from None
    if reserves(options):
        strategies: list[Any] = ["SPREAD"] * workers
    else:
        strategies = [on_node(node) if node else "DEFAULT" for node in choose_nodes(workers, {})]
    cls = ray.remote(DpexWorker)
    actors = [cls.options(name=fleet_name(fleet, i), namespace=NAMESPACE, lifetime="detached",
                          max_restarts=-1, max_task_retries=0, scheduling_strategy=strategy,
                          **options).remote(session_timeout=session_timeout, pooled=True)
              for i, strategy in enumerate(strategies)]
    pending = {a.fleet_stats.remote(): i for i, a in enumerate(actors)}
    infos: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    try:
        while pending:
            left = deadline - time.monotonic()
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, left))
            if not done:
                raise FleetError(
                    f"only {len(infos)} of {workers} workers of fleet {fleet!r} started within "
                    f"{timeout:g} s: the cluster could not place the rest (each asks for "
                    f"{options}; free now: {ray.available_resources()})")
            i = pending.pop(done[0])
            infos[i] = ray.get(done[0])
            progress(f"{len(infos)}/{workers} workers up (worker {i} on node "
                     f"{infos[i]['node_ip']}, pid {infos[i]['pid']})")
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise
    return [infos[i] for i in range(workers)]


def fleet_status(fleet: str, interval: float = 1.0) -> list[dict]:
    """One row per worker: index, node, state, sessions, batches, bytes, batches/s
    (over ``interval`` seconds). Raises :class:`FleetError` if there is no such fleet."""
    actors = fleet_workers(fleet)
    if not actors:
        raise FleetError(f"no dpex fleet named {fleet!r} in this Ray cluster")
    first = sample(actors)
    time.sleep(interval)
    second = sample(actors)
    rows = []
    for i, _ in actors:
        a, b = first.get(i), second.get(i)
        if b is None:
            rows.append({"worker": i, "state": "not responding (restarting?)"})
            continue
        rate = (b["batches_sent"] - a["batches_sent"]) / interval if a else None
        rows.append({"worker": i, "state": "alive", "batches_per_s": rate, **b})
    return rows


def stop_fleet(fleet: str) -> int:
    """Kill the fleet's workers (their sessions' trainers see them die); return how many."""
    actors = fleet_workers(fleet)
    if not actors:
        raise FleetError(f"no dpex fleet named {fleet!r} in this Ray cluster")
    for _, actor in actors:
        ray.kill(actor, no_restart=True)
    return len(actors)
