"""scripts/bench.py runs end to end (a smoke run; figures live in docs/BENCHMARKS.md)."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.mark.timeout(240)
def test_bench_quick_run_writes_table_json_and_plot(tmp_path):
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "--quick",
         "--scenarios", "small", "cpu", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=220, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    for scenario in ("small", "cpu"):
        for loader in ("torch", "dpex"):
            assert data["results"][scenario][loader]["batches_per_s"]["median"] > 0
    assert "| small | dpex |" in proc.stdout and (tmp_path / "bench.png").stat().st_size > 5000


def test_scale_model_prints_the_saturation_point():
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "scale_model.py"), "--scenario", "small",
         "--trainer-us", "100", "--bandwidth-gbps", "10", "--max-workers", "64"],
        capture_output=True, text=True, timeout=120, cwd=ROOT)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "one rank saturates at 10000 batches/s" in proc.stdout  # 1 / 100 µs
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["1", "2", "4", "8", "16", "32", "64"]
    assert rows[1].endswith("| workers |")  # one worker cannot feed 10,000 batches/s
    assert rows[-1].endswith("| trainer CPU |")  # 64 can: the rank's CPU is the limit
