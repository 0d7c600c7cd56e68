"""Open handles travel (issue 51, dpex/_handles.py): a dataset that opened its file,
sqlite3 database, HDF5 file or LMDB environment on first use, and was touched in the
trainer (``ds[0]``), runs on dpex's workers unchanged, each worker with a handle of
its own; a handle that cannot travel is refused by name.

The loaders are set beside torch's on the same script (in-process dpex workers here,
the real hosts and fork bases in the Ray case at the end)."""

import logging
import sqlite3

import pytest
import torch
from dsets import handle_dataset, write_handle_data
from torch.utils.data import DataLoader

from dpex import DatasetNotPicklableError, DpexDataLoader
from dpex._spec import ShippedLoader
from dpex.client._shipping import ship_loader
from dpex.server._task_runner import load_pickled
from dpex.server._trainer_state import leave_trainer_state

try:  # (imported here, at collection: importing h5py runs `uname -p`, a process)
    import h5py
except ImportError:
    h5py = None
try:
    import lmdb
except ImportError:
    lmdb = None

N = 40
# LMDB forbids opening one environment twice in a process: its workers are Ray's (below).
KINDS = ["file", "sqlite", "h5py"]


def needs(kind):
    if {"h5py": h5py, "lmdb": lmdb}.get(kind, True) is None:
        pytest.skip(f"{kind} is not installed")


def contents(dataset):
    return ShippedLoader(dataset=dataset, dataset_kind=0, auto_collation=True,
                         collate_fn=None, drop_last=False, worker_init_fn=None)


def unpickled(parts):
    try:
        return load_pickled(bytes(parts)).dataset
    finally:
        leave_trainer_state()


def epochs(loader, n=2):
    return [[b.clone() for b in loader] for _ in range(n)]


def handle_of(dataset):
    return next(v for k, v in vars(dataset).items() if k in ("f", "db", "env"))


@pytest.mark.parametrize("kind", KINDS)
def test_a_dataset_touched_in_the_trainer_gives_torchs_batches(kind, tmp_path, inprocess):
    needs(kind)
    path = write_handle_data(kind, str(tmp_path), N)
    dataset = handle_dataset(kind, path, N)
    first = dataset[0]  # the trainer looks at a sample: the handle is open now
    kw = dict(batch_size=4, shuffle=True)
    torch_batches = epochs(DataLoader(dataset, generator=torch.Generator().manual_seed(3), **kw))
    loader = DpexDataLoader(dataset, distribute_mode=True, num_workers=2,
                            generator=torch.Generator().manual_seed(3), **kw)
    dpex_batches = epochs(loader)
    assert len(dpex_batches[0]) == N // 4
    for theirs, ours in zip(torch_batches, dpex_batches, strict=True):
        for a, b in zip(theirs, ours, strict=True):
            assert torch.equal(a, b)
    assert torch.equal(dataset[0], first)  # (the trainer's handle still reads)


@pytest.mark.parametrize("kind", KINDS)
def test_each_worker_opens_its_own_handle_and_the_trainers_is_untouched(kind, tmp_path):
    needs(kind)
    path = write_handle_data(kind, str(tmp_path), N)
    dataset = handle_dataset(kind, path, N)
    dataset[5]
    handle = handle_of(dataset)
    position = handle.tell() if kind == "file" else None
    parts = ship_loader(contents(dataset))
    one, two = unpickled(parts), unpickled(parts)
    assert handle_of(one) is not handle
    # Two workers (here two unpicklings in one process; an HDF5 file is opened once per
    # process, its datasets and groups share it) each open their own.
    assert kind == "h5py" or handle_of(two) is not handle_of(one)
    if kind == "file":
        assert handle_of(one).fileno() != handle_of(two).fileno() != handle.fileno()
        assert handle_of(one).tell() == position == handle.tell()  # where it stood
        one[3]
        assert handle_of(two).tell() == position  # its own offset
    for i in (0, 7, N - 1):
        assert torch.equal(one[i], dataset[i]) and torch.equal(two[i], dataset[i])


def test_a_text_file_is_opened_again_where_it_stood(tmp_path):
    path = tmp_path / "lines.txt"
    path.write_text("".join(f"line {i}: é\n" for i in range(10)), encoding="utf-8")
    with open(path, encoding="utf-8") as f:
        f.readline()
        f.readline()
        holder = contents([f])
        moved = unpickled(ship_loader(holder))[0]
        assert moved.readline() == "line 2: é\n" and moved.encoding == "utf-8"
        assert f.readline() == "line 2: é\n"  # (the trainer's own: not moved)
        moved.close()


def test_the_log_names_the_reopened_attributes_once(tmp_path, caplog):
    path = write_handle_data("file", str(tmp_path), N)
    dataset = handle_dataset("file", path, N)
    dataset[0]
    with caplog.at_level(logging.INFO, logger="dpex"):
        ship_loader(contents(dataset))
        ship_loader(contents(dataset))
    said = [r.getMessage() for r in caplog.records if "opens these handles" in r.getMessage()]
    assert len(said) == 1 and "dataset.f (_io.BufferedReader" in said[0], said
    assert path in said[0]


def test_a_file_open_for_writing_is_refused_by_name(tmp_path):
    dataset = handle_dataset("file", write_handle_data("file", str(tmp_path), N), N)
    dataset.log = open(tmp_path / "log.txt", "a")  # noqa: SIM115
    with pytest.raises(DatasetNotPicklableError) as err:
        ship_loader(contents(dataset))
    message = str(err.value)
    assert "dataset.log" in message and "TextIOWrapper" in message
    assert "open for writing" in message and "every worker would write" in message
    dataset.log.close()


def test_an_in_memory_sqlite_database_is_refused_by_name():
    dataset = handle_dataset("sqlite", ":memory:", N)
    dataset.db = sqlite3.connect(":memory:")
    with pytest.raises(DatasetNotPicklableError) as err:
        ship_loader(contents(dataset))
    message = str(err.value)
    assert "dataset.db" in message and "in-memory" in message and "empty one" in message
    dataset.db.close()


def test_a_read_write_sqlite_connection_is_opened_read_write_and_a_read_only_one_read_only(
        tmp_path):
    path = write_handle_data("sqlite", str(tmp_path), N)
    for read_only in (True, False):
        dataset = handle_dataset("sqlite", path, N)
        dataset.read_only = read_only
        dataset[0]
        moved = handle_of(unpickled(ship_loader(contents(dataset))))
        if read_only:
            with pytest.raises(sqlite3.OperationalError, match="readonly"):
                moved.execute("insert into rows values (1000, 0, 0)")
        else:
            moved.execute("insert into rows values (1000, 0, 0)")
            moved.rollback()
        assert not dataset.db.in_transaction  # (the trainer's: as it was)
        moved.close()
        dataset.db.close()


def test_a_writable_hdf5_file_is_refused_by_name(tmp_path):
    needs("h5py")
    dataset = handle_dataset("h5py", write_handle_data("h5py", str(tmp_path), N), N)
    dataset.f = h5py.File(dataset.path, "r+")
    with pytest.raises(DatasetNotPicklableError, match=r"dataset\.f .*open for writing"):
        ship_loader(contents(dataset))
    dataset.f.close()


def test_an_lmdb_environment_travels_as_its_path_flags_and_sizes(tmp_path):
    needs("lmdb")
    from dpex._handles import reduce_handle

    path = write_handle_data("lmdb", str(tmp_path), N)
    env = lmdb.open(path, readonly=True, lock=False, readahead=False)
    try:
        opener, (where, options, map_size, readers) = reduce_handle(env)
        assert where == path and options["readahead"] is False and options["lock"] is False
        assert map_size == env.info()["map_size"] and readers == env.max_readers()
    finally:
        env.close()
    writable = lmdb.open(path)
    try:
        with pytest.raises(TypeError, match="open for writing"):
            reduce_handle(writable)
    finally:
        writable.close()


@pytest.mark.ray
@pytest.mark.parametrize("kind", ["file", "sqlite", "h5py", "lmdb"])
def test_on_ray_hosts_each_worker_unpickles_its_own_handle(kind, tmp_path, ray_session):
    """The real path: the host's fork base sees unpickling open a descriptor, so each
    worker unpickles its own loader (server/_unpickling.py), 2 workers, 2 epochs."""
    needs(kind)
    path = write_handle_data(kind, str(tmp_path), N)
    dataset = handle_dataset(kind, path, N)
    dataset[0]
    kw = dict(batch_size=4, shuffle=True)
    torch_batches = epochs(DataLoader(dataset, generator=torch.Generator().manual_seed(5), **kw))
    loader = DpexDataLoader(dataset, distribute_mode=True, num_workers=2,
                            generator=torch.Generator().manual_seed(5), **kw)
    dpex_batches = epochs(loader)
    for theirs, ours in zip(torch_batches, dpex_batches, strict=True):
        for a, b in zip(theirs, ours, strict=True):
            assert torch.equal(a, b)
