"""What ``loader.stats()`` returns, and the same in Prometheus' text format.

The keys are documented in docs/STATS.md; :class:`LoaderStats` is their type.
The data-stall share is the question a user asks first: what part of the
epoch did the training loop spend waiting in ``next()`` for a batch? Near 0 the
input pipeline keeps up; above a few percent, more workers (or faster ones)
would make training faster.
"""

from __future__ import annotations

import collections
import math
from typing import Any, TypedDict

__all__ = ["LoaderStats", "WorkerStats", "Latencies", "stats_prometheus"]


class Latencies:
    """The latest ``keep`` batch latencies (from a worker's batch being ready to the
    training loop holding it), summarised as percentiles. Pure: the caller gives the
    two clock readings."""

    def __init__(self, keep: int = 4096) -> None:
        self._recent: collections.deque[int] = collections.deque(maxlen=keep)

    def add(self, ready_ns: int, taken_ns: int) -> None:
        if ready_ns > 0:  # 0: the message carried no time (not a batch)
            self._recent.append(taken_ns - ready_ns)

    def summary(self) -> dict[str, float] | None:
        """``{"n", "p50_ms", "p99_ms", "max_ms"}`` over the kept batches; None if none."""
        if not self._recent:
            return None
        ordered = sorted(self._recent.copy())  # (copied at once: any thread may ask)
        n = len(ordered)

        def at(q: float) -> float:  # nearest rank
            return ordered[max(0, math.ceil(q * n) - 1)] / 1e6

        return {"n": n, "p50_ms": at(0.5), "p99_ms": at(0.99), "max_ms": ordered[-1] / 1e6}


class WorkerStats(TypedDict, total=False):
    pid: int  # the worker's process (a fleet's: the fleet worker's)
    session_pid: int  # a fleet session's own process (fleets only)
    node_ip: str
    node_id: str
    transport: str  # "ring", or "socket (why)"
    warm: bool  # started on a warm worker of an earlier iterator (its own fresh process)
    batches: int  # results of this worker that counted, this iterator
    batches_per_s: float  # batches over the time since it was first ready
    retired: bool  # taken out by scale_workers() or the autoscaler


class LoaderStats(TypedDict, total=False):
    epoch: int  # 1 for the first epoch of this iterator
    epoch_s: float  # wall time of this epoch so far (to its end once it ended)
    data_wait_s: float  # of which the training loop waited in next() for data
    data_wait_share: float  # data_wait_s / epoch_s (0 before anything was timed)
    workers_ready: int
    workers: dict[int, WorkerStats]
    credits_in_flight: int  # batches dispatched and not yet taken (<= the window)
    worker_batch_s: float | None  # the workers' mean time per batch, recent batches
    batch_latency: dict[str, float] | None  # batch ready in a worker -> loop holds it (recent)
    dataset_bytes: int  # the pickled dataset, collate_fn and worker_init_fn shipped
    dataset_reused: bool  # the same bytes as the loader's previous iterator: not shipped again
    dataset_fallbacks: int  # worker starts whose host could not use the trainer's memfd
    received: int  # data messages accepted
    received_in_ring: int  # of which through the same-node shared-memory ring
    security: str  # the sockets' mode: "authenticated" (frames in clear) or "encrypted"
    unroutable: int  # control messages held for a worker whose connection was lost
    rejected: dict[str, int]  # messages refused, by reason (mac, session, handshake, ...)
    dropped: dict[str, int]  # results not used, and recovery actions, by reason
    backups: dict[str, int]  # stragglers' batches computed again: launched, won, wasted
    recoveries: list[dict[str, Any]]  # one per restart: worker, cause, reported_at, ready_at
    autoscale: dict[str, Any]  # num_workers=dpex.Autoscale(...): decisions and history


_GAUGES = [  # (stats key, metric name, type, help)
    ("epoch", "dpex_epoch", "gauge", "Epoch of the newest iterator (1 = its first)."),
    ("epoch_s", "dpex_epoch_seconds", "gauge", "Wall time of the current epoch so far."),
    ("data_wait_s", "dpex_data_wait_seconds", "gauge",
     "Time the training loop waited for data in the current epoch."),
    ("data_wait_share", "dpex_data_wait_share", "gauge",
     "Share of the current epoch the training loop waited for data (0-1)."),
    ("workers_ready", "dpex_workers_ready", "gauge", "Workers ready."),
    ("credits_in_flight", "dpex_batches_in_flight", "gauge",
     "Batches dispatched to workers and not yet taken."),
    ("received", "dpex_received_total", "counter", "Data messages accepted."),
    ("received_in_ring", "dpex_received_in_ring_total", "counter",
     "Data messages that came through the same-node shared-memory ring."),
]


def _label(value: Any) -> str:
    return str(value).replace("\\", "\\\\").replace('"', '\\"').replace("\n", "\\n")


def stats_prometheus(source: Any) -> str:
    """``loader.stats()`` (or a loader, or an iterator) in Prometheus' text
    exposition format, ready to serve from a ``/metrics`` endpoint."""
    stats = source.stats() if hasattr(source, "stats") else source
    lines: list[str] = []

    def metric(name: str, kind: str, text: str, samples: list[tuple[str, Any]]) -> None:
        if samples:
            lines.extend([f"# HELP {name} {text}", f"# TYPE {name} {kind}"])
            lines.extend(f"{name}{labels} {float(value):g}" for labels, value in samples)

    for key, name, kind, text in _GAUGES:
        if key in stats:
            metric(name, kind, text, [("", stats[key])])
    for key, name, text in (("rejected", "dpex_rejected_total", "Messages refused, by reason."),
                            ("dropped", "dpex_dropped_total",
                             "Results not used and recovery actions, by reason."),
                            ("backups", "dpex_backups_total",
                             "Stragglers' batches computed again: launched, won, wasted.")):
        metric(name, "counter", text, [(f'{{reason="{_label(r)}"}}', n)
                                       for r, n in sorted(stats.get(key, {}).items())])
    workers = sorted(stats.get("workers", {}).items())
    for key, name, kind, text in (
            ("batches", "dpex_worker_batches_total", "counter", "Results of each worker."),
            ("batches_per_s", "dpex_worker_batches_per_second", "gauge",
             "Each worker's batches per second since it was first ready.")):
        metric(name, kind, text, [(f'{{worker="{w}",node="{_label(info.get("node_ip"))}"}}',
                                   info[key]) for w, info in workers if key in info])
    latency = stats.get("batch_latency") or {}
    metric("dpex_batch_latency_seconds", "gauge",
           "From a batch being ready in a worker to the training loop holding it, "
           "recent batches.",
           [(f'{{quantile="{q}"}}', latency[key] / 1e3)
            for q, key in (("0.5", "p50_ms"), ("0.99", "p99_ms")) if key in latency])
    metric("dpex_recoveries_total", "counter", "Worker restarts.",
           [("", len(stats["recoveries"]))] if "recoveries" in stats else [])
    return "\n".join(lines) + "\n"
