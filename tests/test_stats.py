"""loader.stats(): the data-stall share, per-worker rates, and the Prometheus text."""

import time

import dsets
import pytest

from dpex import DpexDataLoader, stats_prometheus
from dpex._stats import Latencies


def test_prometheus_text_has_help_type_and_escaped_labels():
    text = stats_prometheus({
        "epoch": 2, "data_wait_s": 1.5, "data_wait_share": 0.25, "credits_in_flight": 4,
        "dropped": {"duplicate": 3}, "rejected": {},
        "workers": {0: {"node_ip": 'a"b', "batches": 7, "batches_per_s": 3.5}},
        "recoveries": [{"worker": 0}]})
    lines = text.splitlines()
    assert "# TYPE dpex_data_wait_share gauge" in lines
    assert not any(line.startswith("dpex_batch_latency") for line in lines)  # none: no series
    assert "dpex_data_wait_share 0.25" in lines and "dpex_batches_in_flight 4" in lines
    assert 'dpex_dropped_total{reason="duplicate"} 3' in lines
    assert 'dpex_worker_batches_total{worker="0",node="a\\"b"} 7' in lines
    assert "dpex_recoveries_total 1" in lines
    assert not any(line.startswith("dpex_rejected_total") for line in lines)  # none: no series
    for line in lines:  # every sample has its HELP and TYPE before it
        if not line.startswith("#"):
            name = line.split("{")[0].split(" ")[0]
            assert f"# TYPE {name} gauge" in lines or f"# TYPE {name} counter" in lines


def test_latency_percentiles_by_nearest_rank_over_the_latest_batches():
    lat = Latencies(keep=100)
    assert lat.summary() is None
    lat.add(0, 5_000_000)  # no time in the message: not counted
    assert lat.summary() is None
    for ms in range(1, 201):  # 1..200 ms; the latest 100 are 101..200
        lat.add(1_000_000_000, 1_000_000_000 + ms * 1_000_000)
    assert lat.summary() == {"n": 100, "p50_ms": 150.0, "p99_ms": 199.0, "max_ms": 200.0}
    text = stats_prometheus({"batch_latency": lat.summary()})
    assert 'dpex_batch_latency_seconds{quantile="0.99"} 0.199' in text.splitlines()


@pytest.mark.usefixtures("ray_session")
@pytest.mark.parametrize("slow", ["dataset", "training loop"])
def test_the_stall_share_says_which_side_is_slow(slow):
    dataset = dsets.Slow(0.05, n=24) if slow == "dataset" else dsets.Squares(24, max_sleep=0)
    loader = DpexDataLoader(dataset, batch_size=2, num_workers=2, distribute_mode=True,
                            persistent_workers=True)
    with loader:
        for _ in range(2):  # the first epoch includes starting the workers
            for _ in loader:
                if slow == "training loop":
                    time.sleep(0.05)
        stats = loader.stats()
    share = stats["data_wait_share"]
    assert 0 <= stats["data_wait_s"] <= stats["epoch_s"]
    assert share > 0.5 if slow == "dataset" else share < 0.2, stats
    assert sum(w["batches"] for w in stats["workers"].values()) == 24  # 2 epochs × 12
    assert all(w["batches_per_s"] > 0 for w in stats["workers"].values())
    assert "dpex_data_wait_share" in stats_prometheus(loader)
    # The last epoch's 12 batches. A batch waits in the window for a slow loop (several
    # steps of 50 ms); for a slow dataset it is taken as soon as it arrives.
    latency = stats["batch_latency"]
    assert latency["n"] == 12 and 0 < latency["p50_ms"] <= latency["p99_ms"] <= latency["max_ms"]
    assert latency["p50_ms"] < 40 if slow == "dataset" else latency["p50_ms"] > 50, latency


@pytest.mark.usefixtures("inprocess")  # (dpex's workers in this process)
def test_stats_after_a_loop_left_with_break_are_that_iterators():
    loader = DpexDataLoader(dsets.Squares(40, max_sleep=0), batch_size=2, num_workers=2,
                            distribute_mode=True)
    with loader:
        assert len(list(loader)) == 20  # a whole epoch first: its iterator's figures stay
        assert loader.stats()["received"] == 20
        for n, _ in enumerate(loader, 1):
            if n == 3:
                break
        stats = loader.stats()
    assert stats and stats["epoch"] == 1 and 3 <= stats["received"] < 20, stats
    assert sum(w["batches"] for w in stats["workers"].values()) >= 3
