"""HF Accelerate and transformers.Trainer, unmodified, on the embedded default.

tests/accelerate_app.py runs the same training with torch's DataLoader through
``accelerator.prepare`` (or the stock Trainer) and with dpex through
``dpex.accelerate.prepare_data_loader`` (or a Trainer that uses it): batches, losses,
gathered evaluation outputs and final weights must be equal, and the dpex run's items
must have been made by Ray workers. One process, and two ranks under torchrun.
"""

import os
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


def run_both(app: str, tmp_path, ranks: int = 1) -> tuple[list[dict], list[dict]]:
    """The script with torch's loader and with dpex's, at the same time (alone, or as
    ``ranks`` ranks under torchrun); each rank's record of each."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    cmds, outs = [], [tmp_path / loader for loader in ("torch", "dpex")]
    for out in outs:
        out.mkdir()
        cmd = [APP, "--loader", out.name, "--app", app, "--out", str(out)]
        if ranks > 1:
            cmd = ["-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                   "--master_addr=127.0.0.1", f"--master_port={raycluster.free_port()}", *cmd]
        cmds.append([sys.executable, *cmd])
    raycluster.run_together(cmds, env)
    theirs, ours = ([torch.load(p, weights_only=False) for p in sorted(out.glob("rank*.pt"))]
                    for out in outs)
    return theirs, ours


def made_by_ray_workers(record: dict) -> bool:
    """Every item was made in a Ray worker process (its raylet's pid, never 0)."""
    return bool(record["pids"]) and 0 not in record["pids"]


@pytest.mark.parametrize("ranks", [1, 2])
def test_accelerate_training_equals_a_plain_torch_loop(tmp_path, ranks):
    theirs, ours = run_both("accelerate", tmp_path, ranks)
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
    (theirs,), (ours,) = run_both("trainer", tmp_path)
    assert len(ours["batches"]) == len(theirs["batches"]) > 0
    assert_same(theirs["batches"], ours["batches"], "batches")
    assert_same(theirs["weights"], ours["weights"], "final weights")
    assert ours["eval_loss"] == theirs["eval_loss"]
    assert ours["classes"] == ["DpexDataLoader"]
    assert made_by_ray_workers(ours) and set(theirs["pids"]) == {0}
