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


@pytest.mark.timeout(240)
@pytest.mark.parametrize("page", ["README.md", "docs/STATS.md", "docs/WARM_WORKERS.md",
                                  "docs/RESUME.md", "docs/AUTOSCALE.md"])
def test_the_examples_of_a_page_run_on_the_embedded_local_ray(page):
    blocks = python_blocks(os.path.join(ROOT, page))
    assert blocks, f"{page} has no python example"
    env = {k: v for k, v in os.environ.items() if k != "RAY_ADDRESS"}
    for code in blocks:
        proc = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                              timeout=110, env=env, cwd=ROOT)
        assert proc.returncode == 0, proc.stderr[-3000:]
