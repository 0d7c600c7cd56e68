"""Where the trainer's control messages go, per worker id: pure bookkeeping (no socket).

A worker id's messages go to the ROUTER identity of its current incarnation (made
from the session key: nobody without it can name a route); until that
incarnation's HELLO arrives (or after its connection was lost) they are held, and
sent in order on the HELLO. Each incarnation numbers its control messages anew
(a replay is rejected by the worker), and the epoch's RESUME / SKIP marks go with
every TASKS message (``_epoch_marks``).
"""

from __future__ import annotations

import collections
import itertools
from typing import Any

from dpex._epoch_marks import SentMarks
from dpex._protocol import Kind, Wire, worker_identity

__all__ = ["ControlRoutes"]


class ControlRoutes:
    """Per worker id: its route (identity), whether it is ready, what is held for it,
    its message numbering and this epoch's marks."""

    def __init__(self, wire: Wire) -> None:
        self.wire = wire
        self.ready: set[int] = set()
        self.unroutable = 0  # messages held because their worker's route was gone
        self._identities: dict[int, bytes] = {}
        self._held: dict[int, list[list[bytes]]] = collections.defaultdict(list)
        self._seq: dict[int, itertools.count] = collections.defaultdict(itertools.count)
        self.marks = SentMarks()

    def identity(self, worker_id: int) -> bytes:
        found = self._identities.get(worker_id)
        if found is None:  # its first incarnation's (kept: a keyed hash per message costs)
            found = self._identities[worker_id] = worker_identity(worker_id, 0, self.wire.key)
        return found

    def expect(self, worker_id: int, incarnation: int) -> None:
        """A replacement for ``worker_id`` is starting: forget its predecessor's route,
        numbering and marks and whatever was held for it; hold anew until its HELLO."""
        self._identities[worker_id] = worker_identity(worker_id, incarnation, self.wire.key)
        self.ready.discard(worker_id)
        self._held.pop(worker_id, None)
        self._seq.pop(worker_id, None)
        self.marks.replaced(worker_id)

    def forget(self, worker_id: int) -> None:
        """A retired worker: not ready, nothing held for it."""
        self.ready.discard(worker_id)
        self._held.pop(worker_id, None)

    def hello(self, worker_id: int) -> list[list[bytes]]:
        """The worker announced itself: it is ready; returns what was held, in order."""
        self.ready.add(worker_id)
        return self._held.pop(worker_id, [])

    def encode(self, worker_id: int, kind: Kind, epoch: int, payload: Any) -> list[bytes]:
        """A control message's frames, numbered for the worker's incarnation; a RESUME
        or SKIP is kept as a mark of this epoch (a TASKS carries the marks)."""
        if kind is Kind.RESUME:
            self.marks.resume(worker_id, epoch, payload)
        elif kind is Kind.SKIP:
            self.marks.skip(worker_id, epoch, payload)
        elif kind is Kind.TASKS:
            payload = (payload, self.marks.of(worker_id))
        return self.wire.encode(kind, epoch, next(self._seq[worker_id]), worker_id, payload)

    def hold(self, worker_id: int, frames: list[bytes], lost: bool = False) -> None:
        """Keep ``frames`` until the worker's next HELLO; ``lost``: its route was gone
        (it died, or its connection broke and it reconnects)."""
        if lost:
            self.unroutable += 1
            self.ready.discard(worker_id)
        self._held[worker_id].append(frames)
