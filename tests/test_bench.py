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
