"""The start chain's marks (dpex/_start_trace.py) and how scripts/bench_cold_start.py
reads them into links."""

import json
import os
import sys
import time

from dpex import _start_trace

sys.path.insert(0, os.path.join(os.path.dirname(os.path.dirname(os.path.abspath(__file__))),
                                "scripts"))
import bench_cold_start  # noqa: E402


def test_no_file_named_no_mark_written(tmp_path, monkeypatch):
    monkeypatch.delenv(_start_trace.ENV, raising=False)
    monkeypatch.chdir(tmp_path)
    _start_trace.mark("iter")
    assert list(tmp_path.iterdir()) == []


def test_a_mark_is_one_line_with_time_pid_cpu_and_extras(tmp_path, monkeypatch):
    path = tmp_path / "trace.jsonl"
    monkeypatch.setenv(_start_trace.ENV, str(path))
    before = time.time()
    _start_trace.mark("iter")
    _start_trace.mark("serve", worker=3)
    lines = [json.loads(line) for line in path.read_text().splitlines()]
    assert [r["link"] for r in lines] == ["iter", "serve"]
    assert lines[1]["worker"] == 3 and lines[0]["pid"] == os.getpid()
    assert before <= lines[0]["t"] <= lines[1]["t"] <= time.time()
    assert 0 < lines[0]["cpu"] <= time.process_time()


def test_a_process_start_is_read_from_the_kernel(monkeypatch):
    started = _start_trace.process_started()
    # This process started before the test ran, and within the test session's life.
    assert started is not None and time.time() - 3600 < started < time.time()
    assert _start_trace.process_started(2**22 + 12345) is None  # (no such process)


def test_the_bench_reads_the_marks_of_each_process_into_links():
    def rec(t, pid, link, cpu=0.0, **extra):
        return {"t": 100.0 + t, "pid": pid, "link": link, "cpu": cpu, **extra}

    trace = [rec(0.0, 1, "build"), rec(0.1, 1, "host asked"), rec(0.2, 1, "ship", 2.0),
             rec(0.3, 1, "shipped", 2.1), rec(0.4, 1, "workers asked", 2.2),
             rec(1.5, 2, "host init", 1.2, started=99.0),  # Ray's idle worker: earlier
             rec(1.6, 2, "forkserver ready", 1.3, started=101.6),
             rec(3.0, 3, "base forked", 0.0), rec(3.2, 3, "base loaded", 0.2),
             rec(3.3, 4, "session forked", 0.0), rec(3.35, 4, "batch 0 sent", 0.04),
             rec(3.4, 1, "first batch", 2.3)]
    bars = {b["label"]: b for b in bench_cold_start.chain(trace)}
    assert "connect" not in bars  # (not marked: Ray ran before)
    assert abs(bars["pickle"]["start"] - 0.2) < 1e-9 and abs(bars["pickle"]["cpu"] - 0.1) < 1e-9
    assert abs(bars["host actor"]["start"] - 0.1) < 1e-9  # from when it was asked for
    assert abs(bars["host actor"]["cpu"] - 1.2) < 1e-9  # (its whole process's)
    assert abs(bars["forkserver (imports)"]["end"] - 3.0) < 1e-9
    assert bars["forkserver (imports)"]["cpu"] is None  # (its own CPU is not marked)
    assert abs(bars["wait"]["end"] - 3.4) < 1e-9
