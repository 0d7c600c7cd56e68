"""PyTorch Lightning, unmodified, on the embedded default: the same script with torch's
DataLoader and with DpexDataLoader gives the same batches, losses and predictions.

tests/lightning_app.py is the script; each run is a fresh process started as a user
starts it (no cluster, no RAY_ADDRESS), so every process starts its own Ray. The
``ddp`` launch serves two tests: its ranks fit twice (plain, then autoscaled).
"""

import os
import sys

import pytest
import raycluster
import torch
from dsets import assert_same

pytest.importorskip("pytorch_lightning")
pytestmark = [pytest.mark.slow, pytest.mark.timeout(600)]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
APP = os.path.join(HERE, "lightning_app.py")


def launch_both(scenario: str, out) -> None:
    """The script with torch's loader and with dpex's, at the same time, writing to
    ``out/torch`` and ``out/dpex``."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    env["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p)
    for loader in ("torch", "dpex"):
        (out / loader).mkdir()
    raycluster.run_together([[sys.executable, APP, "--loader", loader, "--scenario", scenario,
                              "--out", str(out / loader)] for loader in ("torch", "dpex")], env)


def records(out, prefix: str = "rank") -> tuple[list[dict], list[dict]]:
    """Each rank's record of each loader (``prefix``: which fit's, see lightning_app's
    ``ddp``)."""
    theirs, ours = ([torch.load(p, weights_only=False)
                     for p in sorted((out / loader).glob(f"{prefix}*.pt"))]
                    for loader in ("torch", "dpex"))
    return theirs, ours


def run_both(scenario: str, tmp_path) -> tuple[list[dict], list[dict]]:
    launch_both(scenario, tmp_path)
    return records(tmp_path)


@pytest.fixture(scope="module")
def ddp_launch(tmp_path_factory):
    """One launch of the ``ddp`` scenario for each loader (its ranks fit twice: plain,
    then autoscaled), shared by the tests of both fits."""
    out = tmp_path_factory.mktemp("ddp")
    launch_both("ddp", out)
    return out


def assert_same_training(theirs: dict, ours: dict) -> None:
    assert len(ours["train"]) == len(theirs["train"]) > 0
    assert_same(theirs["train"], ours["train"], "training batches")
    assert_same(theirs["val"], ours["val"], "validation batches")
    assert_same(theirs["loss"], ours["loss"], "losses")


def assert_dpex_workers_made(ours: dict, theirs: dict) -> None:
    """dpex's items came from Ray worker processes (a raylet's pid), torch's never."""
    assert ours["pids"] and 0 not in ours["pids"]
    assert theirs["pids"] == {0}


def test_fit_with_datamodule_and_direct_loaders_then_predict_equal_torch(tmp_path):
    (theirs,), (ours,) = run_both("single", tmp_path)
    assert_same_training(theirs, ours)
    assert_same(theirs["predictions"], ours["predictions"], "predictions")
    for what in ("fit_datamodule", "fit_direct"):
        assert ours[what] == {**theirs[what], "class": "DpexDataLoader",
                              "distribute_mode": True}, what
    # predict: Lightning re-created the loader around its own batch sampler wrapper
    assert ours["predict"]["class"] == "DpexDataLoader"
    assert ours["predict"]["distribute_mode"] is True
    assert ours["predict"]["batch_sampler"] == "_IndexBatchSamplerWrapper"
    assert_dpex_workers_made(ours, theirs)


@pytest.mark.parametrize("strategy", ["ddp", "ddp_spawn"])
def test_ddp_ranks_get_torchs_per_rank_batches_from_dpex_workers(request, tmp_path, strategy):
    if strategy == "ddp":  # (the shared launch, started only where a test asks for it)
        theirs, ours = records(request.getfixturevalue("ddp_launch"))
    else:
        theirs, ours = run_both(strategy, tmp_path)
    assert len(theirs) == len(ours) == 2
    for rank in range(2):
        assert_same_training(theirs[rank], ours[rank])
        # Lightning re-created the loader with a DistributedSampler and kept dpex
        assert ours[rank]["fit"]["sampler"] == "DistributedSampler"
        assert ours[rank]["fit"]["class"] == "DpexDataLoader"
        assert ours[rank]["fit"]["distribute_mode"] is True
        assert ours[rank]["fit"]["num_workers"] == "2"
        assert_dpex_workers_made(ours[rank], theirs[rank])
    # In its epoch (5 steps of 4 items) each rank saw its own half of the data.
    seen = [{round(v * 10) for x, _ in ours[r]["train"] for v in x[:, 0].tolist()}
            for r in range(2)]
    assert not seen[0] & seen[1] and seen[0] | seen[1] == set(range(40))


def test_ddp_keeps_an_autoscaled_loader_and_its_per_rank_items(ddp_launch):
    theirs, ours = records(ddp_launch, prefix="autoscale_rank")
    assert len(theirs) == len(ours) == 2
    for rank in range(2):
        # Lightning re-created the loader with a DistributedSampler: the policy survived
        assert ours[rank]["fit"]["num_workers"].startswith("Autoscale(min=1, max=3")
        assert ours[rank]["fit"]["sampler"] == "DistributedSampler"
        assert_dpex_workers_made(ours[rank], theirs[rank])
        # the same items in the same order (the third feature is a worker RNG draw,
        # seeded per batch here and per worker by torch)
        assert len(ours[rank]["train"]) == len(theirs[rank]["train"]) == 5
        for (x, y), (tx, ty) in zip(ours[rank]["train"], theirs[rank]["train"], strict=True):
            assert torch.equal(x[:, :2], tx[:, :2]) and torch.equal(y, ty)
