"""``dpex.Autoscale``: a worker count that the loader chooses while it runs.

It is an ``int`` (its value is ``min``), so it goes wherever torch's DataLoader
takes ``num_workers`` and survives what frameworks do to a loader: Lightning
re-creates a loader from its attributes (``loader.num_workers`` is this object),
``copy``, pickling for ``mp.spawn``. torch's own loader (``distribute_mode=False``)
runs ``min`` workers.
"""

from __future__ import annotations

from typing import Any

__all__ = ["Autoscale"]


class Autoscale(int):
    """``num_workers=dpex.Autoscale(min=2, max=64)``: start ``min`` workers and add
    workers while the training loop waits for data more than ``target`` of its time
    (and the cluster has room, and more workers still help), remove them while it
    waits less than half that for ``patience`` measurements in a row.

    - ``max``: the most workers; ``None``: the Ray cluster's CPUs when the iterator
      starts.
    - ``target``: the data-stall share to stay under (default 5 %).
    - ``interval``: seconds per measurement (default 1 s).
    - ``patience``: calm measurements before workers are removed (default 3).

    Needs a map-style dataset (an IterableDataset's shards are per worker, so its
    worker count is fixed) and ``distribute_mode=True``. See docs/AUTOSCALE.md.
    """

    min: int
    max: int | None
    target: float
    interval: float
    patience: int

    def __new__(cls, min: int = 1, max: int | None = None, *, target: float = 0.05,  # noqa: A002
                interval: float = 1.0, patience: int = 3) -> Autoscale:
        if isinstance(min, bool) or not isinstance(min, int) or min < 1:
            raise ValueError(f"Autoscale(min=...) must be an int >= 1, got {min!r}")
        if max is not None and (isinstance(max, bool) or not isinstance(max, int) or max < min):
            raise ValueError(f"Autoscale(max=...) must be None or an int >= min={min}, "
                             f"got {max!r}")
        if isinstance(target, bool) or not isinstance(target, (int, float)) or not (
                0 < target < 1):
            raise ValueError(f"Autoscale(target=...) is a share of the loop's time, "
                             f"0 < target < 1, got {target!r}")
        if isinstance(interval, bool) or not isinstance(interval, (int, float)) or not (
                interval > 0):
            raise ValueError(f"Autoscale(interval=...) must be > 0 seconds, got {interval!r}")
        if isinstance(patience, bool) or not isinstance(patience, int) or patience < 1:
            raise ValueError(f"Autoscale(patience=...) must be an int >= 1, got {patience!r}")
        self = super().__new__(cls, min)
        self.min, self.max, self.target = min, max, float(target)
        self.interval, self.patience = float(interval), patience
        return self

    def __reduce__(self) -> tuple[Any, ...]:
        return (_rebuild, (self.min, self.max, self.target, self.interval, self.patience))

    def __repr__(self) -> str:
        return (f"Autoscale(min={self.min}, max={self.max}, target={self.target:g}, "
                f"interval={self.interval:g}, patience={self.patience})")

    __str__ = __repr__


def _rebuild(min: int, max: int | None, target: float, interval: float,  # noqa: A002
             patience: int) -> Autoscale:
    return Autoscale(min, max, target=target, interval=interval, patience=patience)
