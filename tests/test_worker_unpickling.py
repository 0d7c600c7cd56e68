"""Each worker unpickles what it must (issue 47): a dataset whose unpickling runs its own
code (a handle reopened in ``__setstate__``, an RNG made there) is unpickled in each
worker's own process, as under torch's ``spawn``, beside torch on the same script; its
tensors and arrays stay the host's shared pages. Before, a host's fork base unpickled
it once and every worker forked with one open file description and one RNG stream."""

import dsets
import pytest
import torch
from dsets import assert_same

from dpex import DpexDataLoader

pytestmark = [pytest.mark.usefixtures("ray_session"), pytest.mark.timeout(300)]


def test_a_handle_reopened_in_setstate_is_each_workers_own(tmp_path):
    """20,000 records read by seek + read, 2 workers, shuffled: torch's spawn and dpex
    give every record right, each through a handle its own process opened."""
    dataset = dsets.Records(str(tmp_path / "records.bin"))
    kw = {"batch_size": 50, "shuffle": True, "num_workers": 2}
    torch.manual_seed(3)
    expected = list(dsets.torch_loader(dataset, multiprocessing_context="spawn", **kw))
    torch.manual_seed(3)
    loader = DpexDataLoader(dataset, distribute_mode=True, **kw)
    got = list(loader)
    loader.close()
    rows = torch.cat(got)
    wrong = int((rows[:, 0] != rows[:, 1]).sum())
    assert wrong == 0, f"{wrong} items came back as another item's record"
    assert bool(rows[:, 2].all()), "a worker read through a handle another process opened"
    assert_same(got, expected)


def test_an_rng_made_in_setstate_gives_each_worker_its_own_stream():
    kw = {"batch_size": 10, "num_workers": 2}
    for loader in (dsets.torch_loader(dsets.EntropyRng(), multiprocessing_context="spawn",
                                      **kw),
                   DpexDataLoader(dsets.EntropyRng(), distribute_mode=True, **kw)):
        rows = torch.cat(list(loader))
        draws = [rows[rows[:, 1] == w][:, 2].tolist() for w in (0, 1)]
        assert len(draws[0]) == len(draws[1]) == 100, type(loader).__name__
        assert not set(draws[0]) & set(draws[1]), f"{type(loader).__name__}: one stream"
        if isinstance(loader, DpexDataLoader):
            loader.close()


def test_a_dataset_each_worker_unpickles_keeps_its_tensors_in_the_shared_pages():
    """Unpickling rebuilds the small object graph in each worker; its tensor and array
    are still views of the trainer's memfd as the host mapped it (not a copy each)."""
    dataset = dsets.WhereHeldReopening()
    loader = DpexDataLoader(dataset, batch_size=500, num_workers=2, distribute_mode=True)
    rows = torch.cat(list(loader))
    loader.close()
    assert torch.equal(rows[:, 0], torch.arange(len(dataset), dtype=torch.float32))
    assert bool(rows[:, 1].all()) and bool(rows[:, 2].all())
    assert torch.equal(rows[:, 3], rows[:, 0] + 1)  # each worker's writes its own
