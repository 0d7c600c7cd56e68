"""When to add or remove workers (``num_workers=dpex.Autoscale(...)``): pure, no I/O.

Every ``interval`` the iterator reports the training loop's cumulative time waiting
for data and batches taken, the workers' recent time per batch (measured by the
scheduler: from when a worker could start a task to its result) and how many
more workers the cluster can place. Over that window:

- ``stall`` = time waited / time passed (the data-stall share);
- ``step`` = the loop's own time per batch (time not waited / batches taken);
- ``need`` = ``batch_s / step``: the workers that keep up with the loop.

Rules (hysteresis: up fast, down slowly):

1. ``stall > target``: go straight to ``need`` plus 15 % (at least one more), up
   to ``max``, the room and a ceiling found earlier. Remember the loop's rate.
2. The first window after a scale-up *has settled* is its trial (settled: every
   added worker sent its first result, which a session loading its dataset makes
   well after its HELLO, and the loop took every batch dispatched before the
   scale-up, which the old workers make at the old pace): if the loop's rate rose by less
   than 30 % of what the added workers should have given (the workers compete for
   the same CPUs, say), the workers go to the count the gain is worth (the old count
   times the rate's growth), which becomes a ceiling. The ceiling is tried again
   after ``_CEILING_WINDOWS`` windows, then twice as long after each time it holds.
3. ``stall < target / 2`` for ``patience`` windows in a row: down to ``need`` plus
   35 % if that is fewer, not under ``min``.
4. No scale-up while ``need`` plus 15 % is no more than the workers there are (the
   wait may be elsewhere); if the stall lasts ``patience`` windows, one more worker
   is tried (and judged as in rule 2).
5. No decision while a scale-up settles (rule 2) nor in the window in which it
   settled, for two windows after a change, and in the first window of an epoch.
"""

from __future__ import annotations

import collections
import math
from typing import Any, NamedTuple

from dpex._autoscale import Autoscale

__all__ = ["Autoscaler"]

_UP_MARGIN = 0.15
_DOWN_MARGIN = 0.35
_GAIN = 0.3  # of the proportional gain a scale-up must show to be kept
_HOLD_WINDOWS = 2
_CEILING_WINDOWS = 30


class _Measurement(NamedTuple):
    """What one window measured (the module docstring's ``stall``, ``step`` and ``need``)."""

    span: float  # seconds it lasted
    stall: float
    rate: float  # batches the loop took per second
    batch_s: float | None  # the workers' recent time per batch (None: not measured)
    step: float | None  # None: the loop took no batch
    need: float | None

    def figures(self) -> dict[str, float | None]:
        """What a decision records with its reason."""
        return {"stall_share": self.stall, "batch_s": self.batch_s, "step_s": self.step,
                "batches_per_s": self.rate, "need": self.need}

    def explain(self) -> str:
        """Where ``need`` comes from, for a decision's reason."""
        if self.need is None:
            return "no batch time measured yet"
        assert self.batch_s is not None and self.step is not None
        return (f"a batch takes a worker {self.batch_s * 1e3:.0f} ms and the loop "
                f"{self.step * 1e3:.0f} ms: {self.need:.1f} workers keep up")


class Autoscaler:
    def __init__(self, policy: Autoscale, most: int, now: float) -> None:
        """``most``: the policy's ``max``, resolved (the cluster's CPUs if it has none)."""
        self.policy, self.most = policy, max(policy.min, most)
        self.started = now
        self.history: collections.deque[dict] = collections.deque(maxlen=3600)
        self.decisions: collections.deque[dict] = collections.deque(maxlen=200)
        self._window: tuple[float, float, int] | None = None
        self._calm = 0
        self._blocked = 0  # stalled windows in a row that rule 4 held back
        self._hold = 0  # windows left before the next decision
        self._trial: tuple[int, float] | None = None  # (workers before, loop rate before)
        self._ceiling: tuple[int, float] | None = None  # (workers, until when)
        self._backoff = _CEILING_WINDOWS  # doubles each time a ceiling is found again
        self._drain_at: int | None = None  # taken count at which a scale-up's backlog is gone
        self._settling = False  # the last window had a scale-up settling

    def begin(self, now: float, waited: float, taken: int) -> None:
        """Start a fresh window (a new epoch: the time between epochs is not the loop's).
        Its first window only measures: the pipeline is still filling."""
        self._window = (now, waited, taken)
        self._hold = max(self._hold, 1)

    def due(self, now: float) -> bool:
        """Whether a window has passed (``tick`` would measure): the caller gathers its
        inputs only then."""
        return self._window is None or now - self._window[0] >= self.policy.interval

    def tick(self, now: float, waited: float, taken: int, workers: int, starting: int,
             batch_s: float | None, room: int | None, in_flight: int = 0) -> int | None:
        """The worker count to go to, or None to stay. ``waited``/``taken``: the loop's
        cumulative wait (s) and batches; ``starting``: added workers without a first
        result yet; ``room``: how many more workers the cluster can place (None: no
        limit); ``in_flight``: batches dispatched and not yet taken."""
        measured = self._measure(now, waited, taken, workers, batch_s)
        if measured is None or self._paused(starting, taken):
            return None
        judged = self._judge_trial(now, workers, measured)  # rule 2
        if judged is not None:
            return judged
        if self._ceiling is not None and now >= self._ceiling[1]:
            self._ceiling = None  # its time is up: tried again (rule 2)
        if measured.stall > self.policy.target:
            return self._scale_up(now, workers, room, taken, in_flight, measured)
        return self._scale_down(now, workers, measured)

    def _measure(self, now: float, waited: float, taken: int, workers: int,
                 batch_s: float | None) -> _Measurement | None:
        """What the window that ends now measured, recorded in ``history``; None while
        no window has passed (the first call only starts one)."""
        if self._window is None:
            self.begin(now, waited, taken)
            return None
        t0, waited0, taken0 = self._window
        span = now - t0
        if span < self.policy.interval:
            return None
        self._window = (now, waited, taken)
        stall = min(1.0, max(0.0, (waited - waited0) / span))
        count = taken - taken0
        rate = count / span
        step = (span - (waited - waited0)) / count if count else None
        need = batch_s / step if batch_s and step else None
        self.history.append({"t": now - self.started, "workers": workers,
                             "stall_share": stall, "batches_per_s": rate,
                             "batch_s": batch_s, "step_s": step})
        return _Measurement(span, stall, rate, batch_s, step, need)

    def _paused(self, starting: int, taken: int) -> bool:
        """Whether this window makes no decision (rule 5): a scale-up still settles or
        settled in it, or a hold (after a change, an epoch's first window) runs."""
        settling = bool(starting) or (self._drain_at is not None and taken < self._drain_at)
        if settling or self._settling:  # (the window it settled in is partly its own)
            self._settling = settling
            if not settling:
                self._drain_at = None
            return True
        if self._hold:
            self._hold -= 1
            return True
        return False

    def _judge_trial(self, now: float, workers: int, measured: _Measurement) -> int | None:
        """Rule 2: the first window after a scale-up settled judges it (once). If the
        loop still stalls and its rate grew by less than the added workers should have
        given, the count the gain is worth, which becomes a ceiling; else None."""
        trial, self._trial = self._trial, None
        if trial is None or measured.stall <= self.policy.target or workers <= trial[0]:
            return None
        before, rate_before = trial
        rate = measured.rate
        expected = rate_before * (1 + _GAIN * (workers - before) / before)
        # the workers the gain is worth: as many as the rate grew (x before)
        keep = max(before, min(workers, round(before * rate / max(rate_before, 1e-9))))
        if rate >= expected or keep >= workers:
            return None
        self._ceiling = (keep, now + self._backoff * self.policy.interval)
        self._backoff *= 2
        return self._decide(now, workers, keep, measured.figures(), (
            f"{before} -> {workers} workers took the loop from {rate_before:.1f} to "
            f"only {rate:.1f} batches/s: more workers than {keep} do not help here "
            f"(they compete for CPUs?); {keep} for now"))

    def _scale_up(self, now: float, workers: int, room: int | None, taken: int,
                  in_flight: int, measured: _Measurement) -> int | None:
        """Rules 1 and 4 for a window that stalled over the target: the count to go to
        (up to ``max``, the room and the ceiling), started as a trial; or None."""
        stall, need = measured.stall, measured.need
        self._calm = 0
        enough = need is not None and need * (1 + _UP_MARGIN) <= workers
        self._blocked = self._blocked + 1 if enough else 0
        if enough and self._blocked < self.policy.patience:
            return None  # enough by their batch times: the wait may be elsewhere (a
            # slow start, the transfer); if it lasts, one more is tried (a trial)
        top = self.most if self._ceiling is None else min(self.most, self._ceiling[0])
        if room is not None:
            top = min(top, workers + room)
        if workers >= top:
            return None
        want = workers * 2 if need is None else math.ceil(need * (1 + _UP_MARGIN))
        new = min(top, workers + 1 if enough else max(workers + 1, want))
        self._blocked = 0
        self._trial = (workers, measured.rate)
        self._drain_at = taken + in_flight  # what the old workers hold comes first
        return self._decide(now, workers, new, measured.figures(), (
            f"the loop waited for data {stall:.0%} of the last {measured.span:.1f} s "
            f"(target {self.policy.target:.0%}); {measured.explain()}"))

    def _scale_down(self, now: float, workers: int, measured: _Measurement) -> int | None:
        """Rule 3 for a window that did not stall over the target: after ``patience``
        calm windows in a row, the fewer workers that keep up; or None."""
        self._calm = self._calm + 1 if measured.stall < self.policy.target / 2 else 0
        if self._calm < self.policy.patience or workers <= self.policy.min:
            return None
        need = measured.need
        want = workers - 1 if need is None else math.ceil(need * (1 + _DOWN_MARGIN))
        new = max(self.policy.min, want)
        self._calm = 0
        if new >= workers:
            return None  # calm because it has what it needs
        return self._decide(now, workers, new, measured.figures(), (
            f"the loop waited for data {measured.stall:.0%} of its time for "
            f"{self.policy.patience} measurements; {measured.explain()}"))

    def _decide(self, now: float, old: int, new: int, figures: dict, reason: str) -> int:
        self._hold = _HOLD_WINDOWS
        self.decisions.append({"t": now - self.started, "from": old, "to": new,
                               "reason": reason, **figures})
        return new

    def report(self, workers: int) -> dict[str, Any]:
        """For ``loader.stats()["autoscale"]``."""
        return {"min": self.policy.min, "max": self.most, "target": self.policy.target,
                "workers": workers, "ceiling": None if self._ceiling is None
                else self._ceiling[0],
                # (copied at once: stats() may run on another thread than tick())
                "decisions": [dict(d) for d in self.decisions.copy()],
                "history": [dict(h) for h in self.history.copy()]}
