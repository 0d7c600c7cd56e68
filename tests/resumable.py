"""Datasets of the resume conformance cases (tests/test_resume_conformance.py), in the
shapes torchdata's own StatefulDataLoader tests use: each keeps its position or its RNG
its own way. Registered by value (conftest.py) so that Ray workers build them."""

import torch
from torch.utils.data import Dataset, IterableDataset, get_worker_info


def shard(n: int) -> range:
    """This worker's share of ``range(n)`` (all of it in the main process)."""
    info = get_worker_info()
    return range(n) if info is None else range(info.id, n, info.num_workers)


class MapGlobalRng(Dataset):
    """Item i with a draw from torch's global RNG; the dataset keeps that RNG's state
    as its own (torchdata's DummyMapDataset does the same)."""

    def __init__(self, n: int = 20) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, int(torch.randint(0, 1000, ()))])

    def state_dict(self) -> dict:
        return {"rng": torch.get_rng_state()}

    def load_state_dict(self, state: dict) -> None:
        torch.set_rng_state(state["rng"])


class IterPlain(IterableDataset):
    """Sharded numbers from an iterator object; no state of its own."""

    def __init__(self, n: int = 20) -> None:
        self.n = n

    def __iter__(self):
        return iter(shard(self.n))


class IterGenerator(IterableDataset):
    """Sharded numbers with a random draw from the worker's RNG, from a generator."""

    def __init__(self, n: int = 20) -> None:
        self.n = n

    def __iter__(self):
        for i in shard(self.n):
            yield torch.tensor([i, int(torch.randint(0, 1000, ()))])


class IterStateful(IterableDataset):
    """Keeps its own position (dataset ``state_dict``: load, then ``iter()`` goes on)."""

    def __init__(self, n: int = 20) -> None:
        self.n, self.pos = n, 0

    def __iter__(self):
        items = list(shard(self.n))
        while self.pos < len(items):
            self.pos += 1
            yield items[self.pos - 1]
        self.pos = 0

    def state_dict(self) -> dict:
        return {"pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.pos = state["pos"]


class SelfIterating(IterableDataset):
    """Its own iterator, which sets up its position in ``__iter__``: its state can only
    be loaded after ``iter()`` (torchdata's order for an iterator's state)."""

    def __init__(self, n: int = 20) -> None:
        self.n = n

    def __iter__(self):
        self.iter_state = {"items": list(shard(self.n)), "pos": 0}
        return self

    def __next__(self) -> int:
        state = self.iter_state
        if state["pos"] >= len(state["items"]):
            raise StopIteration
        state["pos"] += 1
        return state["items"][state["pos"] - 1]

    def state_dict(self) -> dict:
        return {"pos": self.iter_state["pos"]}

    def load_state_dict(self, state: dict) -> None:
        self.iter_state["pos"] = state["pos"]


class EpochCounting(IterableDataset):
    """Counts its epochs and keeps its position (its own state): epoch e's items are
    ``e * 100 + i``."""

    def __init__(self, n: int = 12) -> None:
        self.n, self.epoch, self.pos = n, 0, 0

    def __iter__(self):
        items = list(shard(self.n))
        while self.pos < len(items):
            self.pos += 1
            yield self.epoch * 100 + items[self.pos - 1]
        self.epoch, self.pos = self.epoch + 1, 0

    def state_dict(self) -> dict:
        return {"epoch": self.epoch, "pos": self.pos}

    def load_state_dict(self, state: dict) -> None:
        self.epoch, self.pos = state["epoch"], state["pos"]
