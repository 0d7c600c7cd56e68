"""DDP ranks, DataParallel and the examples, on the embedded default.

Each script runs as a user runs it on this machine: no cluster, no RAY_ADDRESS, so
every process (every DDP rank) starts a Ray instance of its own with this
machine's cores, and its workers reserve nothing.
"""

import os
import re
import sys

import dsets
import pytest
import raycluster
import torch
from dsets import assert_same
from torch.utils.data.distributed import DistributedSampler

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]


@pytest.fixture(scope="module")
def env():
    """The environment of a user who has no cluster (and this checkout on the path)."""
    clean = {k: v for k, v in os.environ.items() if not k.startswith("RAY_")}
    clean["PYTHONPATH"] = os.pathsep.join(p for p in (ROOT, clean.get("PYTHONPATH")) if p)
    return clean


def run(cmd, env, timeout=240):
    return raycluster.run(cmd, env, timeout).stdout


def torchrun_cmd(script, *args):
    return [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node=2",
            "--master_addr=127.0.0.1", f"--master_port={raycluster.free_port()}", script, *args]


def torchrun(script, *args, env):
    return run(torchrun_cmd(script, *args), env)


def test_ddp_ranks_get_exactly_torchs_batches_from_their_own_workers(env, tmp_path):
    # 2 ranks x 2 workers on this 2-core machine, each rank with the embedded default
    torchrun(os.path.join(HERE, "ddp_rank.py"), "--out", str(tmp_path), env=env)
    dataset = dsets.NoisySquares(45)
    got = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    for rank in range(2):
        torch.manual_seed(100 + rank)
        sampler = DistributedSampler(dataset, num_replicas=2, rank=rank, seed=3)
        loader = dsets.torch_loader(dataset, batch_size=4, sampler=sampler, num_workers=2)
        expected = []
        for epoch in range(2):
            sampler.set_epoch(epoch)
            expected.append(list(loader))
        assert_same(expected, got[rank]["epochs"], f"rank {rank}")
    # One stream per rank: different sessions, different worker processes.
    assert not set(got[0]["sessions"]) & set(got[1]["sessions"])
    assert not set(got[0]["pids"]) & set(got[1]["pids"])
    # Two fresh worker processes per epoch (not persistent), as torch's; the second
    # epoch's run on the first's warm workers, each session in a process of its own.
    assert len(set(got[0]["pids"])) == 4


def final_losses(out: str) -> list[str]:
    return sorted(re.findall(r"final loss (\S+)", out))


QUICK = ["--epochs", "1", "--max-batches", "4", "--batch-size", "50"]


def test_single_device_example_trains_the_same_with_dpex_and_torch_workers(env):
    script = os.path.join(ROOT, "examples", "single_device.py")
    dpex_out, torch_out = raycluster.run_together(
        [[sys.executable, script, *QUICK], [sys.executable, script, *QUICK, "--torch-loader"]],
        env, timeout=240)
    assert "dpex Ray workers" in dpex_out and "epoch 1/1" in dpex_out
    assert final_losses(dpex_out) == final_losses(torch_out) != []


def test_data_parallel_example_runs(env):
    out = run([sys.executable, os.path.join(ROOT, "examples", "data_parallel.py"), *QUICK], env)
    assert "DataParallel over" in out and len(final_losses(out)) == 1


def test_ddp_example_under_torchrun_and_mp_spawn(env):
    script = os.path.join(ROOT, "examples", "ddp.py")
    by_torchrun, by_spawn = raycluster.run_together(
        [torchrun_cmd(script, *QUICK),
         [sys.executable, script, "--spawn", "2", *QUICK, "--torch-loader"]], env, timeout=240)
    assert "DDP: 2 ranks on cpu (gloo)" in by_torchrun
    # dpex under torchrun and torch's workers under mp.spawn: the same training.
    assert len(final_losses(by_torchrun)) == 2
    assert final_losses(by_torchrun) == final_losses(by_spawn)


def test_accuracy_parity_script_finds_every_pair_bit_identical(env, tmp_path):
    out = run([sys.executable, os.path.join(ROOT, "scripts", "accuracy_parity.py"),
               "--epochs", "1", "--out", str(tmp_path / "ACC.md"),
               "--plot", str(tmp_path / "loss.png")], env)
    rows = [line for line in out.splitlines() if line.startswith("| ") and "Setting" not in line]
    assert len(rows) == 6 and all(row.endswith("| bit-identical |") for row in rows), out
    assert (tmp_path / "loss.png").stat().st_size > 10_000
    assert "every pair of loss curves is bit-identical" in (tmp_path / "ACC.md").read_text()


def test_mp_spawn_takes_the_loader_and_a_rank_that_ends_early_takes_nothing_with_it(
        env, tmp_path):
    run([sys.executable, os.path.join(HERE, "spawn_app.py"), "--out", str(tmp_path)], env)
    parent = torch.load(tmp_path / "parent.pt", weights_only=False)
    ranks = [torch.load(tmp_path / f"rank{r}.pt", weights_only=False) for r in range(2)]
    import spawn_app

    # Every process seeds torch with 5 before its epoch: all equal torch's epoch (indices,
    # and the worker seeds through the items' random draws).
    torch.manual_seed(5)
    expected = list(dsets.torch_loader(spawn_app.Noisy(), batch_size=4, shuffle=True,
                                       num_workers=2))
    assert_same(expected, parent["batches"], "parent's epoch")
    assert_same(expected, ranks[1]["batches"], "rank 1's epoch")
    assert_same(expected[:1], ranks[0]["batches"], "rank 0's one batch")
    assert ranks[0]["gcs"] != ranks[1]["gcs"]  # each rank has its own Ray


@pytest.mark.slow
def test_framework_examples_run(env):
    examples = {"lightning_example.py": "(loader: DpexDataLoader, distribute_mode=True)",
                "accelerate_example.py": "(batches from a DpexDataLoader)",
                "hf_trainer_example.py": "(batches from a DpexDataLoader)"}
    outs = raycluster.run_together(
        [[sys.executable, os.path.join(ROOT, "examples", name), "--epochs", "1"]
         for name in examples], env, timeout=280)
    for (name, done), out in zip(examples.items(), outs, strict=True):
        assert done in out, f"{name}: {out[-2000:]}"
