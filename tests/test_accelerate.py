"""HF Accelerate and transformers.Trainer, unmodified, on the embedded default.

tests/accelerate_app.py runs the same training with torch's DataLoader through
``accelerator.prepare`` (or the stock Trainer) and with dpex through
``dpex.accelerate.prepare_data_loader`` (or a Trainer that uses it): batches, losses,
gathered evaluation outputs and final weights must be equal, and the dpex run's items
must have been made by Ray workers. One process, and two ranks under torchrun.
"""

import os
import subprocess
import sys

import pytest
import raycluster
import torch
from dsets import assert_same

pytest.importorskip("accelerate")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
APP = os.path.join(HERE, "accelerate_app.py")


def run(loader: str, app: str, out, ranks: int = 1) -> list[dict]:
    out.mkdir()
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    cmd = [APP, "--loader", loader, "--app", app, "--out", str(out)]
    if ranks > 1:
        cmd = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
               "--master_addr=127.0.0.1", f"--master_port={raycluster.free_port()}", *cmd]
    proc = subprocess.run([sys.executable, *cmd], capture_output=True, text=True,
                          timeout=500, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-6000:]
    return [torch.load(p, weights_only=False) for p in sorted(out.glob("rank*.pt"))]


def made_by_ray_workers(record: dict) -> bool:
    """Every item was made in a Ray worker process (its raylet's pid, never 0)."""
    return bool(record["pids"]) and 0 not in record["pids"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_accelerate_training_equals_a_plain_torch_loop(tmp_path, ranks):
    theirs = run("torch", "accelerate", tmp_path / "torch", ranks)
    ours = run("dpex", "accelerate", tmp_path / "dpex", ranks)
    assert len(theirs) == len(ours) == ranks
    for t, o in zip(theirs, ours, strict=True):
        assert len(o["batches"]) == len(t["batches"]) > 0
        assert_same(t["batches"], o["batches"], f"rank {o['rank']} batches")
        assert_same(t["loss"], o["loss"], "losses")
        assert o["sync"] == t["sync"] and not all(o["sync"])  # accumulation steps as theirs
        assert_same(t["gathered"], o["gathered"], "gather_for_metrics")
        assert_same(t["weights"], o["weights"], "final weights")
        assert o["classes"] == ["DpexDataLoader", "DpexDataLoader"]
        assert made_by_ray_workers(o) and set(t["pids"]) == {0}
        assert o["dropped_warning"] and o["dropped_class"] == "DataLoader"
    # gather_for_metrics drops the duplicated remainder: every eval item once per epoch
    assert sum(len(g) for g in ours[0]["gathered"]) == 2 * 13


def test_transformers_trainer_with_dpex_loaders_equals_the_stock_trainer(tmp_path):
    pytest.importorskip("transformers")
    (theirs,) = run("torch", "trainer", tmp_path / "torch")
    (ours,) = run("dpex", "trainer", tmp_path / "dpex")
    assert len(ours["batches"]) == len(theirs["batches"]) > 0
    assert_same(theirs["batches"], ours["batches"], "batches")
    assert_same(theirs["weights"], ours["weights"], "final weights")
    assert ours["eval_loss"] == theirs["eval_loss"]
    assert ours["classes"] == ["DpexDataLoader"]
    assert made_by_ray_workers(ours) and set(theirs["pids"]) == {0}
