"""When the training thread, waiting for an event, must wake, and what for (pure: the
time is passed in, so the rules run on a fake clock).

One object for every deadline the iterator keeps while it waits: its workers' start
(``startup_timeout``, from each start or replacement), the one placement check of a
start (a warning if the cluster cannot place them), the periodic look for lost
batches, torch's ``timeout`` for one batch (from when the wait began), the caller's
own ``until``, and a poll that checks the loop thread still runs.
"""

from __future__ import annotations

import enum

__all__ = ["Due", "Deadlines"]


class Due(enum.Enum):
    WAIT = "wait"  # nothing is due: wait for an event, at most the time given
    UNTIL = "until"  # the caller's ``until`` passed
    LOST_CHECK = "lost-check"
    PLACEMENT_CHECK = "placement-check"
    STARTUP_TIMED_OUT = "startup-timed-out"
    TIMED_OUT = "timed-out"  # torch's ``timeout`` for one batch


class Deadlines:
    """Invariant: a deadline that has passed is reported before any wait, the timeouts
    first; so a check that runs long cannot postpone a timeout (each check resets its
    own time before the next question)."""

    def __init__(self, now: float, *, timeout: float, startup_timeout: float,
                 lost_every: float = 1.0, placement_grace: float = 2.0,
                 poll: float = 5.0) -> None:
        self.timeout, self.startup_timeout = timeout, startup_timeout
        self.lost_every, self.placement_grace, self.poll = lost_every, placement_grace, poll
        self.startup_at = now + startup_timeout
        self.placement_at: float | None = now + placement_grace
        self.lost_at = now + lost_every

    def starting(self, now: float) -> None:
        """Workers start (the iterator's, or a replacement): the start-up limit and the
        placement check count from now."""
        self.startup_at = now + self.startup_timeout
        self.placement_at = now + self.placement_grace

    def placement_checked(self) -> None:
        self.placement_at = None

    def lost_due(self, now: float) -> bool:
        return now >= self.lost_at

    def lost_checked(self, now: float) -> None:
        self.lost_at = now + self.lost_every

    def wait_deadline(self, now: float, starting: bool) -> float | None:
        """The limit of one wait for an event that begins now: the start-up limit while
        workers start, else torch's ``timeout`` from now (None: 0, wait forever)."""
        if starting:
            return self.startup_at
        return now + self.timeout if self.timeout > 0 else None

    def next(self, now: float, deadline: float | None, starting: bool,
             until: float | None = None) -> tuple[Due, float]:
        """What is due now, or how long to wait for an event (``Due.WAIT``)."""
        if deadline is not None and now >= deadline:
            return (Due.STARTUP_TIMED_OUT if starting else Due.TIMED_OUT), 0.0
        if until is not None and now >= until:
            return Due.UNTIL, 0.0
        if now >= self.lost_at:
            return Due.LOST_CHECK, 0.0
        if starting and self.placement_at is not None and now >= self.placement_at:
            return Due.PLACEMENT_CHECK, 0.0
        ends = [now + self.poll, self.lost_at]
        ends += [t for t in (deadline, until) if t is not None]
        if starting and self.placement_at is not None:
            ends.append(self.placement_at)
        return Due.WAIT, min(ends) - now
