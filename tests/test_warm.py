"""Warm workers: a new iterator starts on the idle workers of the last one, and gets
exactly what fresh workers give (torch's batches, seeds, worker info, worker_init_fn
run again) from a fresh process per session; idle workers end on time, on request, or
with the trainer, and a worker that might still run user code is never reused."""

import os
import subprocess
import sys
import textwrap
import time

import dsets
import pytest
import torch
from dsets import assert_same, pids_alive

import dpex
from dpex import DpexDataLoader
from dpex.client._warm import POOL

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]



def wait_gone(pids, limit=20.0):
    return dsets.wait_gone(pids, limit)


def worker_pids(loader):
    return sorted(w["pid"] for w in loader.stats()["workers"].values())


def test_a_warm_worker_gives_exactly_what_a_fresh_one_gives():
    """Seeds, get_worker_info(), worker_init_fn and module state: what a fresh torch
    worker process sees, on the second and third iterator as on the first."""
    kw = {"batch_size": 4, "shuffle": True, "num_workers": 2, "worker_init_fn": dsets.mark_init}
    dpex.release_warm_workers()  # earlier tests' idle workers: the first iterator starts cold
    torch.manual_seed(21)
    theirs = [list(dsets.torch_loader(dsets.SeedProbe(), **kw)) for _ in range(3)]
    torch.manual_seed(21)
    loader = DpexDataLoader(dsets.SeedProbe(), distribute_mode=True, **kw)
    ours, warm, pids = [], [], []
    for _ in range(3):
        ours.append(list(loader))  # a fresh iterator each epoch (persistent_workers=False)
        stats = loader.stats()["workers"]
        warm.append(sorted(w["warm"] for w in stats.values()))
        pids.append(worker_pids(loader))
        assert POOL.wait_settled(20)
    assert_same(theirs, ours)  # init_marker "0," / "1,": worker_init_fn ran in a fresh process
    assert warm == [[False, False], [True, True], [True, True]]
    assert pids[0] == pids[1] == pids[2]  # the same Ray workers, no new actor


@pytest.mark.parametrize("hold_ref", [True, False], ids=["object-ref", "ray-calls"])
def test_a_dataset_that_reads_through_ray_works_in_every_session(hold_ref):
    """The second and later iterators run in sessions forked from the warm worker's
    forkserver: Ray calls there reach the trainer's cluster (no second cluster), and
    an object ref the dataset holds can be read there (and in the first session)."""
    import ray

    dataset = dsets.RayRefs(8, hold_ref)
    here = ray.get_runtime_context().gcs_address
    loader = DpexDataLoader(dataset, batch_size=4, num_workers=2, distribute_mode=True,
                            timeout=60)
    for epoch in range(3):
        batches = list(loader)
        assert [b[0].tolist() for b in batches] == [[[0, 1], [2, 3], [4, 5], [6, 7]],
                                                    [[8, 9], [10, 11], [12, 13], [14, 15]]]
        assert {a for b in batches for a in b[1]} == {here}, epoch
        assert POOL.wait_settled(20)
    assert all(w["warm"] for w in loader.stats()["workers"].values())


def test_ray_calls_in_every_session_see_the_trainers_namespace():
    """Issue 39, item 2: a warm worker's later sessions join the cluster as a new Ray
    job; it used to get an anonymous namespace of its own, so a named actor of the
    trainer's namespace was found in the first iterator and not in the second."""
    import ray

    @ray.remote(num_cpus=0)
    class Vocab:
        def size(self):
            return 7

    class ReadsTheVocab(torch.utils.data.Dataset):
        def __len__(self):
            return 2

        def __getitem__(self, i):
            import ray

            return ray.get(ray.get_actor("vocab").size.remote(), timeout=30) + i

    vocab = Vocab.options(name="vocab").remote()
    try:
        loader = DpexDataLoader(ReadsTheVocab(), batch_size=2, num_workers=1,
                                distribute_mode=True, timeout=60)
        for _ in range(2):  # the second runs in a process forked on the warm worker
            assert [b.tolist() for b in loader] == [[7, 8]]
            assert POOL.wait_settled(20)
        assert [w["warm"] for w in loader.stats()["workers"].values()] == [True]
    finally:
        ray.kill(vocab)


def test_tasks_a_session_starts_get_the_workers_runtime_env():
    """The rest of the job's view: a task the dataset starts inherits the worker's
    runtime_env in the first session (the actor's own) as in later ones (a new job)."""
    class ReadsATasksEnv(torch.utils.data.Dataset):
        def __len__(self):
            return 1

        def __getitem__(self, i):
            import os

            import ray

            @ray.remote(num_cpus=0)
            def read():
                return os.environ.get("DPEX_TEST_JOB_VIEW", "unset")

            return ray.get(read.remote(), timeout=60)

    env = {"env_vars": {"DPEX_TEST_JOB_VIEW": "kept"}}
    loader = DpexDataLoader(ReadsATasksEnv(), batch_size=None, num_workers=1,
                            distribute_mode=True, timeout=120,
                            ray_remote_args={"runtime_env": env})
    for epoch in range(2):
        assert list(loader) == ["kept"], f"iterator {epoch + 1}"
        assert POOL.wait_settled(20)
    assert [w["warm"] for w in loader.stats()["workers"].values()] == [True]


def test_idle_workers_end_after_their_timeout_and_on_release():
    loader = DpexDataLoader(dsets.Squares(8), batch_size=4, num_workers=2,
                            distribute_mode=True, warm_worker_timeout=2.0)
    assert len(list(loader)) == 2
    pids = worker_pids(loader)
    assert POOL.wait_settled(20)
    assert pids_alive(pids) == pids  # kept for the next iterator ...
    assert wait_gone(pids) == []  # ... for 2 s
    loader = DpexDataLoader(dsets.Squares(8), batch_size=4, num_workers=2,
                            distribute_mode=True)
    list(loader)
    pids = worker_pids(loader)
    assert POOL.wait_settled(20) and pids_alive(pids) == pids
    assert dpex.release_warm_workers() >= 1  # one host per node, whatever num_workers
    assert wait_gone(pids) == []


def test_no_reuse_with_a_zero_timeout_or_workers_that_reserve_cpus():
    for extra in ({"warm_worker_timeout": 0}, {"ray_remote_args": {"num_cpus": 0.5}}):
        loader = DpexDataLoader(dsets.Squares(8), batch_size=4, num_workers=2,
                                distribute_mode=True, **extra)
        list(loader)
        pids = worker_pids(loader)
        assert wait_gone(pids) == [], extra  # ended with the iterator, as torch's


def test_a_worker_that_may_still_run_user_code_is_not_reused():
    # From index 5 on a fetch takes 120 s: still running when the iterator is dropped.
    loader = DpexDataLoader(dsets.HangsFrom(5, 120.0, n=8), batch_size=1, num_workers=1,
                            distribute_mode=True, timeout=60)
    it = iter(loader)
    assert [next(it).item() for _ in range(5)] == [0, 1, 2, 3, 4]
    time.sleep(0.5)  # index 5 is being fetched
    pids = worker_pids(loader)
    it._shutdown_workers()
    assert wait_gone(pids, limit=30) == []  # its compute thread outlived the session
    assert POOL.idle_count() == 0


def test_warm_workers_end_with_their_trainer(tmp_path):
    """Owned by the trainer process: gone with it, even when it is killed."""
    script = textwrap.dedent("""
        import os, sys, time, torch
        from dpex import DpexDataLoader
        from dpex.client._warm import POOL
        loader = DpexDataLoader(torch.arange(8), batch_size=4, num_workers=2,
                                distribute_mode=True, warm_worker_timeout=600)
        list(loader)
        POOL.wait_settled(30)
        hosts = {w["pid"] for w in loader.stats()["workers"].values()}
        sys.path.insert(0, sys.argv[1])
        from dsets import descendants  # the host's forkserver, fork base, ...
        pids = sorted(hosts) + [p for h in hosts for p in descendants(h)]
        print("PIDS", *pids, "IDLE", POOL.idle_count(), flush=True)
        time.sleep(600)
    """)
    proc = subprocess.Popen([sys.executable, "-c", script, os.path.dirname(__file__)],
                            stdout=subprocess.PIPE,
                            text=True, env={**os.environ, "RAY_ADDRESS": ""})
    try:
        line = ""
        deadline = time.monotonic() + 180
        while not line.startswith("PIDS") and time.monotonic() < deadline:
            line = proc.stdout.readline()
        words = line.split()
        pids = [int(p) for p in words[1:words.index("IDLE")]]
        assert len(pids) >= 3 and words[-1] == "1"  # a host, its forkserver, a fork base
        assert pids_alive(pids) == pids
    finally:
        proc.kill()  # SIGKILL: no atexit, no clean-up of its own
        proc.wait(30)
    assert wait_gone(pids, limit=60) == []


def test_an_unchanged_dataset_is_shipped_once_and_a_changed_one_again():
    dataset = dsets.Squares(8)
    loader = DpexDataLoader(dataset, batch_size=4, num_workers=2, distribute_mode=True)
    list(loader)
    first = loader.stats()
    list(loader)
    second = loader.stats()
    assert not first["dataset_reused"] and second["dataset_reused"]
    assert first["dataset_bytes"] == second["dataset_bytes"] > 0
    dataset.max_sleep = 0.0  # another dataset now: shipped again, and the workers see it
    batches = list(loader)
    assert not loader.stats()["dataset_reused"]
    assert [b[1].tolist() for b in batches] == [[0, 1, 2, 3], [4, 5, 6, 7]]
