"""Lightning and Accelerate, unmodified, checkpoint a DpexDataLoader mid-epoch and resume
it: the steps after the resume are exactly those of an uninterrupted run with torch's
DataLoader (batches, worker RNG draws and losses).

Each script (tests/lightning_resume_app.py, tests/accelerate_resume_app.py) runs as a
user runs it, in fresh processes that start their own Ray: the torch run uninterrupted
(the reference) beside the dpex run that is preempted after a checkpoint, then the dpex
run that resumes from it.
"""

import os
import sys

import pytest
import raycluster
import torch
from dsets import assert_same

pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)


def preempt_and_resume(app: str, tmp_path) -> tuple[list, list, list]:
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    script = os.path.join(HERE, app)
    torch_out, dpex_out = tmp_path / "torch", tmp_path / "dpex"
    torch_out.mkdir()
    dpex_out.mkdir()

    def cmd(loader, mode, out):
        return [sys.executable, script, "--loader", loader, "--mode", mode, "--out", str(out)]

    raycluster.run_together([cmd("torch", "full", torch_out), cmd("dpex", "stop", dpex_out)], env)
    raycluster.run(cmd("dpex", "resume", dpex_out), env)
    full, stop, resume = (torch.load(path, weights_only=False)["steps"] for path in (
        torch_out / "full.pt", dpex_out / "stop.pt", dpex_out / "resume.pt"))
    return full, stop, resume


@pytest.mark.parametrize("app", ["lightning_resume_app.py", "accelerate_resume_app.py"])
def test_a_framework_resumes_a_dpex_loader_mid_epoch_exactly(app, tmp_path):
    if app.startswith("lightning"):
        pytest.importorskip("pytorch_lightning")
    else:
        pytest.importorskip("accelerate")
    full, stop, resume = preempt_and_resume(app, tmp_path)
    # Preempted mid-way through the second epoch: some steps of it before, some after.
    assert {s[0] for s in stop} == {0, 1} and {s[0] for s in resume} == {1}
    assert len(stop) + len(resume) == len(full)
    assert_same(full, stop + resume, "steps")
