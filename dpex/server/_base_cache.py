"""A host's fork bases, by shipment digest (:mod:`dpex.server._fork_base`).

A session of a loader forks from the base that holds that loader's shipment; the first
session of a shipment on this host starts one (from the bytes its ``serve`` call
brought: the trainer's memfd, or the object store's copy). One start runs per digest at
a time; sessions arriving meanwhile wait for it.

Invariants: a digest maps to a base that is starting, alive, or known unusable (None:
its loader left threads running, so each session unpickles its own); a start that
failed (the memfd gone before the base mapped it:
:class:`~dpex._shipfile.ShipmentUnavailable`) or a base that died is never handed out
again: the next session with bytes starts another. A base no session uses is stopped,
but those of the :data:`IDLE_BASES` latest digests (a train and a validation loader
take turns), and a changed dataset's at once (:meth:`forget`).

Pure but for the ``start`` it is given (a blocking call, run on the loop's executor).

The host wing's processes, what each holds and when it ends: NOTE [ The worker
host's processes ] in :mod:`dpex.server._fork_base`.
"""

from __future__ import annotations

import asyncio
from collections.abc import Callable
from typing import Any, Protocol

from dpex._spec import Parcel

__all__ = ["IDLE_BASES", "Base", "BaseCache"]

IDLE_BASES = 3  # fork bases a host keeps while no session uses them (the latest ones)


class Base(Protocol):
    sessions: int  # live sessions forked from it (counted by the cache's users)

    def alive(self) -> bool: ...

    def stop(self) -> None: ...


class BaseCache:
    """The bases of one host. Used from its event loop only."""

    def __init__(self, start: Callable[[str, Any], Base | None], idle: int = IDLE_BASES) -> None:
        """``start(digest, data)``: a started base holding ``data`` (blocking), None when
        the loader cannot be forked from; raises when it could not start."""
        self._start = start
        self._idle = idle
        self._bases: dict[str, asyncio.Future] = {}
        self._recent: list[str] = []  # digests sessions asked for, the latest last

    def forget(self, key: str | None) -> None:
        """Shipment ``key`` was replaced (its dataset changed): not kept idle."""
        if key in self._recent:
            self._recent.remove(key)

    async def base_for(self, key: str | None, shipped: Parcel) -> Base | None:
        """The base of shipment ``key`` (counted as used: :meth:`release` it), started
        from ``shipped`` if there is none, it died or its start failed; None when it
        cannot be used (or ``key`` is None). Raises what the start raised (to every
        session waiting for it); ``LookupError`` where a start is needed and ``shipped``
        holds nothing (no copy reached this worker)."""
        if key is None:
            return None
        self.forget(key)
        self._recent.append(key)
        pending = self._bases.get(key)
        if pending is not None and pending.done():
            failed = pending.cancelled() or pending.exception() is not None
            if not failed and (pending.result() is None or pending.result().alive()):
                return self._use(pending.result())
            pending = None  # it failed to start, or died (killed): start another
        if pending is None:
            self._bases.pop(key, None)
            self.retire()
            if shipped.empty:
                raise LookupError("no copy of the dataset reached this worker")
            pending = asyncio.ensure_future(asyncio.get_running_loop().run_in_executor(
                None, self._start, key, shipped))
            self._bases[key] = pending
        try:
            return self._use(await asyncio.shield(pending))
        except BaseException:
            if pending.done() and self._bases.get(key) is pending:
                del self._bases[key]  # (a failed start is not held, nor what it raised)
            raise

    @staticmethod
    def _use(base: Base | None) -> Base | None:
        if base is not None:
            base.sessions += 1
        return base

    def release(self, base: Base | None) -> None:
        """A session forked from ``base`` ended."""
        if base is not None:
            base.sessions -= 1
            self.retire()

    def retire(self) -> None:
        """Stop the bases no session uses but the latest ``idle``; drop failed starts."""
        keep = set(self._recent[-self._idle:])
        del self._recent[:-self._idle]
        for key, pending in list(self._bases.items()):
            if not pending.done():
                continue
            if pending.cancelled() or pending.exception() is not None:
                del self._bases[key]
                continue
            base = pending.result()
            if key not in keep and (base is None or base.sessions == 0):
                del self._bases[key]
                if base is not None:
                    base.stop()

    def held(self) -> dict[str, Base | None]:
        """The started bases by digest (and None for unusable loaders)."""
        return {key: pending.result() for key, pending in self._bases.items()
                if pending.done() and not pending.cancelled() and pending.exception() is None}
