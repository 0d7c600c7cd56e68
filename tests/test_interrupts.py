"""Ctrl-C inside ``next()`` (issue 48, step 3; dpex/client/_interrupts.py): one SIGINT
raised at each line the epoch executes in ``dpex/client/`` (a line tracer over the
in-memory driver, tests/fake_runtime.py), the loop calling ``next()`` again as a
notebook does. Every trial must give the exact epoch, none may hang. Before the fix
(the handler not held), the same trials hung (a result recorded as received and not
yet buffered) or dropped a batch (popped from the ordering buffer, not returned)."""

from __future__ import annotations

import os
import signal
import sys
import threading
import time

import dsets
import pytest
from fake_runtime import driver, indices, start

import dpex.client
from dpex import DpexDataLoader
from dpex.client import _interrupts
from dpex.client._scheduler import EPOCH_END

pytestmark = pytest.mark.timeout(120)

CLIENT = os.path.dirname(dpex.client.__file__) + os.sep
BATCHES = 12


@pytest.fixture(autouse=True)
def users_sigint(monkeypatch):
    """SIGINT as a user's process has it (a test runner's worker may ignore it)."""
    previous = signal.signal(signal.SIGINT, signal.default_int_handler)
    yield
    signal.signal(signal.SIGINT, previous)


class Hung(Exception):
    pass


class Injector:
    """A line tracer over dpex/client: SIGINT at the ``at``-th line it sees; past
    ``deadline`` it raises :class:`Hung` there (the epoch waits for nothing that comes)."""

    def __init__(self, at: int | None, deadline: float) -> None:
        self.at, self.lines, self.deadline = at, 0, deadline
        self.where = ""  # the line SIGINT came at

    def __call__(self, frame, event, arg):
        if not frame.f_code.co_filename.startswith(CLIENT):
            return None
        if event == "line":
            self.lines += 1
            if self.lines == self.at:
                self.where = f"{frame.f_code.co_filename[len(CLIENT):]}:{frame.f_lineno}"
                signal.raise_signal(signal.SIGINT)  # (raises here unless it is held)
            if time.monotonic() > self.deadline:
                raise Hung
        return self


def epoch_with_sigint(at: int | None, limit: float = 5.0) -> tuple[list, int, int]:
    """The epoch's payloads with SIGINT at line ``at``; (payloads, interrupts, lines)."""
    d, _, _, _ = driver(2, live=True)
    draw = start(d, BATCHES)
    got: list = []
    interrupts = 0
    injector = Injector(at, time.monotonic() + limit)
    sys.settrace(injector)
    try:
        while True:
            try:
                msg = d.next_message(draw)
            except KeyboardInterrupt:
                interrupts += 1
                sys.settrace(injector)  # (an exception from a tracer unsets it)
                continue  # (as a notebook's next cell does)
            except Hung:
                pytest.fail(f"SIGINT at {injector.where}: the epoch hung after {got}")
            if msg is EPOCH_END:
                break
            got.append(msg.payload)
        # a SIGINT held back as the last batch returned is raised by the next call
        # (the iterator raises StopIteration at EPOCH_END, which raises one held then)
        try:
            assert d.next_message(draw) is EPOCH_END
        except KeyboardInterrupt:
            interrupts += 1
        sys.settrace(None)
        try:
            with _interrupts.held():  # (what the iterator's next section does)
                pass
        except KeyboardInterrupt:
            interrupts += 1
    finally:
        sys.settrace(None)
        d.stop()
    return got, interrupts, injector.lines


def test_one_sigint_at_any_line_of_the_epoch_leaves_it_exact():
    clean, interrupts, lines = epoch_with_sigint(None)
    assert clean == indices(BATCHES) and interrupts == 0 and lines > 200
    step = max(1, lines // 300)  # (every line of the epoch's first batches: all of them)
    for at in list(range(1, 400)) + list(range(400, lines, step)):
        got, interrupts, _ = epoch_with_sigint(at)
        assert got == indices(BATCHES), f"SIGINT at line {at}: {got}"
        assert interrupts == 1, f"SIGINT at line {at} raised {interrupts} time(s)"


def test_outside_the_main_thread_and_with_sigint_ignored_nothing_is_held():
    seen = []

    def off_main():
        with _interrupts.held():
            seen.append(_interrupts._STATE.depth)

    thread = threading.Thread(target=off_main)
    thread.start()
    thread.join(10)
    assert seen == [0] and signal.getsignal(signal.SIGINT) is signal.default_int_handler
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    with _interrupts.held():
        signal.raise_signal(signal.SIGINT)  # (ignored, as without dpex)
        assert signal.getsignal(signal.SIGINT) is signal.SIG_IGN


def test_a_held_sigint_is_raised_at_a_wait_at_an_error_or_as_the_next_section_starts():
    with pytest.raises(KeyboardInterrupt):
        with _interrupts.held():
            signal.raise_signal(signal.SIGINT)  # held ...
            with _interrupts.interruptible():  # ... raised as the wait starts
                pytest.fail("the wait began with an interrupt held back")
    with pytest.raises(KeyboardInterrupt), _interrupts.held():
        with _interrupts.interruptible():
            signal.raise_signal(signal.SIGINT)  # in a wait: at once
            pytest.fail("a wait held the interrupt back")
    with pytest.raises(KeyboardInterrupt) as info:
        with _interrupts.held(keep_on_return=True):
            signal.raise_signal(signal.SIGINT)
            raise StopIteration  # (the epoch's end: the interrupt replaces it)
    assert isinstance(info.value.__context__, StopIteration)
    with _interrupts.held(keep_on_return=True):
        signal.raise_signal(signal.SIGINT)  # a batch is being returned: kept
    with pytest.raises(KeyboardInterrupt):
        signal.raise_signal(signal.SIGINT)  # outside a section: as without dpex
    with pytest.raises(KeyboardInterrupt):
        with _interrupts.held():  # the next section raises the one kept, first
            pytest.fail("the held interrupt was not raised as the section began")
    assert _interrupts._STATE.depth == 0


def test_a_handler_of_the_users_is_wrapped_and_called_as_it_would_be():
    calls = []
    signal.signal(signal.SIGINT, lambda signum, frame: calls.append(signum))
    with _interrupts.held():
        signal.raise_signal(signal.SIGINT)
        assert calls == []
    assert calls == [signal.SIGINT]
    signal.raise_signal(signal.SIGINT)
    assert calls == [signal.SIGINT] * 2


# -- with Ray: a storm of SIGINTs through a whole epoch --------------------------------


def epoch_under_storm(it, every: float = 0.003) -> tuple[list, int]:
    """The rest of ``it``'s epoch with a SIGINT sent to the main thread every ``every``
    seconds; the loop goes on after each, as a notebook's next cell does."""
    stop = threading.Event()
    main = threading.main_thread().ident

    def storm():
        while not stop.wait(every):
            signal.pthread_kill(main, signal.SIGINT)

    got: list = []
    interrupts, done = 0, False
    thread = threading.Thread(target=storm, daemon=True)
    thread.start()
    while True:
        try:
            if not done:
                for batch in it:  # (FOR_ITER: no signal check between next() and here)
                    got.append(batch)
                done = True
            stop.set()
            thread.join(10)
            break
        except KeyboardInterrupt:
            interrupts += 1
    return got, interrupts


@pytest.mark.usefixtures("ray_session")
@pytest.mark.timeout(300)
def test_a_storm_of_sigints_leaves_the_epoch_exact_and_the_next_one_healthy():
    """The read's Ray case: a SIGINT every 3 ms stalled the epoch at 13 of 500 batches
    and timed out the persistent iterator's next epoch."""
    kw = {"batch_size": 1, "num_workers": 2}
    dataset = dsets.Squares(300, max_sleep=0.002)
    expected = list(dsets.torch_loader(dataset, batch_size=1))
    with DpexDataLoader(dataset, distribute_mode=True, persistent_workers=True, timeout=60,
                        **kw) as loader:
        got, interrupts = epoch_under_storm(iter(loader))
        assert interrupts >= 20
        dsets.assert_same(expected, got, "stormed epoch")
        dsets.assert_same(expected, list(loader), "next epoch")
