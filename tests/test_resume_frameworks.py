"""Lightning and Accelerate, unmodified, checkpoint a DpexDataLoader mid-epoch and resume
it: the steps after the resume are exactly those of an uninterrupted run with torch's
DataLoader (batches, worker RNG draws and losses).

Each script (tests/lightning_resume_app.py, tests/accelerate_resume_app.py) runs as a
user runs it, in fresh processes that start their own Ray: the torch run uninterrupted
(the reference) beside the dpex run that is preempted after a checkpoint, then the dpex
run that resumes from it.
"""

import os
import random
import sys

import numpy as np
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


def test_lightning_resumes_a_ddp_run_on_fewer_devices_with_the_same_global_stream(tmp_path):
    """Issue 28: a DDP fit on 2 devices checkpointed mid-epoch (Lightning keeps rank 0's
    loader state), resumed on 1: the rest of the epoch is every sample the 2 ranks had
    not taken, in their global order, each with the augmentation its position gives."""
    pytest.importorskip("pytorch_lightning")
    from dpex.client.resume._reshard import epoch_order
    from dpex.server._rng import sample_seed, seed_sample

    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    script = os.path.join(HERE, "lightning_reshard_app.py")
    for mode in ("stop", "resume"):
        raycluster.run([sys.executable, script, "--mode", mode, "--out", str(tmp_path)], env)
    stop = [torch.load(tmp_path / f"stop_rank{r}.pt", weights_only=False) for r in range(2)]
    resume = torch.load(tmp_path / "resume_rank0.pt", weights_only=False)
    assert [s["world_size"] for s in stop] == [2, 2] and resume["world_size"] == 1
    seed = resume["seed"]
    assert {s["seed"] for s in stop} == {seed}
    # the 2 ranks' steps of epoch 1 before the checkpoint, in the job's global order
    before_steps = [[s for s in rank["steps"] if s[0] == 1] for rank in stop]
    assert [len(steps) for steps in before_steps] == [2, 2]
    before = []
    for step in range(2):
        for j in range(len(before_steps[0][step][2])):
            before += [(int(steps[step][2][j]), float(steps[step][3][j])) for steps in before_steps]
    after = [(int(i), float(a)) for s in resume["steps"] if s[0] == 1
             for i, a in zip(s[2], s[3], strict=True)]
    order = epoch_order(40, True, seed, 1).tolist()  # epoch 1, as DistributedSampler orders it
    assert [i for i, _ in before] == order[:16] and [i for i, _ in after] == order[16:]
    # each sample's augmentation is the one its position in the epoch gives, on 2 ranks
    # as on 1: what the uninterrupted run drew for it
    saved = random.getstate(), np.random.get_state()
    with torch.random.fork_rng(devices=[]):
        expected = []
        for position in range(40):
            seed_sample(sample_seed(seed, 1, position))
            expected.append(torch.rand(()).item())
    random.setstate(saved[0])
    np.random.set_state(saved[1])
    assert [a for _, a in before + after] == expected
