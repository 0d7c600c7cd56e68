"""Mid-epoch resume with dpex's workers: a resumed run yields exactly torch's
uninterrupted batches, worker seeds and worker RNG draws included."""

import io
import time

import dsets
import pytest
import torch
from dsets import assert_same

from dpex import DpexDataLoader

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]


def round_trip(state):
    buf = io.BytesIO()
    torch.save(state, buf)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def probe_loader(cls, num_workers, persistent, **kwargs):
    """SeedProbe: each sample carries its worker's id, seed and torch / random / NumPy
    draws, so a batch is equal only if the worker's RNG stood where torch's did."""
    return cls(dsets.SeedProbe(), batch_size=3, shuffle=True, num_workers=num_workers,
               persistent_workers=persistent, generator=torch.Generator().manual_seed(5),
               **kwargs)


def dpex_probe(num_workers, persistent):
    return probe_loader(DpexDataLoader, num_workers, persistent, distribute_mode=True)


def interrupted(make, epochs, cut_epoch, cut, make_resumed=None):
    """``epochs`` epochs; in ``cut_epoch`` stop after ``cut`` batches, save, close, and
    go on with a new loader (``make_resumed``, else ``make``) that loads the state."""
    loader, out, timings = make(), [], {}
    for e in range(epochs):
        if e != cut_epoch:
            out.append(list(loader))
            continue
        it = iter(loader)
        part = [next(it) for _ in range(cut)]
        t0 = time.monotonic()
        state = round_trip(loader.state_dict())
        timings["state_dict_s"] = time.monotonic() - t0
        del it
        loader.close()
        loader = (make_resumed or make)()
        t0 = time.monotonic()
        loader.load_state_dict(state)
        it = iter(loader)
        part.append(next(it))
        timings["load_and_first_batch_s"] = time.monotonic() - t0
        out.append(part + list(it))
    loader.close()
    return out, timings


@pytest.mark.parametrize("persistent", [False, True], ids=["fresh", "persistent"])
@pytest.mark.parametrize("cut_epoch,cut", [(0, 3), (1, 5)])
def test_a_resumed_run_is_torchs_uninterrupted_run_rng_draws_included(persistent, cut_epoch,
                                                                      cut):
    ref = probe_loader(dsets.torch_loader, 2, persistent)
    want = [list(ref) for _ in range(3)]
    got, _ = interrupted(lambda: dpex_probe(2, persistent), 3, cut_epoch, cut)
    assert_same(want, got, "epochs")


def test_a_state_between_epochs_of_persistent_workers_keeps_their_rng_going():
    ref = probe_loader(dsets.torch_loader, 2, True)
    want = [list(ref) for _ in range(2)]
    loader = dpex_probe(2, True)
    first = list(loader)
    state = round_trip(loader.state_dict())
    loader.close()
    assert not state["mid_epoch"] and set(state["worker_rng"]) == {0, 1}
    resumed = dpex_probe(2, True)
    resumed.load_state_dict(state)
    second = list(resumed)
    resumed.close()
    assert_same(want, [first, second], "epochs")


def test_with_another_worker_count_the_index_batches_and_seeds_are_torchs():
    ref = probe_loader(dsets.torch_loader, 2, False)
    want = [list(ref) for _ in range(2)]
    got, _ = interrupted(lambda: dpex_probe(2, False), 2, 0, 4,
                         make_resumed=lambda: dpex_probe(3, False))
    for e, (w_epoch, g_epoch) in enumerate(zip(want, got, strict=True)):
        assert [b["i"].tolist() for b in g_epoch] == [b["i"].tolist() for b in w_epoch], e
    # The epoch after the resumed one is a new iterator of the 3-worker loader: its
    # seeds are torch's for 3 workers from the same base seed.
    base = want[1][0]["seed"][0].item() - want[1][0]["worker"][0].item()
    assert all((b["seed"] - b["worker"] == base).all() for b in got[1])


def test_prefetched_batches_not_yet_taken_are_computed_again_not_lost():
    ref = probe_loader(dsets.torch_loader, 2, False)
    want = list(ref)
    loader = dpex_probe(2, False)
    it = iter(loader)
    part = [next(it) for _ in range(2)]
    deadline = time.monotonic() + 30  # let the workers fill the prefetch window
    while loader.stats()["received"] < 4 + 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert loader.stats()["received"] >= 6  # batches 2..5 arrived, not taken
    state = round_trip(loader.state_dict())
    assert state["yielded"] == 2
    del it
    loader.close()
    resumed = dpex_probe(2, False)
    resumed.load_state_dict(state)
    assert_same(want, part + list(resumed), "epoch")
    resumed.close()
