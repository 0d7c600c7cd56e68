"""``state_dict()``'s question to the workers: the RNG states each had right after a
batch it computed (an RNG_QUERY out on the control socket, an ``RngReply`` back on the
handoff), waited for through the driver's event pump on the training thread."""

from __future__ import annotations

import time
from typing import Any

from dpex._protocol import Kind
from dpex.client._events import RngReply
from dpex.errors import DpexTimeoutError, ResumeStateError

__all__ = ["RngQuery"]

_RNG_QUERY_S = 30.0  # how long state_dict() waits for the workers' RNG states


class RngQuery:
    """The replies to the latest query, by (worker, epoch, seq): the driver hands each
    ``RngReply`` in (:meth:`reply`), :meth:`ask` sends a query and waits for them."""

    def __init__(self) -> None:
        self._replies: dict[tuple[int, int, int], RngReply] = {}

    def reply(self, event: RngReply) -> None:
        self._replies[(event.worker_id, event.epoch, event.seq)] = event

    def ask(self, driver: Any, asked: dict[int, tuple[int, int]], limit: float | None = None
            ) -> dict[int, dict | None] | None:
        """Each worker's RNG states right after the batch ``asked`` names, asked of the
        workers of ``driver`` (an ``EpochDriver``, whose ``receive_one`` brings the
        replies here). A worker not asked (none of its batches was taken) has the
        states it started with: those it was resumed with, or its seeded ones (left
        out: a resumed worker gets them anyway). None for a worker that no longer has
        them (it died, or was replaced: its replacement starts from its seed); None in
        all once the driver is closed. Raises ``DpexTimeoutError`` past ``limit``
        seconds, ``ResumeStateError`` for states too large to send."""
        if driver.runtime.closed:
            return None  # its workers are gone: nobody to ask
        self._replies = {}
        records = driver.sched.workers
        incarnations = {w: records[w].incarnation for w in asked}
        for w, (epoch, seq) in asked.items():
            driver.session.send(w, Kind.RNG_QUERY, epoch, seq)

        def answered(w: int) -> bool:
            return (w, *asked[w]) in self._replies

        limit = _RNG_QUERY_S if limit is None else limit
        deadline = time.monotonic() + limit
        while waiting := [w for w in asked if not answered(w)
                          and records[w].incarnation == incarnations[w]]:
            if time.monotonic() > deadline:
                raise DpexTimeoutError(f"state_dict(): workers {waiting} did not report their "
                                       f"RNG states within {limit:g} s")
            driver.receive_one(until=deadline)
        for w in asked:
            state = self._replies[(w, *asked[w])].state if answered(w) else None
            if isinstance(state, dict) and "error" in state:  # too large to send
                raise ResumeStateError(f"state_dict(): {state['error']}")
        started = {rec.id: rec.spec.rng_state for rec in records.records
                   if rec.spec.rng_state is not None}
        return {**started, **{w: self._replies[(w, *asked[w])].state if answered(w) else None
                              for w in asked}}
