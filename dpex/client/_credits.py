"""The credit window: how many batches may be dispatched and not yet consumed."""

from __future__ import annotations

__all__ = ["CreditWindow"]


class CreditWindow:
    """Bounds the batches dispatched to workers and not yet consumed by the trainer.

    Invariant: ``available + in_flight == capacity`` and ``0 <= in_flight <= capacity``.

    A credit is taken when a task is dispatched (:meth:`acquire`) and given back
    when its slot is consumed by the training loop (:meth:`release`): a batch
    taken, an error raised, or an empty IterableDataset slot passed over. Memory
    held by the trainer is therefore bounded by ``capacity`` batches whatever the
    speed of the workers.
    """

    def __init__(self, capacity: int) -> None:
        if capacity < 1:
            raise ValueError(f"credit window capacity must be >= 1, got {capacity}")
        self.capacity = capacity
        self.in_flight = 0

    @property
    def available(self) -> int:
        return self.capacity - self.in_flight

    def acquire(self) -> bool:
        """Take one credit; ``False`` (and no change) when none is available."""
        if self.in_flight >= self.capacity:
            return False
        self.in_flight += 1
        return True

    def release(self) -> None:
        """Give one credit back. Raises ``RuntimeError`` if none is in flight."""
        if self.in_flight <= 0:
            raise RuntimeError("credit released with none in flight")
        self.in_flight -= 1

    def reset(self) -> None:
        """Forget every credit in flight (a new epoch)."""
        self.in_flight = 0
