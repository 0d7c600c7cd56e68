"""What a fork base sees of its unpickling (dpex.server._unpickling; no Ray): a dataset
whose unpickling runs its own code (``__setstate__``, a ``__reduce__`` callable) or opens
a descriptor is unpickled by each worker; one whose unpickling only rebuilds data
(tensors, arrays, lists, cloudpickle's classes) is shared. Module import-time code is
not counted (the base imports the pickle's modules once, as documented)."""

import collections
import dataclasses
import gc
import os
import pickle
import sys

import cloudpickle
import numpy as np
import pytest
import torch
from test_loader_pickle import shipped

from dpex import PackedStrings, _loader_pickle
from dpex.server._task_runner import load_pickled
from dpex.server._trainer_state import leave_trainer_state
from dpex.server._unpickling import UnpicklingWatch


def watched(data):
    """(what was unpickled, the first foreign function or None, descriptors left open)"""
    watch = UnpicklingWatch()
    try:
        with watch:
            loaded = load_pickled(bytearray(bytes(data)), unpickler=watch.unpickler)
    finally:
        leave_trainer_state()
    gc.collect()
    return loaded, watch.foreign, watch.opened()


class Reopens(torch.utils.data.Dataset):
    """The advice DatasetNotPicklableError gives: drop the handle, open it again."""

    def __init__(self, path):
        self.path = path
        self.f = open(path, "rb")

    def __getstate__(self):
        return {**self.__dict__, "f": None}

    def __setstate__(self, state):
        self.__dict__.update(state)
        self.f = open(self.path, "rb")


class MakesRng:
    def __setstate__(self, state):
        self.__dict__.update(state)
        self.rng = np.random.default_rng()


def _rebuild_plain(value):
    return Plain(value)


class Plain:
    def __init__(self, value):
        self.value = value


class ReducesToOwnFunction(Plain):
    def __reduce__(self):
        return _rebuild_plain, (self.value,)


class OpensInC(Plain):
    """A descriptor opened by a C function unpickling calls: no Python frame runs."""

    def __reduce__(self):
        return os.open, (self.value, os.O_RDONLY)


Point = collections.namedtuple("Point", "x y")


@dataclasses.dataclass
class Record:
    name: str
    size: int


@pytest.mark.parametrize("dataset", [
    torch.utils.data.TensorDataset(torch.arange(100_000), torch.ones(100_000)),
    [f"item {i}" for i in range(10_000)],
    {"array": np.arange(50_000), "points": [Point(1, 2)], "records": [Record("a", 1)]},
    PackedStrings([f"path/{i}.jpg" for i in range(10_000)]),
    Plain(np.zeros(20_000)),
], ids=["tensors", "strings", "containers", "packed", "plain-class"])
def test_data_that_unpickling_only_rebuilds_is_shared(dataset):
    loaded, foreign, opened = watched(shipped(dataset))
    assert foreign is None and opened == []
    assert type(loaded.dataset) is type(dataset)


def test_a_setstate_that_reopens_a_file_is_the_datasets_own_code(tmp_path):
    path = tmp_path / "records.bin"
    path.write_bytes(b"x" * 100)
    loaded, foreign, opened = watched(shipped(Reopens(str(path))))
    assert "Reopens.__setstate__" in foreign and __file__ in foreign
    assert loaded.dataset.f.read(3) == b"xxx"


def test_a_setstate_that_makes_an_rng_is_the_datasets_own_code():
    probe = MakesRng()
    probe.n = 3
    _, foreign, _ = watched(shipped(probe))
    assert "MakesRng.__setstate__" in foreign


def test_a_reduce_callable_of_the_datasets_own_code_is_seen():
    loaded, foreign, _ = watched(shipped(ReducesToOwnFunction(7)))
    assert "_rebuild_plain" in foreign and loaded.dataset.value == 7


def test_a_descriptor_opened_by_c_code_is_seen(tmp_path):
    path = tmp_path / "f"
    path.write_bytes(b"")
    loaded, foreign, opened = watched(shipped(OpensInC(str(path))))
    try:
        assert foreign is None and opened == [str(path)]
    finally:
        os.close(loaded.dataset)


def test_a_setstate_of_a_class_shipped_by_value_is_the_datasets_own_code():
    """The training script's classes travel by value, and a worker's copy of their code
    is named "<dynamic-code>" by cloudpickle: their ``__setstate__`` is the dataset's own
    code all the same (it was once taken for the standard library's generated code and
    trusted). (In this process cloudpickle hands back the class it pickled, so the class
    is made here under the name a worker's copy has.)"""
    namespace: dict = {}
    source = "class Script:\n    def __setstate__(self, state):\n        self.__dict__.update(state)\n"
    exec(compile(source, "<dynamic-code>", "exec"), namespace)
    cls = namespace["Script"]
    cls.__module__ = "__main__"
    obj = cls()
    obj.n = 1  # (an empty state is never set)
    data = cloudpickle.dumps(obj)
    watch = UnpicklingWatch()
    with watch:
        _loader_pickle.loads(data, unpickler=watch.unpickler)
    assert watch.foreign is not None and "Script.__setstate__" in watch.foreign


def test_cloudpickles_classes_by_value_are_rebuilt_not_run():
    """A class of the training script (``__main__``) travels by value: cloudpickle's
    rebuilders run, not the class's code."""
    namespace: dict = {}
    exec("class Script:\n    def __init__(self):\n        self.n = 5\n", namespace)
    cls = namespace["Script"]
    cls.__module__ = "__main__"
    data = cloudpickle.dumps(cls())
    watch = UnpicklingWatch()
    with watch:
        loaded = _loader_pickle.loads(data, unpickler=watch.unpickler)
    assert loaded.n == 5 and watch.foreign is None


def test_a_modules_import_time_code_is_not_counted(tmp_path, monkeypatch):
    """The pickle names a module of the user's that the process has not imported: its
    import runs in the base (once), which is not the dataset's unpickling."""
    (tmp_path / "user_mod_for_watch.py").write_text(
        "import os\nSTARTED = os.getpid()\n\ndef helper():\n    return 1\n\nhelper()\n\n"
        "class Data:\n    pass\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    import user_mod_for_watch

    data = pickle.dumps(user_mod_for_watch.Data())
    del sys.modules["user_mod_for_watch"]
    watch = UnpicklingWatch()
    with watch:
        loaded = _loader_pickle.loads(data, unpickler=watch.unpickler)
    assert type(loaded).__name__ == "Data" and "user_mod_for_watch" in sys.modules
    assert watch.foreign is None


def test_the_watch_leaves_no_profiler_behind():
    watch = UnpicklingWatch()
    with watch:
        _loader_pickle.loads(pickle.dumps(ReducesToOwnFunction(1)), unpickler=watch.unpickler)
    assert sys.getprofile() is None


@pytest.mark.parametrize("dataset", [
    torch.arange(100_000), [f"s{i}" for i in range(5_000)], np.arange(30_000)],
    ids=["tensor", "strings", "array"])
def test_an_unpickler_reads_a_framed_pickle_as_pickle_loads_does(dataset):
    data = bytes(shipped(dataset))
    try:
        plain = load_pickled(data).dataset
        mine = load_pickled(data, unpickler=pickle.Unpickler).dataset
    finally:
        leave_trainer_state()
    if isinstance(dataset, list):
        assert mine == plain == dataset
    else:
        assert (mine == plain).all()


def test_a_view_reader_reads_lines_and_into_buffers():
    reader = _loader_pickle.ViewReader(memoryview(b"ab\ncd\nefgh"))
    assert reader.readline() == b"ab\n" and reader.read(2) == b"cd"
    target = bytearray(3)
    assert reader.readinto(target) == 3 and bytes(target) == b"\nef"
    assert reader.read() == b"gh" and reader.read(5) == b"" and reader.readline() == b""


def test_lend_true_lends_a_large_pickles_buffers(monkeypatch):
    """A base whose workers unpickle their own loader lends them its copy at any size:
    it keeps that copy for its life anyway."""
    monkeypatch.setattr(_loader_pickle, "LEND_IN_BAND_BYTES", 16)
    data = bytearray(bytes(shipped([torch.zeros(50_000), "x" * 100])))
    try:
        copied = load_pickled(data).dataset[0]
        lent = load_pickled(data, lend=True).dataset[0]
    finally:
        leave_trainer_state()
    address = np.frombuffer(data, dtype=np.uint8).ctypes.data
    assert address <= lent.untyped_storage().data_ptr() < address + len(data)
    assert not address <= copied.untyped_storage().data_ptr() < address + len(data)
