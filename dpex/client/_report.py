"""What ``loader.stats()`` says of an iterator (docs/STATS.md): its driver's counters,
its scheduler's and autoscaler's figures and its session's traffic, in one dict."""

from __future__ import annotations

import time
from typing import Any

from dpex._stats import LoaderStats
from dpex.client._elastic import mean

__all__ = ["iterator_stats"]


def iterator_stats(d: Any, epoch_s: float, batch_latency: dict, wait: bool = True
                   ) -> LoaderStats:
    """The stats of the iterator that drives ``d`` (an ``EpochDriver``). With
    ``wait=False`` (``__del__``) the session's counters are read from this thread, not
    copied on the loop thread."""
    if wait and d.loop.running:
        session = d.loop.run(d.session.snapshot(), timeout=5.0)
    else:  # the loop thread is gone (nothing changes them), or not to be waited for
        session = d.session.counters()
    sched, scaler = d.sched, d.elastic.autoscaler
    return {
        "epoch": sched.epoch,
        "epoch_s": epoch_s,
        "data_wait_s": d.wait_s,
        "data_wait_share": d.wait_s / epoch_s if epoch_s > 0 else 0.0,
        "workers_ready": len(d.ready),
        "workers": sched.workers.stats(time.monotonic(), d.runtime.workers.warm),
        "credits_in_flight": sched.in_flight,
        "worker_batch_s": mean(sched.batch_times.copy()),
        "batch_latency": batch_latency,
        "dataset_bytes": d.shipment.size,
        "dataset_reused": d.shipment.reused,
        "dataset_fallbacks": d.shipment.fallbacks,
        **session,
        "dropped": dict(sched.counters),
        "backups": sched.backups.stats(),
        "recoveries": [dict(r) for r in sched.recoveries.copy()],
        **({"autoscale": scaler.report(sched.num_workers)} if scaler is not None else {}),
    }
