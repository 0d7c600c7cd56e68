"""The saved state as a type (ResumeState), its plain JSON form, and saving as a pure
function of a loader's view and an iterator's position: no Ray, no process. dpex's
workers are stood in for by what they answer (tests/test_resume_ray.py runs them)."""

import dataclasses
import json
import random
import weakref

import pytest
import resumable
import torch
from dsets import json_trip, round_trip
from torch.utils.data import DataLoader

from dpex import DpexDataLoader, ResumeStateError, UnsupportedError
from dpex.client.resume import (
    IteratorPosition,
    ResumeState,
    capture,
    loaded,
    position_of,
)
from dpex.server._rng import RngRecorder


def leaves(value):
    """Every leaf of a plain state."""
    if isinstance(value, dict):
        for v in value.values():
            yield from leaves(v)
    elif isinstance(value, list):
        for v in value:
            yield from leaves(v)
    else:
        yield value


class FakeWorkerStates:
    """What dpex's workers answer to state_dict(), without them (WorkerStates)."""

    def __init__(self, count=2, iterable=False):
        torch.manual_seed(1)
        random.seed(2)
        self.rng = {w: RngRecorder().capture() for w in range(count)}
        self.rng_worker_count, self.iterable, self.asked = count, iterable, []

    def resume_points(self, mid_epoch):
        return {w: (0, w) for w in self.rng}

    def shard_positions(self):
        return {"workers": {w: {"taken": 3, "ended": False} for w in self.rng},
                "next_worker": 1, "stateful": False}

    def worker_rng_states(self, asked, limit=None):
        self.asked.append(asked)
        return {w: {**rng, "dataset": {"pos": w}} for w, rng in self.rng.items()}


def drawn(loader, k):
    """A Drawing of ``loader``'s epoch with ``k`` index batches drawn."""
    drawing = iter(loader._index_sampler)
    for _ in range(k):
        next(drawing)
    return drawing


@pytest.mark.parametrize("shuffle", [False, True])
def test_a_mid_epoch_state_with_dpex_workers_is_json_and_resumes_from_the_json_copy(shuffle):
    generator = torch.Generator().manual_seed(3) if shuffle else None
    loader = DataLoaderLike(shuffle=shuffle, generator=generator)
    workers = FakeWorkerStates()
    position = IteratorPosition(drawn(loader, 5), 3, False, torch.get_rng_state(),
                                workers=workers)
    saving = capture(loader._resume_view(), position, None)
    assert workers.asked == []  # cheap until the full state is wanted
    plain = saving.state()
    assert workers.asked == [{0: (0, 0), 1: (0, 1)}]
    assert not any(isinstance(leaf, torch.Tensor) for leaf in leaves(plain))
    copy = json_trip(plain)
    assert round_trip(plain) == plain
    assert copy == plain | {"worker_rng": {str(w): rng for w, rng in plain["worker_rng"].items()}}
    state = ResumeState.from_dict(copy)
    assert state.yielded == 3 and state.mid_epoch and state.worker_rng_num_workers == 2
    for w, rng in workers.rng.items():  # the workers get back what they gave
        back = state.worker_rng[w]
        assert torch.equal(back["torch"], rng["torch"])
        assert back["random"] == rng["random"] and type(back["random"][1]) is tuple
        assert torch.equal(back["numpy"][1], rng["numpy"][1]) and back["dataset"] == {"pos": w}
        random.setstate(back["random"])  # restore_rng's own calls take them
    back = loaded(DataLoaderLike(shuffle=shuffle, generator=generator)._resume_view(), copy)
    assert back.yielded == 3 and back.worker_rng_fits(2) and sorted(back.worker_rng) == [0, 1]


class JsonRng(resumable.MapGlobalRng):
    """Keeps torch's global RNG as its own state, as a list (JSON takes it)."""

    def state_dict(self):
        return {"rng": torch.get_rng_state().tolist()}

    def load_state_dict(self, state):
        torch.set_rng_state(torch.tensor(state["rng"], dtype=torch.uint8))


def DataLoaderLike(**kwargs):
    """dpex's loader, Ray-free (num_workers=0), over a dataset with a JSON state."""
    return DpexDataLoader(JsonRng(), batch_size=2, **kwargs)


@pytest.mark.parametrize("cut", [0, 3, None])  # batches taken; None: the whole epoch
@pytest.mark.parametrize("dataset", ["map", "iterable"])
def test_a_state_through_json_resumes_as_an_uninterrupted_run(dataset, cut):
    """torchdata's TestJsonSerDe: ``json.dumps`` a state, resume from the loaded copy."""
    def new():
        ds = JsonRng() if dataset == "map" else resumable.IterStateful()
        return DpexDataLoader(ds, batch_size=2, shuffle=dataset == "map" or None)

    torch.manual_seed(0)
    want = [b.tolist() for _ in range(2) for b in new()]
    torch.manual_seed(0)
    loader, got = new(), []
    it = iter(loader)
    for batch in it if cut is None else (next(it) for _ in range(cut)):
        got.append(batch.tolist())
    text = json.dumps(loader.state_dict())  # (kept as text, as a JSON checkpoint)
    torch.manual_seed(0)
    resumed = new()
    resumed.load_state_dict(json.loads(text))
    got += [b.tolist() for b in resumed] if cut is not None else []
    got += [b.tolist() for b in resumed]
    assert got == want


def test_saving_with_no_iterator_is_an_epoch_boundary_and_reads_no_workers():
    loader = DataLoaderLike(shuffle=True, generator=torch.Generator().manual_seed(1))
    state = capture(loader._resume_view(), None, None).resume_state()
    assert not state.mid_epoch and state.yielded == 0
    assert torch.equal(state.sampler_rng, loader.generator.get_state())
    assert state.global_rng is None  # (a generator: the global RNG is not drawn from)


def test_an_ended_epoch_of_persistent_workers_keeps_its_base_seed_for_the_next():
    loader = DpexDataLoader(resumable.MapGlobalRng(), batch_size=2)
    view = loader._resume_view()
    view = dataclasses.replace(view, num_workers=2, persistent=True)
    rng = torch.Generator().manual_seed(9).get_state()
    position = IteratorPosition(drawn(loader, 10), 10, True, rng, epochs_served=1,
                                workers=FakeWorkerStates())
    state = capture(view, position, None).resume_state()
    assert not state.mid_epoch and torch.equal(state.iterator_rng, rng)
    assert state.epochs_before == 1 and sorted(state.worker_rng) == [0, 1]
    # between epochs a worker's dataset state first finishes the epoch it was in
    assert all(rng["finish_epoch"] for rng in state.worker_rng.values())


def test_an_iterable_datasets_position_is_its_workers_shards():
    loader = DpexDataLoader(resumable.IterStateful(), batch_size=2)
    view = loader._resume_view()
    view = dataclasses.replace(view, num_workers=2, distributed=True)
    position = IteratorPosition(drawn(loader, 4), 3, False, None, workers=FakeWorkerStates())
    plain = json_trip(capture(view, position, None).state())
    assert plain["iterable"]["next_worker"] == 1
    assert ResumeState.from_dict(plain).iterable["workers"][1] == {"taken": 3, "ended": False}


def test_in_order_false_mid_epoch_is_refused_by_name():
    loader = DpexDataLoader(resumable.MapGlobalRng(), batch_size=2)
    view = loader._resume_view()
    view = dataclasses.replace(view, num_workers=2, in_order=False)
    with pytest.raises(UnsupportedError, match="in_order=False"):
        capture(view, IteratorPosition(drawn(loader, 2), 1, False, None), None)


@pytest.mark.parametrize("key, value, named", [
    ("yielded", "3", "'yielded' is str"),
    ("mid_epoch", 1, "'mid_epoch' is int"),
    ("num_workers", True, "'num_workers' is bool"),
    ("worker_rng", [1], "'worker_rng' is list"),
])
def test_a_state_with_a_wrong_type_is_refused_naming_the_key(key, value, named):
    state = DataLoaderLike().state_dict()
    with pytest.raises(ResumeStateError, match=named):
        ResumeState.from_dict({**state, key: value})
    incomplete = {k: v for k, v in state.items() if k != "rank"}
    with pytest.raises(ResumeStateError, match=r"lacks \['rank'\]"):
        ResumeState.from_dict(incomplete)


def test_a_version_1_state_with_tensors_still_resumes():
    """dpex before version 2 of the state kept RNG states as tensors (and no "drawn")."""
    loader = DataLoaderLike(shuffle=True)
    torch.manual_seed(4)
    want = [b.tolist() for b in loader]
    torch.manual_seed(4)
    it = iter(loader)
    got = [next(it).tolist() for _ in range(3)]
    plain = loader.state_dict()
    old = {**ResumeState.from_dict(plain).__dict__, "format": plain["format"], "version": 1}
    for key in ("drawn", "rank", "world_size", "identity", "sampler_epoch"):
        del old[key]  # (keys version 1 gained over its life: an early state lacks them)
    assert isinstance(old["sampler_draw_rng"], torch.Tensor)
    torch.manual_seed(4)
    resumed = DataLoaderLike(shuffle=True)
    resumed.load_state_dict(round_trip(old))
    assert got + [b.tolist() for b in resumed] == want


def test_torchs_iterators_positions_are_read_by_the_one_adapter():
    loader = DataLoaderLike(shuffle=True, generator=torch.Generator().manual_seed(2))
    it = iter(loader)
    for _ in range(3):
        next(it)
    position = position_of(it, None)
    assert (position.yielded, position.ended, position.workers) == (3, False, None)
    assert position.fetcher is not None  # num_workers=0: the dataset runs here
    list(it)
    assert position_of(it, None).ended
    plain = DataLoader(range(6), batch_size=2)  # an index sampler not seen through IndexView
    assert position_of(iter(plain), None).drawing is None


def test_the_book_keeps_only_its_current_iterators_end():
    loader = DataLoaderLike()
    book = loader._book
    old = iter(loader)
    next(old)
    new = iter(loader)  # the current one now
    for _ in range(2):
        next(new)
    book.keep(old, ask_workers=False)  # an older iterator ended: not where the loader stands
    assert book.kept is None
    book.keep(new, ask_workers=False)
    assert book.kept.mid_epoch and book.kept.yielded == 2
    book.empty()  # load_state_dict(): nothing current, nothing kept
    assert book.current is None and book.kept is None
    book.keep(new, ask_workers=False)
    assert book.kept is None


def test_the_book_knows_the_live_dpex_iterators_without_keeping_them_alive():
    class It:
        pass

    book, old, new = DataLoaderLike()._book, It(), It()
    book.hold(old, None, strong=False, dpex=True)
    book.hold(new, None, strong=False, dpex=True)
    assert book.current is new and book.newest is new and book.is_live(old)
    ref = weakref.ref(new)
    del new
    assert ref() is None and book.current is None  # (unless told to hold it: num_workers=0)
    assert book.take_live() == [old] and not book.is_live(old)


def test_an_iterator_reports_to_the_book_and_writes_nothing_into_the_loader():
    loader = DataLoaderLike()
    before = dict(vars(loader))
    book = loader._book
    book.scaled(5)
    book.ended({"batches": 3})
    assert book.scaled_to == 5 and loader.stats() == {"batches": 3}

    def broken():
        raise RuntimeError("a counter changed while it was read")
    book.dropped(object(), ask_workers=False, limit=1.0, stats=broken)  # (never raises)
    assert vars(loader) == before


def refers_to(value, target):
    if value is target:
        return True
    if isinstance(value, weakref.ref):
        return value() is target
    if isinstance(value, (weakref.WeakSet, set, list, tuple)):
        return any(refers_to(v, target) for v in value)
    if isinstance(value, dict):
        return any(refers_to(v, target) for v in value.values())
    return False


def test_the_loader_refers_to_its_current_iterator_from_one_book():
    """One book (torch's own ``_iterator`` aside, which holds a persistent iterator)."""
    loader = DataLoaderLike()
    it = iter(loader)
    next(it)
    holders = sorted(name for name, value in vars(loader).items() if refers_to(value, it)
                     or refers_to(getattr(value, "__dict__", None), it))
    assert holders == ["_book"]


def test_a_sampler_without_a_length_iterates_and_saves():
    """The loader's length is asked for only where a state needs it."""
    class Unsized(torch.utils.data.Sampler):
        def __iter__(self):
            return iter(range(8))

        def __len__(self):
            raise NotImplementedError("no length")

    loader = DpexDataLoader(list(range(8)), batch_size=2, sampler=Unsized())
    it = iter(loader)
    assert next(it).tolist() == [0, 1]
    state = json_trip(loader.state_dict())
    assert state["length"] is None and state["yielded"] == 1
    resumed = DpexDataLoader(list(range(8)), batch_size=2, sampler=Unsized())
    resumed.load_state_dict(state)
    assert [b.tolist() for b in resumed] == [b.tolist() for b in it] == [[2, 3], [4, 5], [6, 7]]


def test_the_iterator_running_when_a_state_is_loaded_still_serves_stats_and_scaling():
    """load_state_dict() empties the slot (state_dict() is the loaded state), but the
    iterator still running keeps answering stats() and scale_workers()."""
    class Running:  # a live dpex iterator, as the loader sees one
        closed, scaled, shut = False, None, False

        def stats(self):
            return {"batches": 7}

        def scale_to(self, n):
            self.scaled = n

        def _shutdown_workers(self):
            self.shut = True

    loader = DpexDataLoader(JsonRng(), batch_size=2, distribute_mode=True, num_workers=2,
                            worker_pool="prep")  # (a fleet's name: no Ray until iter())
    state = loader.state_dict()
    running = Running()
    loader._book.hold(running, None, strong=False, dpex=True)  # (what _get_iterator does)
    loader.load_state_dict(state)
    assert loader._book.current is None and loader.state_dict() == state
    assert loader.stats() == {"batches": 7}
    loader.scale_workers(3)
    assert running.scaled == 3
    loader.close()
    assert running.shut


# -- values that make no sense, and nested fields (issue 48) ----------------------------

@pytest.mark.parametrize("key, value, named", [
    ("yielded", -3, "'yielded' is -3; it is at least 0"),
    ("num_workers", -1, "'num_workers' is -1"),
    ("world_size", 0, "'world_size' is 0; it is at least 1"),
    ("epochs_before", -2, "'epochs_before' is -2"),
])
def test_a_count_below_its_least_is_refused_naming_the_key(key, value, named):
    state = DataLoaderLike().state_dict()
    with pytest.raises(ResumeStateError, match=named):
        ResumeState.from_dict({**state, key: value})


def worker_rng_plain(**change):
    plain = ResumeState.from_dict(DataLoaderLike().state_dict())
    plain.worker_rng = {0: RngRecorder().capture()}
    out = json_trip(plain.to_dict())
    out["worker_rng"]["0"].update(change)
    return out


@pytest.mark.parametrize("change, named", [
    ({"sampler_rng": "not base64!"}, "'sampler_rng' cannot be read"),
    ({"base_rng": [1, 2, 3]}, "'base_rng' cannot be read.*3 torch.uint8 values"),
    ({"sampler_rng": []}, "'sampler_rng' cannot be read.*0 torch.uint8 values"),
    ({"iterable": {"workers": {"x": 1}}}, "'iterable' cannot be read"),
])
def test_a_malformed_nested_field_is_refused_by_name_not_a_raw_error(change, named):
    state = DataLoaderLike().state_dict()
    with pytest.raises(ResumeStateError, match=named):
        ResumeState.from_dict({**state, **change})


@pytest.mark.parametrize("part, value, named", [
    ("torch", "AAAA", "'worker_rng' cannot be read.*3 torch.uint8 values"),
    ("random", [3, [1, 2], None], "625"),
    ("numpy", ["MT19937", "AAAAAAAAAAA=", 0, 0, 0.0], "holds 2 keys, not 624"),
    ("torch", 7, "'worker_rng' cannot be read"),
])
def test_a_workers_rng_state_of_the_wrong_size_is_refused_at_load_not_at_the_next_iter(
        part, value, named):
    with pytest.raises(ResumeStateError, match=named):
        ResumeState.from_dict(worker_rng_plain(**{part: value}))
    assert ResumeState.from_dict(worker_rng_plain()).worker_rng[0]["torch"] is not None


def test_a_samplers_generator_on_a_device_keeps_its_own_state_size():
    """A sampler may draw from a CUDA generator (16 bytes of state, not the CPU's 5056):
    only the loader's own and torch's global generators are CPU ones."""
    state = DataLoaderLike().state_dict()
    read = ResumeState.from_dict({**state, "sampler_rng": list(range(16))})
    assert read.sampler_rng.tolist() == list(range(16))
