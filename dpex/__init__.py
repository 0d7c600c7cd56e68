"""dpex: torch's DataLoader with its preprocessing on a Ray cluster.

``DpexDataLoader(dataset, ..., distribute_mode=True)`` yields exactly the batches
torch's DataLoader would, computed by Ray actors and streamed over ZeroMQ.
"""

from dpex._autoscale import Autoscale
from dpex._config import DpexConfig
from dpex._packed import PackedStrings
from dpex._stats import LoaderStats, stats_prometheus
from dpex._version import __version__
from dpex.client._warm import release as release_warm_workers
from dpex.dataloader import DpexDataLoader
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
