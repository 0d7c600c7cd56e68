"""Workers killed mid-epoch: the epoch is still exactly torch's, nothing lost or repeated."""

import os
import signal
import time

import dsets
import pytest
import torch
from dsets import assert_same

from dpex import DpexDataLoader

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(180)]


def ready_pids(it, limit=60.0):
    deadline = time.monotonic() + limit
    while len(it._ready) < it._num_workers and time.monotonic() < deadline:
        it._driver.receive_one()
    assert len(it._ready) == it._num_workers, "workers did not start"
    # The process that computes each worker's batches: on a warm worker, its session's own.
    return {w: info.get("session_pid", info["pid"]) for w, info in it._ready.items()}


def kill(pid):
    os.kill(pid, signal.SIGKILL)


def run_with_kills(loader, kill_at, victims, n_epochs=1, kill_epoch=0):
    """Iterate ``n_epochs``; in epoch ``kill_epoch`` after ``kill_at`` batches SIGKILL the
    ``victims`` (worker ids). Returns the batches and the last iterator's stats."""
    out = []
    for epoch in range(n_epochs):
        it = iter(loader)
        batches = []
        for i, batch in enumerate(it):
            batches.append(batch)
            if epoch == kill_epoch and i + 1 == kill_at:
                pids = ready_pids(it)
                for w in victims:
                    kill(pids[w])
        out.append(batches)
        stats = it.stats()
    return out, stats


def reference(dataset, n_epochs, seed, **kw):
    torch.manual_seed(seed)
    loader = dsets.torch_loader(dataset, **kw)
    return [list(loader) for _ in range(n_epochs)]


@pytest.mark.parametrize("persistent", [False, True])
def test_map_style_epoch_is_exact_after_a_worker_is_killed(persistent):
    kw = {"batch_size": 3, "shuffle": True, "num_workers": 2, "persistent_workers": persistent}
    dataset = dsets.Squares(60, max_sleep=0.02)
    expected = reference(dataset, 2, 7, **kw)
    torch.manual_seed(7)
    loader = DpexDataLoader(dataset, distribute_mode=True, timeout=60, **kw)
    got, stats = run_with_kills(loader, kill_at=4, victims=[1], n_epochs=2,
                                kill_epoch=1 if persistent else 0)
    assert_same(expected, got, "epochs")
    if persistent:
        assert stats["dropped"].get("restarted") == 1, stats
    loader.close()


@pytest.mark.parametrize("persistent", [False, True])
def test_iterable_shard_is_fast_forwarded_by_the_replacement(persistent):
    kw = {"batch_size": 2, "num_workers": 2, "persistent_workers": persistent}
    dataset = dsets.ShardedRange(n=40, extra_for_worker0=3, max_sleep=0.02)
    expected = reference(dataset, 1, 0, **kw)
    loader = DpexDataLoader(dataset, distribute_mode=True, timeout=60, **kw)
    got, stats = run_with_kills(loader, kill_at=5, victims=[0])
    assert_same(expected, got, "epoch")
    assert stats["dropped"].get("restarted") == 1, stats
    loader.close()


def test_two_workers_killed_at_once():
    kw = {"batch_size": 4, "shuffle": True, "num_workers": 3}
    dataset = dsets.Squares(90, max_sleep=0.02)
    expected = reference(dataset, 1, 3, **kw)
    torch.manual_seed(3)
    loader = DpexDataLoader(dataset, distribute_mode=True, timeout=60, **kw)
    got, stats = run_with_kills(loader, kill_at=3, victims=[0, 2])
    assert_same(expected, got, "epoch")
    # Two deaths; a replacement forked on a victim before its death was known is lost
    # with it and comes back once more, moved (not a death of its own: no restart spent).
    dropped = stats["dropped"]
    assert dropped.get("restarted", 0) - dropped.get("moved", 0) == 2, stats


TRAINER = """
import sys, time, torch
from dpex import DpexDataLoader
loader = DpexDataLoader(torch.zeros(2_000, 4096), batch_size=16, num_workers=2,
                        distribute_mode=True, head_address=sys.argv[1])
it = iter(loader)
held = [next(it) for _ in range(8)]  # batches that live in the shared-memory rings
while len(it._ready) < 2:
    it._driver.receive_one()
assert loader.stats()["received_in_ring"] >= 8, loader.stats()
hosts = {info["pid"] for info in it._ready.values()}
print("PIDS", *[info["session_pid"] for info in it._ready.values()], *hosts, flush=True)
time.sleep(600)
"""


def _ring_mappers(trainer_pid: int) -> list[int]:
    """Pids of processes that map one of a trainer's rings (memfds show in /proc/PID/maps
    as /memfd:dpex-ring-<trainer pid>-<ring>)."""
    out = []
    for pid in filter(str.isdigit, os.listdir("/proc")):
        try:
            with open(f"/proc/{pid}/maps") as f:
                if f"dpex-ring-{trainer_pid}-" in f.read():
                    out.append(int(pid))
        except OSError:
            pass  # gone, or not ours to read
    return out


def _left_in_dev_shm(before: set[str], grace: float = 30.0) -> set[str]:
    """What is in /dev/shm now and was not before. dpex makes no named semaphores, but
    torch's loaders in the tests that run beside this one (pytest-xdist) do: with a
    forkserver or spawn context each queue's ``sem.mp-*`` lives as long as its loader.
    Those may take ``grace`` seconds to go; anything else must be gone at once."""
    new = set(os.listdir("/dev/shm")) - before
    deadline = time.monotonic() + grace
    while any(n.startswith("sem.mp-") for n in new) and time.monotonic() < deadline:
        time.sleep(0.5)
        new = {n for n in new if not n.startswith("sem.mp-")} | (
            {n for n in os.listdir("/dev/shm") if n.startswith("sem.mp-")} & new)
    return new


def test_a_killed_trainer_leaves_no_worker_and_no_shared_memory_behind(ray_session):
    import subprocess
    import sys

    shm_before = set(os.listdir("/dev/shm"))

    import select

    address = ray_session.get_runtime_context().gcs_address  # this session's Ray
    proc = subprocess.Popen([sys.executable, "-c", TRAINER, address], stdout=subprocess.PIPE,
                            stderr=subprocess.DEVNULL, text=True)
    try:
        line = ""
        deadline = time.monotonic() + 90
        while not line.startswith("PIDS") and time.monotonic() < deadline:
            if select.select([proc.stdout], [], [], 1.0)[0]:
                line = proc.stdout.readline() or line
        pids = [int(p) for p in line.split()[1:]]  # the two sessions' processes, the host
        assert len(pids) == 3 and dsets.pids_alive(pids) == pids, f"trainer said {line!r}"
        assert set(pids[:2]) | {proc.pid} <= set(_ring_mappers(proc.pid))  # rings in use
    finally:
        proc.kill()
        proc.wait(10)
    t0 = time.monotonic()
    while dsets.pids_alive(pids) and time.monotonic() - t0 < 10:
        time.sleep(0.1)
    assert dsets.pids_alive(pids) == [], f"workers alive {time.monotonic() - t0:.1f} s later"
    # The rings were anonymous memfds: nothing in /dev/shm, no mapping left anywhere.
    assert _ring_mappers(proc.pid) == []
    assert _left_in_dev_shm(shm_before) == set()
    print(f"workers gone {time.monotonic() - t0:.2f} s after the trainer was killed")
