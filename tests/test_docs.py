"""The examples of README.md and docs pages run as written (a user copies them first)."""

import os
import re
import subprocess
import sys

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


def python_blocks(path):
    with open(path, encoding="utf-8") as f:
        return re.findall(r"```python\n(.*?)```", f.read(), flags=re.S)


@pytest.mark.subprocess
@pytest.mark.timeout(480)
@pytest.mark.parametrize("page", ["README.md", "docs/STATS.md", "docs/WARM_WORKERS.md",
                                  "docs/RESUME.md", "docs/AUTOSCALE.md"])
def test_the_examples_of_a_page_run_on_the_embedded_local_ray(page):
    blocks = python_blocks(os.path.join(ROOT, page))
    assert blocks, f"{page} has no python example"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    for code in blocks:
        # (a limit for a hang, not a speed check: RESUME.md's resharding example starts
        # 11 iterators' workers)
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=220, env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_the_demo_compares_alternating_epochs_and_states_the_remote_cpu_it_measured():
    """The README's demo command (scripts/demo.sh runs this script), on a short epoch:
    identical batches, one row per loader, and the measured CPU figure for remote
    workers rather than a promise."""
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    proc = subprocess.run([sys.executable, os.path.join(ROOT, "scripts", "demo.py"),
                           "--items", "256", "--epochs", "2"],
                          capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    out = proc.stdout
    assert "batches identical to torch's: yes" in out
    for loader in ("torch", "dpex", "dpex-remote"):
        assert re.search(rf"^\| {loader} \| [\d.]+ \| [\d.]+ \| [\d.]+ \|$", out, re.M), out
    remote = re.search(r"this node would spend ([\d.]+) ms of CPU per batch on data instead of "
                       r"torch's ([\d.]+) ms", out)
    assert remote and float(remote.group(1)) > 0 and float(remote.group(2)) > 0, out
