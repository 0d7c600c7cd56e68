"""A short soak: the trainer's RSS and open descriptors stay flat while batches stream."""

import json
import os
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(240)]


def test_short_soak_keeps_rss_and_fds_flat(tmp_path):
    out = tmp_path / "soak.json"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "soak.py"), "--batches", "15000",
         "--every", "0.5", "--json", str(out)],
        capture_output=True, text=True, timeout=200, env=env, cwd=ROOT)
    assert out.exists(), proc.stdout[-2000:] + proc.stderr[-3000:]
    result = json.loads(out.read_text())
    assert result["samples"][-1]["batches"] == 15000 and len(result["samples"]) >= 8
    assert result["fd_growth"] <= 0, result["samples"]
    assert result["rss_growth_mib"] <= 20, result["samples"]
    assert proc.returncode == 0, proc.stdout[-2000:]
