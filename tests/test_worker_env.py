"""What process state a worker sees (issue 25, item 20): torch's workers see the
trainer's working directory and environment as of ``iter()``; dpex's must too (the
directory where it exists on their node, the variables the trainer changed).

The live tests run the same dataset through torch's DataLoader and dpex's and compare
what they yield; the rules (what is captured, how it is applied and undone) are tested
without Ray below them."""

import os
import pickle
import sqlite3
import sys

import cloudpickle
import pytest
from torch.utils.data import DataLoader, Dataset

from dpex import DatasetNotPicklableError, DpexDataLoader
from dpex._loader_pickle import PickleParts, loads
from dpex._process_state import SHIP_ENV, TrainerState, capture
from dpex._spec import ShippedLoader
from dpex.client._shipping import ship_loader
from dpex.server._trainer_state import (
    BEFORE_ENV,
    apply_state,
    enter_trainer_state,
    leave_trainer_state,
)

VAR = "DPEX_TEST_WORKER_ENV"

# The datasets below are defined here, which Ray workers cannot import: ship by value.
cloudpickle.register_pickle_by_value(sys.modules[__name__])


class RelativeFiles(Dataset):
    """Reads ``data/<i>.txt`` relative to the current directory, as image folders and
    lazily opened files do when the script was given a relative path."""

    def __len__(self) -> int:
        return 6

    def __getitem__(self, i: int) -> str:
        with open(os.path.join("data", f"{i}.txt")) as f:
            return f.read()


class EnvReader(Dataset):
    """What a dataset reads from the environment (a cache directory, a token, a flag)."""

    def __len__(self) -> int:
        return 4

    def __getitem__(self, i: int) -> str:
        return os.environ.get(VAR, "<unset>")


def _both(dataset, **kw):
    torch_batches = list(DataLoader(dataset, num_workers=2, batch_size=2, **kw))
    loader = DpexDataLoader(dataset, num_workers=2, batch_size=2, distribute_mode=True, **kw)
    dpex_batches = list(loader)
    return torch_batches, dpex_batches


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(300)
def test_a_relative_path_after_chdir_reads_what_torchs_workers_read(tmp_path, monkeypatch):
    (tmp_path / "data").mkdir()
    for i in range(6):
        (tmp_path / "data" / f"{i}.txt").write_text(f"item {i}")
    monkeypatch.chdir(tmp_path)  # after Ray started (the session fixture started it)
    torch_batches, dpex_batches = _both(RelativeFiles())
    assert torch_batches == [[f"item {i}", f"item {i + 1}"] for i in range(0, 6, 2)]
    assert dpex_batches == torch_batches


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(300)
def test_a_variable_set_after_ray_started_reaches_the_workers_as_torchs(monkeypatch):
    monkeypatch.setenv(VAR, "set by the trainer")
    torch_batches, dpex_batches = _both(EnvReader())
    assert torch_batches == [["set by the trainer"] * 2] * 2
    assert dpex_batches == torch_batches


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(300)
def test_each_iterator_sees_the_state_of_its_own_iter_on_warm_workers(tmp_path, monkeypatch):
    """Warm workers are reused (the second and third iterators run in sessions forked
    from the same actors): each sees the trainer's state as of its own ``iter()``, and
    nothing a previous iterator applied stays."""
    loader = DpexDataLoader(EnvReader(), num_workers=2, batch_size=2, distribute_mode=True)
    monkeypatch.setenv(VAR, "first")
    assert list(loader) == [["first"] * 2] * 2
    monkeypatch.setenv(VAR, "second")
    assert list(loader) == [["second"] * 2] * 2
    monkeypatch.delenv(VAR)
    assert list(loader) == [["<unset>"] * 2] * 2
    assert list(DataLoader(EnvReader(), num_workers=2, batch_size=2)) == [["<unset>"] * 2] * 2


class SqliteRows(Dataset):
    """Holds an open sqlite3 connection (to an in-memory database: a handle that cannot
    travel, dpex/_handles.py)."""

    def __init__(self, path: str) -> None:
        self.path = path
        self.db = sqlite3.connect(path)

    def __len__(self) -> int:
        return 2

    def __getitem__(self, i: int) -> int:
        return self.db.execute("select ?", (i,)).fetchone()[0]


def test_a_dataset_holding_an_open_handle_is_told_the_getstate_fix(tmp_path):
    dataset = SqliteRows(":memory:")
    shipped = ShippedLoader(dataset=dataset, dataset_kind=0, auto_collation=True,
                            collate_fn=None, drop_last=False, worker_init_fn=None)
    with pytest.raises(DatasetNotPicklableError) as err:
        ship_loader(shipped)
    message = str(err.value)
    assert "dataset.db" in message
    assert "__getstate__" in message and "__setstate__" in message
    dataset.db.close()


# --- the rules, without Ray -------------------------------------------------------


def test_only_what_the_trainer_changed_travels_and_never_rays_own():
    before = {"HOME": "/root", "PATH": "/bin", "GONE": "x", "RAY_ADDRESS": "a"}
    now = {"HOME": "/root", "PATH": "/opt/bin:/bin", "NEW": "1", "RAY_AUTH_MODE": "token",
           "PYTHONBREAKPOINT": "ray.util.rpdb._driver_set_trace",
           "CUDA_VISIBLE_DEVICES": "3"}
    state = capture(now, before, cwd="/data/run")
    assert state.cwd == "/data/run"
    assert dict(state.set_env) == {"NEW": "1", "PATH": "/opt/bin:/bin"}
    assert state.unset_env == ("GONE",)  # RAY_ADDRESS removed: Ray's, never shipped


def test_dpex_ship_env_0_ships_no_variables_but_the_directory():
    state = capture({"NEW": "1", SHIP_ENV: "0"}, {}, cwd="/data/run")
    assert state == TrainerState(cwd="/data/run")


def shipment(state: TrainerState, loader_bytes: bytes = b"") -> bytes:
    return bytes(PickleParts.framed(loader_bytes, [], trainer=state.head()))


def test_the_state_travels_in_the_shipments_header_and_a_plain_pickle_carries_none():
    state = TrainerState(cwd="/d", set_env={"A": "é=1"}, unset_env=("B",))
    loader_bytes = pickle.dumps({"dataset": 1})
    seen: list = []
    assert loads(shipment(state, loader_bytes), enter=seen.append) == {"dataset": 1}
    assert [TrainerState.from_head(head) for head in seen] == [state]
    seen.clear()
    assert loads(loader_bytes, enter=seen.append) == {"dataset": 1} and seen == []
    # the same state gives the same bytes: a loader reuses what it shipped by digest
    assert shipment(capture({"X": "1", "Y": "2"}, {}, cwd="/d")) == shipment(
        capture({"Y": "2", "X": "1"}, {}, cwd="/d"))


def test_a_session_applies_the_state_and_undoing_it_restores_the_nodes_own(tmp_path):
    here, there = tmp_path / "here", tmp_path / "there"
    here.mkdir()
    there.mkdir()
    cwd = [str(here)]
    environ = {"KEEP": "k", "CHANGED": "node", "REMOVED": "node"}
    state = TrainerState(cwd=str(there), set_env={"CHANGED": "trainer", "NEW": "trainer"},
                         unset_env=("REMOVED", "NEVER_THERE"))
    applied = apply_state(state, environ, chdir=lambda p: cwd.__setitem__(0, p),
                          getcwd=lambda: cwd[0])
    assert cwd == [str(there)]
    assert {k: v for k, v in environ.items() if k != BEFORE_ENV} == {
        "KEEP": "k", "CHANGED": "trainer", "NEW": "trainer"}
    applied.undo()
    applied.undo()  # idempotent
    assert environ == {"KEEP": "k", "CHANGED": "node", "REMOVED": "node"}
    assert cwd == [str(here)]


def test_a_process_that_inherited_a_sessions_state_starts_from_the_nodes_own(tmp_path):
    """The forkserver may start while the first session's state is applied (it inherits
    that environment); the sessions forked from it undo it before applying their own."""
    environ = {"CHANGED": "node", "REMOVED": "node"}
    first = TrainerState(set_env={"CHANGED": "first", "ONLY_FIRST": "1"},
                         unset_env=("REMOVED",))
    apply_state(first, environ, chdir=lambda p: None, getcwd=lambda: str(tmp_path))
    inherited = dict(environ)  # what a process started now gets
    second = TrainerState(set_env={"CHANGED": "second"})
    apply_state(second, inherited, chdir=lambda p: None, getcwd=lambda: str(tmp_path))
    assert {k: v for k, v in inherited.items() if k != BEFORE_ENV} == {
        "CHANGED": "second", "REMOVED": "node"}


def test_a_directory_missing_on_this_node_keeps_the_workers_and_is_logged_once(
        tmp_path, caplog):
    missing = str(tmp_path / "only-on-the-trainer")
    cwd = [str(tmp_path)]

    def chdir(path):
        os.stat(path)  # as os.chdir: FileNotFoundError
        cwd[0] = path

    with caplog.at_level("WARNING", logger="dpex"):
        for _ in range(3):
            apply_state(TrainerState(cwd=missing), {}, chdir=chdir, getcwd=lambda: cwd[0])
    assert cwd == [str(tmp_path)]
    assert [r.getMessage() for r in caplog.records].count(caplog.records[0].getMessage()) == 1
    assert len(caplog.records) == 1 and missing in caplog.records[0].getMessage()


def test_entering_a_sessions_state_undoes_one_left_over(monkeypatch, tmp_path):
    monkeypatch.delenv(VAR, raising=False)
    monkeypatch.chdir(tmp_path)
    first = TrainerState.from_head(TrainerState(cwd=str(tmp_path), set_env={VAR: "first"}).head())
    second = TrainerState(cwd=str(tmp_path), set_env={})
    enter_trainer_state(first)
    assert os.environ[VAR] == "first"
    enter_trainer_state(second)  # a session that never left (killed): not kept
    assert VAR not in os.environ
    leave_trainer_state()
    leave_trainer_state()
    assert BEFORE_ENV not in os.environ
    enter_trainer_state(None)  # (nothing carried: nothing changes)
    assert BEFORE_ENV not in os.environ


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(300)
def test_dpex_shm_ring_0_in_the_trainers_environment_sends_every_batch_by_socket(monkeypatch):
    """Issue 25, item 19, end to end: on a node where tenants share a uid the rings are
    turned off by the environment, for every loader (the workers share this node)."""
    monkeypatch.setenv("DPEX_SHM_RING", "0")
    with DpexDataLoader(EnvReader(), num_workers=2, batch_size=2,
                        distribute_mode=True) as loader:
        assert len(list(loader)) == 2
        stats = loader.stats()
    assert stats["received_in_ring"] == 0 and stats["received"] == 2
    assert all(w["transport"].startswith("socket") for w in stats["workers"].values())


# --- secrets (issue 39, item 9) ---------------------------------------------------

SECRETS = {"HF_TOKEN": "hf_x", "AWS_SECRET_ACCESS_KEY": "s", "db_password": "p",
           "GOOGLE_APPLICATION_CREDENTIALS": "/k.json", "OPENAI_API_KEY": "k"}


def test_names_that_look_like_secrets_stay_back_unless_listed():
    state = capture({**SECRETS, "HF_HOME": "/cache"}, {}, cwd="/d")
    assert dict(state.set_env) == {"HF_HOME": "/cache"}
    assert state.withheld == tuple(sorted(SECRETS))
    listed = {**SECRETS, "HF_HOME": "/cache", SHIP_ENV: "HF_TOKEN, db_password"}
    state = capture(listed, {}, cwd="/d")
    assert dict(state.set_env) == {"HF_HOME": "/cache", "HF_TOKEN": "hf_x", "db_password": "p",
                                   SHIP_ENV: "HF_TOKEN, db_password"}
    assert state.withheld == ("AWS_SECRET_ACCESS_KEY", "GOOGLE_APPLICATION_CREDENTIALS",
                              "OPENAI_API_KEY")
    assert b"hf_x" not in shipment(capture({**SECRETS}, {}, cwd="/d"))


def test_a_fleets_workers_get_no_variables_unless_the_trainer_asks():
    now = {"HF_HOME": "/cache", "HF_TOKEN": "hf_x"}
    state = capture(now, {"GONE": "1"}, cwd="/d", fleet=True)
    assert (dict(state.set_env), state.unset_env, state.cwd) == ({}, (), "/d")
    assert state.withheld == ("GONE", "HF_HOME", "HF_TOKEN")  # said in the log
    asked = capture({**now, SHIP_ENV: "1"}, {}, cwd="/d", fleet=True)
    assert dict(asked.set_env) == {"HF_HOME": "/cache", SHIP_ENV: "1"}
    listed = capture({**now, SHIP_ENV: "HF_TOKEN"}, {}, cwd="/d", fleet=True)
    assert dict(listed.set_env) == {"HF_HOME": "/cache", "HF_TOKEN": "hf_x", SHIP_ENV: "HF_TOKEN"}
    assert capture({"HF_HOME": "/cache"}, {}, cwd="/d").set_env == {"HF_HOME": "/cache"}


def test_the_shipped_names_are_logged_once_and_never_their_values(caplog):
    shipped = ShippedLoader(dataset=[1, 2], dataset_kind=0, auto_collation=True,
                            collate_fn=None, drop_last=False, worker_init_fn=None)
    state = capture({"HF_HOME": "/cache/hub", "HF_TOKEN": "hf_secret"}, {"OLD": "1"}, cwd="/d")
    with caplog.at_level("INFO", logger="dpex"):
        for _ in range(3):
            ship_loader(shipped, state)
    assert len(caplog.records) == 1, [r.getMessage() for r in caplog.records]
    message = caplog.records[0].getMessage()
    assert "HF_HOME" in message and "OLD" in message and "HF_TOKEN" in message
    assert "/cache/hub" not in message and "hf_secret" not in message
    assert caplog.records[0].levelname == "WARNING"  # something was held back
