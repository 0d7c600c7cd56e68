"""The ordering buffer: batches arrive in any order and leave in sequence order."""

from __future__ import annotations

from typing import Any

__all__ = ["OrderingBuffer", "DuplicateSequenceError"]


class DuplicateSequenceError(RuntimeError):
    """The same sequence number was put twice while still held."""


class OrderingBuffer:
    """Holds items keyed by sequence number and releases them in order.

    ``next_seq`` is the lowest sequence number not yet consumed. An item is
    *consumed* when :meth:`pop` returns it or :meth:`skip` passes over its slot.
    With ``in_order=True`` only ``next_seq`` is released; with ``in_order=False``
    ``next_seq`` is preferred and otherwise the earliest arrival is released (as
    torch's ``in_order=False``).

    An item for a consumed slot is stale: :meth:`put` returns ``False`` and keeps
    nothing (a late duplicate after a re-dispatch). An item for a slot already
    held is a protocol violation: :class:`DuplicateSequenceError`.
    """

    def __init__(self, in_order: bool = True) -> None:
        self.in_order = in_order
        self.next_seq = 0
        self._held: dict[int, Any] = {}
        self._consumed_ahead: set[int] = set()

    def __len__(self) -> int:
        return len(self._held)

    def __contains__(self, seq: int) -> bool:
        return seq in self._held

    def is_consumed(self, seq: int) -> bool:
        return seq < self.next_seq or seq in self._consumed_ahead

    def put(self, seq: int, item: Any) -> bool:
        """Hold ``item`` in slot ``seq``; ``False`` if the slot was already consumed."""
        if self.is_consumed(seq):
            return False
        if seq in self._held:
            raise DuplicateSequenceError(f"sequence number {seq} received twice")
        self._held[seq] = item
        return True

    def pop(self) -> tuple[int, Any] | None:
        """The next releasable ``(seq, item)``, or ``None`` if there is none yet."""
        if self.next_seq in self._held:
            seq = self.next_seq
        elif not self.in_order and self._held:
            seq = next(iter(self._held))
        else:
            return None
        item = self._held.pop(seq)
        self._consume(seq)
        return seq, item

    def skip(self, seq: int) -> None:
        """Consume slot ``seq`` without an item; any item it held is dropped."""
        self._held.pop(seq, None)
        if not self.is_consumed(seq):
            self._consume(seq)

    def _consume(self, seq: int) -> None:
        if seq != self.next_seq:
            self._consumed_ahead.add(seq)
            return
        self.next_seq += 1
        while self.next_seq in self._consumed_ahead:
            self._consumed_ahead.remove(self.next_seq)
            self.next_seq += 1

    def reset(self) -> None:
        """Drop everything and start again at sequence 0 (a new epoch)."""
        self.next_seq = 0
        self._held.clear()
        self._consumed_ahead.clear()
