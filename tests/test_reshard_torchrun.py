"""A job resumed on another number of ranks under torchrun (gloo): 2 -> 4 (growing: the
new ranks pad) and 4 -> 3 (shrinking to a count the old one does not divide), the
resumed runs with fresh and with persistent workers (3 -> 2 and the other layouts'
rules run in process: tests/test_reshard.py).
tests/reshard_app.py is the training script; a launch also runs the uninterrupted job
of its own rank count, the reference for the epoch after a resumed one and the source
of the next launch's state.

The ranks join one Ray cluster (``ray start``, this machine's cores), as the ranks of
a job on a cluster do; the embedded default under torchrun is tested in
tests/test_training_modes.py. (9 ranks each starting Ray would take minutes here.)"""

import os
import sys

import pytest
import raycluster
import torch

pytestmark = [pytest.mark.slow, pytest.mark.timeout(900)]

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
APP = os.path.join(HERE, "reshard_app.py")
sys.path.insert(0, HERE)
import reshard_app  # noqa: E402


def torchrun(ranks: int, *args: str, env: dict) -> None:
    raycluster.run([sys.executable, "-m", "torch.distributed.run", f"--nproc_per_node={ranks}",
                    "--master_addr=127.0.0.1", f"--master_port={raycluster.free_port()}",
                    APP, *args], env, timeout=400)


def global_stream(per_rank: list[list[list]]) -> list:
    """The job's entries in its global order: step by step, entry by entry, rank by rank
    (the ranks' g-th batches together are one stretch of the epoch)."""
    out = []
    for step in range(len(per_rank[0])):
        for j in range(len(per_rank[0][step])):
            out += [batches[step][j] for batches in per_rank]
    return out


def indices(entries: list) -> list[int]:
    return [i for i, _ in entries]


def check_transition(source: list[dict], target: list[dict], reference: list[dict]) -> None:
    """``reference``: the uninterrupted job on the target's number of ranks."""
    before_ranks, after_ranks = len(source), len(target)
    full = [rank["full"][0] for rank in source]  # the uninterrupted epoch 0, per rank
    uninterrupted = global_stream(full)
    before = global_stream([batches[:reshard_app.STOP_AT] for batches in full])
    padding = len(uninterrupted) - reshard_app.N  # DistributedSampler's, for the old ranks
    rest = uninterrupted[len(before):len(uninterrupted) - padding]
    assert not set(indices(before)) & set(indices(rest))
    assert sorted(indices(before) + indices(rest)) == list(range(reshard_app.N))
    for variant in ("resumed_fresh", "resumed_persistent"):
        resumed = global_stream([rank[variant][0] for rank in target])
        # every sample no rank had taken, once, in the uninterrupted job's global order,
        # with the very same augmentation (per-sample seeding): bit for bit
        assert resumed[:len(rest)] == rest, variant
        # then the new ranks' padding: repeats of the rest's first samples
        extra = indices(resumed[len(rest):])
        assert len(extra) < after_ranks and extra == indices(rest)[:len(extra)], variant
        # the next epoch is what the new number of ranks gives from the start
        for r in range(after_ranks):
            assert target[r][variant][1] == reference[r]["full"][1], (variant, r)
    assert before_ranks != after_ranks


def test_a_job_resumes_on_another_number_of_ranks_with_the_same_global_stream(tmp_path):
    # (ranks, the launch whose state it resumes, the launch with its uninterrupted job)
    launches = [(2, None, 0), (4, 0, 1), (3, 1, 2)]
    records = []
    with raycluster.ray_head() as (address, env):
        env["RAY_ADDRESS"] = address
        for number, (ranks, source, reference) in enumerate(launches):
            out = tmp_path / f"launch{number}"
            out.mkdir()
            args = ["--out", str(out)]
            if source is not None:
                args += ["--resume", str(tmp_path / f"launch{source}" / "state_rank0.pt")]
            if reference != number:
                args.append("--no-full")
            torchrun(ranks, *args, env=env)
            records.append([torch.load(out / f"rank{r}.pt", weights_only=False)
                            for r in range(ranks)])
    for number, (_, source, reference) in enumerate(launches):
        if source is not None:
            check_transition(records[source], records[number], records[reference])
    # a state is small and plain: what torch.load(weights_only=True) reads
    state = torch.load(tmp_path / "launch1" / "state_rank0.pt", weights_only=True)
    assert state["layout"]["num_replicas"] == 4 and state["world_size"] == 4
