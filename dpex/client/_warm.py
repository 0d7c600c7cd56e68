"""Warm worker processes: a trainer process's idle worker actors, kept for its next
iterator.

torch starts its worker processes afresh for every iterator (``persistent_workers``
is off by default) and that costs it ~0.1 s; a Ray actor costs seconds. So when an
iterator ends, its workers' sessions are ended (``ray.cancel`` of their ``serve``
call: sockets closed, compute thread joined) and each actor that is then provably
idle (no session, no compute thread left: ``DpexWorker.reusable``) waits here, for
at most its loader's ``warm_worker_timeout`` seconds, for the next iterator with
the same actor options on the same node. A new iterator's session on it ships the
dataset, seeds, ``worker_init_fn`` and ``get_worker_info()`` afresh, exactly as a
fresh worker's (module-level state of the process is what it keeps).

The pool belongs to this process: its actors are ordinary (not detached) actors of
this Ray driver, so they end with it even when it is killed, and :func:`release`
(also run at exit) kills the idle ones at once. One thread, ``dpex-warm``, checks
returning actors and retires expired ones; it ends when nothing is left to watch.

After the user's ``ray.shutdown()`` the pool calls Ray no more (each of its calls
would start a new Ray, see :mod:`dpex._ray_guard`): its actors went with their
driver, so it forgets them. ``release()`` first runs the teardowns still queued on
the reaper thread (dropped iterators), so that called before ``ray.shutdown()`` it
leaves nothing for a background thread to do afterwards.
"""

from __future__ import annotations

import atexit
import logging
import threading
import time
from dataclasses import dataclass, field
from typing import Any

from dpex import _ray_guard
from dpex._reaper import flush as flush_teardowns

__all__ = ["WarmPool", "POOL", "release"]

logger = logging.getLogger("dpex")

_CHECK_S = 10.0  # how long a returning actor may take to end its session
_TAKE_WAIT_S = 5.0  # how long a new worker waits for a returning one (vs. seconds to start)
_TICK_S = 0.5
_FLUSH_S = 10.0  # how long release() waits for queued teardowns


@dataclass
class _Entry:
    actor: Any
    key: str
    node: str | None
    keep_s: float
    refs: list = field(default_factory=list)  # its ended sessions' serve calls (returning)
    since: float = field(default_factory=time.monotonic)
    job: str | None = None  # the Ray connection it belongs to (_ray_guard.job_id)


class WarmPool:
    """Idle worker actors by (options, node). Thread-safe."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._settled = threading.Condition(self._lock)  # an entry left "returning"
        self._idle: list[_Entry] = []
        self._returning: list[_Entry] = []
        self._thread: threading.Thread | None = None
        self._wake = threading.Event()

    # -- what a worker group calls -----------------------------------------------

    def take(self, key: str, node: str | None, wait: bool = True) -> Any | None:
        """An idle actor with options ``key`` on ``node`` (any node for ``None``), or
        None. With ``wait``, one that is still returning (its iterator ended a moment
        ago: a validation loop right after training) is waited for, briefly; without
        (a running epoch's replacement or added worker, whose start the training
        thread waits for), never."""

        job = _job()

        def fits(entry: _Entry) -> bool:
            return entry.key == key and (node is None or entry.node == node) and (
                entry.job == job)

        deadline = time.monotonic() + (_TAKE_WAIT_S if wait else 0.0)
        self._forget_other_jobs(job)
        with self._lock:
            while True:
                for i, entry in enumerate(self._idle):
                    if fits(entry):
                        del self._idle[i]
                        return entry.actor
                left = deadline - time.monotonic()
                if left <= 0 or not any(fits(e) for e in self._returning):
                    return None
                self._settled.wait(left)

    def give_back(self, actor: Any, refs: list, key: str, node: str | None,
                  keep_s: float) -> None:
        """An iterator ended its sessions on ``actor`` (``refs``: the serve calls it
        cancelled); keep the actor ``keep_s`` seconds once it proves idle. With Ray
        shut down meanwhile it is gone with its driver: nothing is kept."""
        job = _job()
        if job is None:
            return
        with self._lock:
            self._returning.append(_Entry(actor, key, node, keep_s, list(refs), job=job))
            self._ensure_thread()
        self._wake.set()

    def keep_idle(self, actor: Any, key: str, node: str | None, keep_s: float) -> None:
        """Keep ``actor``, just started and serving nothing (a host started early, as
        its loader was built), idle for ``keep_s`` seconds."""
        job = _job()
        if job is None:
            return
        with self._lock:
            self._idle.append(_Entry(actor, key, node, keep_s, job=job))
            self._settled.notify_all()
            self._ensure_thread()
        self._wake.set()

    def has_idle(self, key: str, node: str | None) -> bool:
        """Whether an idle or returning actor with options ``key`` is kept on ``node``."""
        job = _job()
        with self._lock:
            return any(e.key == key and e.node == node and e.job == job
                       for e in self._idle + self._returning)

    def idle_count(self) -> int:
        with self._lock:
            return len(self._idle)

    def actor_ids(self) -> set[str]:
        """The Ray actor ids of every idle and returning actor."""
        with self._lock:
            return {_ray_guard.actor_id(e.actor) for e in self._idle + self._returning}

    def release(self) -> int:
        """Kill every idle and returning actor now; return how many. With Ray shut
        down they are gone with their driver already: forgotten, nothing is called."""
        with self._lock:
            entries, self._idle, self._returning = self._idle + self._returning, [], []
            self._settled.notify_all()
        for entry in entries:
            _kill(entry.actor)
        return len(entries)

    def _forget(self) -> None:
        """Ray was shut down: its actors ended with their driver."""
        with self._lock:
            self._idle, self._returning = [], []
            self._settled.notify_all()

    def _forget_other_jobs(self, job: str | None) -> None:
        """Drop the actors of an earlier connection (``ray.shutdown()`` then
        ``ray.init()``: they ended with that driver, and their handles mean nothing to
        this one)."""
        with self._lock:
            self._idle = [e for e in self._idle if e.job == job]
            self._returning = [e for e in self._returning if e.job == job]
            self._settled.notify_all()

    def wait_settled(self, timeout: float) -> bool:
        """Wait until no returning actor is left unchecked (tests, benchmarks)."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            with self._lock:
                if not self._returning:
                    return True
            time.sleep(0.02)
        return False

    # -- the dpex-warm thread ------------------------------------------------------

    def _ensure_thread(self) -> None:  # lock held
        if self._thread is None or not self._thread.is_alive():
            self._thread = threading.Thread(target=self._run, name="dpex-warm", daemon=True)
            self._thread.start()

    def _run(self) -> None:
        failing = False  # logged once per run of failed rounds, not every round
        while True:
            try:
                self._round()
                failing = False
            except Exception:  # a Ray call failed (shut down, GCS busy): next round
                if not _ray_guard.ray_up():
                    self._forget()  # (and the thread ends, below)
                elif not failing:
                    failing = True
                    logger.warning("dpex warm pool: a check failed; trying again each "
                                   "%g s (logged once)", _TICK_S, exc_info=True)
                    self._wake.wait(_TICK_S)
                else:
                    logger.debug("dpex warm pool: a check failed again", exc_info=True)
                    self._wake.wait(_TICK_S)
            with self._lock:
                if not self._idle and not self._returning:
                    self._thread = None
                    return

    def _round(self) -> None:
        """One check of returning and expired actors; raises RayDown once Ray is shut
        down (the caller forgets them)."""
        self._forget_other_jobs(_ray_guard.job_id())  # (raises RayDown once shut down)
        with self._lock:
            refs = [r for e in self._returning for r in e.refs]
        if refs:  # wake as soon as a session ends
            _ray_guard.wait(refs, num_returns=1, timeout=_TICK_S)
        else:
            self._wake.wait(_TICK_S)
        self._wake.clear()
        self._check_returning()
        self._expire()

    def _check_returning(self) -> None:
        with self._lock:
            returning = list(self._returning)
        for entry in returning:
            done = not entry.refs or len(_ray_guard.wait(
                entry.refs, num_returns=len(entry.refs), timeout=0)[0]) == len(entry.refs)
            late = time.monotonic() - entry.since > _CHECK_S
            if not done and not late:
                continue
            keep = done and _reusable(entry.actor)
            with self._lock:  # it stays "returning" until decided: release() sees it
                released = entry not in self._returning
                if not released:
                    self._returning.remove(entry)
                    if keep:
                        entry.refs, entry.since = [], time.monotonic()
                        self._idle.append(entry)
                self._settled.notify_all()
            if released or not keep:
                _kill(entry.actor)

    def _expire(self) -> None:
        now = time.monotonic()
        with self._lock:
            expired = [e for e in self._idle if now - e.since >= e.keep_s]
            self._idle = [e for e in self._idle if e not in expired]
        for entry in expired:
            _kill(entry.actor)


def _job() -> str | None:
    """This connection's job id, None with Ray shut down."""
    try:
        return _ray_guard.job_id()
    except Exception:
        return None


def _reusable(actor: Any) -> bool:
    try:
        # (keep(): reusable(), and its forkserver starts while it idles)
        return bool(_ray_guard.get(_ray_guard.call(actor.keep), timeout=_CHECK_S))
    except Exception:  # dead, too slow to answer, or Ray shut down: not worth keeping
        return False


def _kill(actor: Any) -> None:
    try:
        _ray_guard.kill(actor)
    except Exception:
        pass  # already gone (or Ray shut down: gone with its driver)


POOL = WarmPool()


def release() -> int:
    """Kill this process's idle warm workers now (they also end with it); return how
    many. ``dpex.release_warm_workers()``, also dpex's exit hook. It first runs the
    teardowns still queued for dropped iterators (which hand their workers here), so
    that, called before ``ray.shutdown()``, no background thread is left to call Ray
    afterwards."""
    flush_teardowns(_FLUSH_S)
    return POOL.release()


atexit.register(release)
