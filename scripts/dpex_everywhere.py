"""pytest plugin: every ``torch.utils.data.DataLoader`` a test builds is a DpexDataLoader
with ``distribute_mode=True``, and the tests' own modules travel to the workers by value.

Used by scripts/torch_dataloader_tests.py to run PyTorch's own DataLoader tests
against dpex: ``python -m pytest -p dpex_everywhere test_dataloader.py``.
"""

from __future__ import annotations

import sys
from typing import TypeVar

import cloudpickle
import torch.utils.data

from dpex import DpexDataLoader

T_co = TypeVar("T_co", covariant=True)


class DistributedDataLoader(DpexDataLoader[T_co]):
    """torch's signature and defaults, with dpex's Ray workers unless told otherwise."""

    def __init__(self, *args, **kwargs):
        kwargs.setdefault("distribute_mode", True)
        super().__init__(*args, **kwargs)


def pytest_configure(config) -> None:
    # Before any test module is imported: `from torch.utils.data import DataLoader` in a
    # test module then finds this class.
    torch.utils.data.DataLoader = DistributedDataLoader


def pytest_collection_finish(session) -> None:
    # The tests' datasets live in modules that Ray workers cannot import.
    for name in {item.module.__name__ for item in session.items if hasattr(item, "module")}:
        cloudpickle.register_pickle_by_value(sys.modules[name])
