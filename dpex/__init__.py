"""dpex: torch's DataLoader with its preprocessing on a Ray cluster.

``DpexDataLoader(dataset, ..., distribute_mode=True)`` yields exactly the batches
torch's DataLoader would, computed by Ray actors and streamed over ZeroMQ.
"""

from typing import TYPE_CHECKING

from dpex import _process_state  # noqa: F401  (the environment at dpex's import: its fallback)
from dpex._version import __version__
from dpex.errors import (
    BatchTooLargeError,
    DatasetNotPicklableError,
    DpexDroppedWarning,
    DpexError,
    DpexTimeoutError,
    DpexWarning,
    EventLoopError,
    FleetError,
    IteratorClosedError,
    PlacementWarning,
    ProtocolError,
    RayConnectionError,
    ResumeStateError,
    UnsupportedError,
    WorkerDiedError,
    WorkerHungError,
    WorkerStartupError,
)

if TYPE_CHECKING:
    from dpex._autoscale import Autoscale
    from dpex._config import DpexConfig
    from dpex._packed import PackedStrings
    from dpex._stats import LoaderStats, stats_prometheus
    from dpex.client._warm import release as release_warm_workers
    from dpex.dataloader import DpexDataLoader

# The rest is imported when first asked for (PEP 562): a process that imports only a
# part of dpex (a worker host, which starts its forkserver first) does not import
# torch for the loader's sake. ``from dpex import DpexDataLoader`` works as ever.
_LAZY = {
    "DpexDataLoader": ("dpex.dataloader", "DpexDataLoader"),
    "Autoscale": ("dpex._autoscale", "Autoscale"),
    "DpexConfig": ("dpex._config", "DpexConfig"),
    "PackedStrings": ("dpex._packed", "PackedStrings"),
    "LoaderStats": ("dpex._stats", "LoaderStats"),
    "stats_prometheus": ("dpex._stats", "stats_prometheus"),
    "release_warm_workers": ("dpex.client._warm", "release"),
}


def __getattr__(name: str) -> object:
    if name not in _LAZY:
        raise AttributeError(f"module 'dpex' has no attribute {name!r}")
    import importlib

    module, attribute = _LAZY[name]
    value = getattr(importlib.import_module(module), attribute)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_LAZY})


__all__ = [
    "DpexDataLoader",
    "Autoscale",
    "DpexConfig",
    "PackedStrings",
    "LoaderStats",
    "stats_prometheus",
    "release_warm_workers",
    "DpexError",
    "RayConnectionError",
    "ResumeStateError",
    "DatasetNotPicklableError",
    "WorkerStartupError",
    "WorkerDiedError",
    "WorkerHungError",
    "BatchTooLargeError",
    "FleetError",
    "IteratorClosedError",
    "EventLoopError",
    "DpexTimeoutError",
    "UnsupportedError",
    "ProtocolError",
    "DpexWarning",
    "PlacementWarning",
    "DpexDroppedWarning",
    "__version__",
]
