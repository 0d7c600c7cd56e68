"""A worker host per node (issue 40): the node's workers are forks of one process that
holds the dataset, so a worker costs its own pages, not a copy of the dataset; a
killed worker process or a killed host is replaced and the epoch stays exact."""

import gc
import os
import signal
import time

import dsets
import pytest
import torch
from dsets import assert_same

from dpex import DpexDataLoader
from dpex.client import _shipment

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]


@pytest.fixture
def fresh_shipments(monkeypatch):
    """This process has shipped no dataset yet (bytes shipped before do not keep their
    memfd: a host's base maps the first one's): other tests ship the same datasets."""
    from dpex.client import _shipment

    monkeypatch.setattr(_shipment, "SHIPPED", _shipment.ShipmentMemo())


def ready(it, n):
    deadline = time.monotonic() + 60
    while len(it._ready) < n and time.monotonic() < deadline:
        it._driver.receive_one()
    assert len(it._ready) == n
    return it._ready


def test_a_nodes_workers_share_one_copy_of_the_dataset():
    """Three workers of a loader over a 64 MiB dataset hold less than one copy of it
    privately between them (before, each unpickled a copy of its own: >= 64 MiB each)."""
    dataset = dsets.Rows(64)
    loader = DpexDataLoader(dataset, batch_size=64, num_workers=3, distribute_mode=True)
    it = iter(loader)
    batches = [next(it) for _ in range(12)]
    assert torch.equal(batches[5], dataset.data[5 * 64:6 * 64])
    info = ready(it, 3)
    assert len({w["pid"] for w in info.values()}) == 1  # one host ...
    sessions = [w["session_pid"] for w in info.values()]
    assert len(set(sessions)) == 3  # ... and a process of its own for each worker
    private = [dsets.private_mib(pid) for pid in sessions]
    assert sum(private) < 64, private
    loader.close()


def test_a_killed_worker_process_is_forked_again_and_the_epoch_stays_exact():
    kw = {"batch_size": 2, "shuffle": True, "num_workers": 2}
    dataset = dsets.Squares(200, max_sleep=0.005)
    torch.manual_seed(5)
    expected = list(dsets.torch_loader(dataset, **kw))
    torch.manual_seed(5)
    it = iter(DpexDataLoader(dataset, distribute_mode=True, timeout=60, **kw))
    got = [next(it) for _ in range(5)]
    info = dict(ready(it, 2))
    os.kill(info[1]["session_pid"], signal.SIGKILL)
    started = time.monotonic()
    got += list(it)
    assert_same(expected, got, "epoch")
    stats = it.stats()
    assert stats["dropped"]["restarted"] == 1, stats
    recovery = stats["recoveries"][0]
    assert recovery["ready_at"] - recovery["reported_at"] < 5.0, recovery  # a fork
    assert recovery["ready_at"] > started - 60
    replacement = stats["workers"][1]
    assert replacement["pid"] == info[1]["pid"]  # on the same host
    assert replacement["session_pid"] != info[1]["session_pid"]


@pytest.mark.usefixtures("fresh_shipments")
def test_a_killed_host_loses_its_workers_which_move_to_a_new_host_uncharged():
    """SIGKILL of the host: every worker on it is lost with it, not by a fault of its
    own; they are replaced on a new host (max_worker_restarts=0 still passes) and the
    epoch stays exact; the old host's processes are all gone."""
    kw = {"batch_size": 2, "shuffle": True, "num_workers": 2}
    dataset = dsets.Squares(200, max_sleep=0.005)
    torch.manual_seed(6)
    expected = list(dsets.torch_loader(dataset, **kw))
    torch.manual_seed(6)
    loader = DpexDataLoader(dataset, distribute_mode=True, timeout=60,
                            max_worker_restarts=0, **kw)
    it = iter(loader)
    got = [next(it) for _ in range(5)]
    info = dict(ready(it, 2))
    host = info[0]["pid"]
    tree = [host, *dsets.descendants(host)]  # its forkserver, fork base and sessions
    os.kill(host, signal.SIGKILL)
    got += list(it)
    assert_same(expected, got, "epoch")
    stats = it.stats()
    assert stats["dropped"]["moved"] == 2, stats
    assert {w["pid"] for w in stats["workers"].values()} != {host}
    assert dsets.wait_gone(tree, 20.0) == []
    # The new host took the dataset from the trainer's memfd, kept open for this
    # iterator: nothing was pickled again into Ray's object store (before: a put).
    assert _shipment.SHIPPED.last(loader)[1] is None


def test_loaders_iterating_at_once_share_their_nodes_host():
    """A validation loop inside a training epoch: both loaders' workers are sessions on
    one host (before: a host each, each with its interpreter and forkserver)."""
    train = DpexDataLoader(dsets.Squares(40), batch_size=2, num_workers=2, distribute_mode=True)
    val = DpexDataLoader(dsets.Squares(12), batch_size=2, num_workers=1, distribute_mode=True)
    it = iter(train)
    first = next(it)
    assert_same(list(dsets.torch_loader(dsets.Squares(12), batch_size=2)), list(val))
    hosts = {w["pid"] for w in ready(it, 2).values()}
    hosts |= {w["pid"] for w in val.stats()["workers"].values()}
    assert len(hosts) == 1, hosts
    assert_same(list(dsets.torch_loader(dsets.Squares(40), batch_size=2)), [first, *it])


@pytest.mark.usefixtures("fresh_shipments")
@pytest.mark.parametrize("kept", [True, False], ids=["buffers", "large-pickle"])
def test_the_trainer_keeps_no_copy_of_the_dataset_once_its_workers_started(kept, monkeypatch):
    """On the trainer's node the pickled loader crosses through a memfd, which the host's
    fork base maps. A dataset of buffers (a tensor) is those pages in the base: the
    trainer keeps the memfd open for its iterator (replacements and new hosts take it
    from there) at no cost. One whose pickle is large (a list of millions of strings:
    here the limit is set to 0) has the memfd closed once every worker said hello.
    Nothing goes to Ray's object store (whose pages stay written for the Ray
    instance's life), and the next iterator of the unchanged dataset forks from the
    base it left."""
    from test_shipfile import memfds

    from dpex import _shipfile

    if not kept:
        monkeypatch.setattr(_shipfile, "KEEP_IN_BAND_BYTES", 0)
    loader = DpexDataLoader(dsets.Rows(8), batch_size=64, num_workers=2, distribute_mode=True)
    it = iter(loader)
    next(it)
    info = ready(it, 2)
    assert _shipment.SHIPPED.last(loader)[1] is None  # no stored copy
    if kept:  # the trainer's one memfd, and its pages are what the workers map
        assert len(memfds()) == 1
        with open(f"/proc/{info[0]['session_pid']}/maps") as f:
            assert f"dpex-shipment-{os.getpid()}" in f.read()
    else:
        assert memfds() == []
    assert len(list(it)) == 127  # (8 MiB: 8,192 rows of 1 KiB)
    assert memfds() == []  # the iterator ended: no worker will read it any more
    del it, info
    gc.collect()
    second = iter(loader)
    batches = [next(second)]
    ready(second, 2)
    # The same bytes again: the host forks from the base the first made, which maps the
    # first's memfd; the second's is closed once its workers started (not a 2nd copy).
    assert memfds() == []
    assert len([*batches, *second]) == 128
    assert loader.stats()["dataset_reused"] and _shipment.SHIPPED.last(loader)[1] is None
    del second
    gc.collect()
    # A loader built again over the same dataset (Lightning rebuilds its loaders): the
    # same bytes, the same base, so its memfd is not kept either.
    rebuilt = iter(DpexDataLoader(loader.dataset, batch_size=64, num_workers=2,
                                  distribute_mode=True))
    first = next(rebuilt)
    ready(rebuilt, 2)
    assert memfds() == [] and len([first, *rebuilt]) == 128


@pytest.mark.parametrize("remote_args", [None, {"num_cpus": 1}], ids=["host", "reserving"])
def test_a_hosts_dataset_is_the_trainers_memfd_mapped_and_each_worker_may_write_it(
        remote_args):
    """On the trainer's node a host's fork base maps the shipment copy-on-write: the
    dataset's tensors and arrays are the memfd's pages (before, an unpickled copy), and
    a worker writing to its copy changes only its own. A worker that reserves resources
    (an actor of its own, from the object store) gets a private, writable copy."""
    from test_shipfile import memfds

    dataset = dsets.WhereHeld()
    loader = DpexDataLoader(dataset, batch_size=500, num_workers=1, distribute_mode=True,
                            ray_remote_args=remote_args)
    it = iter(loader)
    rows = [next(it)]
    ready(it, 1)
    if remote_args is not None:  # its own actor, given the object store's copy: the
        assert memfds() == []  # trainer's memfd was lent to no host, so not kept
    rows = torch.cat([*rows, *it])
    assert torch.equal(rows[:, 0], torch.arange(len(dataset), dtype=torch.float32))
    mapped = remote_args is None
    assert bool(rows[:, 1].all()) is mapped and bool(rows[:, 2].all()) is mapped
    assert torch.equal(rows[:, 3], rows[:, 0] + 1)  # each write landed, once
    assert float(dataset.tensor.sum()) == 0.0 and dataset.array.sum() == 0.0
    loader.close()


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
def test_a_resume_from_a_state_taken_right_after_iter_starts_every_worker(persistent):
    """Issue 47's sequence: ``state_dict()`` right after ``iter()`` (a job's checkpoint
    at an epoch's start), ``close()``, then a new loader over an equal dataset loads it,
    several times in one process. The first loader's memfd may go before its host's base
    mapped it; before, that base was kept with the error inside and every worker of the
    equal dataset failed (ShipmentUnavailable after 3 restarts)."""
    kw = {"batch_size": 4, "shuffle": True, "num_workers": 2,
          "persistent_workers": persistent}
    dataset = dsets.Squares(64)
    expected = list(dsets.torch_loader(dataset, generator=torch.Generator().manual_seed(7),
                                       **kw))
    for _ in range(3):
        first = DpexDataLoader(dsets.Squares(64), distribute_mode=True,
                               generator=torch.Generator().manual_seed(7), **kw)
        iter(first)
        state = first.state_dict()
        first.close()
        resumed = DpexDataLoader(dsets.Squares(64), distribute_mode=True,
                                 generator=torch.Generator().manual_seed(99), **kw)
        resumed.load_state_dict(state)
        got = list(resumed)
        stats = resumed.stats()
        resumed.close()
        assert_same(got, expected)
        assert stats["dataset_fallbacks"] <= 2  # (a host that found the memfd gone)


@pytest.mark.parametrize("remote_args", [None, {"num_cpus": 1}], ids=["host", "reserving"])
def test_workers_run_at_the_trainers_niceness_as_torchs_forks_do(remote_args):
    """Ray starts its workers at niceness 15: beside any work of the node at niceness 0
    (the trainer's own threads, another job) they got ~3 % of a core, and a batch took
    seconds (README's demo beside two busy loops: 88 s, 24 s after). dpex's workers
    take the trainer's niceness, as torch's forked workers keep it."""
    loader = DpexDataLoader(dsets.Niceness(), batch_size=2, num_workers=2,
                            distribute_mode=True, ray_remote_args=remote_args)
    rows = torch.cat(list(loader))
    assert rows[:, 0].tolist() == list(range(8))
    assert set(rows[:, 1].tolist()) == {os.getpriority(os.PRIO_PROCESS, 0)}
    loader.close()


def test_a_hosts_threads_and_the_processes_it_starts_take_the_trainers_niceness():
    """Not only the session's loop thread: the host's own threads (which dispatch its
    calls) and the fork bases it starts, or they wait behind the node's other work."""
    loader = DpexDataLoader(dsets.Niceness(), batch_size=2, num_workers=1,
                            distribute_mode=True, persistent_workers=True)
    it = iter(loader)
    next(it)
    host = it.stats()["workers"][0]["pid"]
    mine = os.getpriority(os.PRIO_PROCESS, 0)
    for pid in [host, *dsets.descendants(host)]:
        for tid in os.listdir(f"/proc/{pid}/task"):
            with open(f"/proc/{pid}/task/{tid}/stat") as f:
                assert int(f.read().rsplit(")", 1)[1].split()[16]) == mine, (pid, tid)
    loader.close()
