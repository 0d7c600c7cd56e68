"""One asyncio event loop (uvloop when installed) running in one owned thread."""

from __future__ import annotations

import asyncio
import concurrent.futures
import enum
import threading
from collections.abc import Awaitable, Callable
from typing import Any, TypeVar

from dpex.errors import DpexTimeoutError

__all__ = ["LoopThread", "new_event_loop"]

T = TypeVar("T")


def new_event_loop() -> asyncio.AbstractEventLoop:
    """A uvloop loop when uvloop is installed, asyncio's default otherwise."""
    try:
        import uvloop
    except ImportError:
        return asyncio.new_event_loop()
    return uvloop.new_event_loop()


class _State(enum.Enum):
    NEW = "new"
    RUNNING = "running"
    STOPPED = "stopped"


class LoopThread:
    """Owns a daemon thread that runs an event loop until :meth:`stop`.

    ``start()`` returns only once the loop runs; ``stop()`` is idempotent and
    joins the thread. Everything the loop owns (sockets, tasks) must be closed
    by a coroutine passed to ``stop(cleanup=...)``, which runs on the loop first.
    An exception raised by a function run with :meth:`call_soon` goes to
    ``on_error`` (on the loop thread) instead of only to asyncio's log.
    """

    def __init__(self, name: str,
                 on_error: Callable[[BaseException], None] | None = None) -> None:
        self.name = name
        self._on_error = on_error
        self._state = _State.NEW
        self._loop = new_event_loop()
        self._thread = threading.Thread(target=self._run, name=name, daemon=True)
        self._started = threading.Event()
        self._lock = threading.Lock()

    @property
    def loop(self) -> asyncio.AbstractEventLoop:
        return self._loop

    @property
    def running(self) -> bool:
        return self._state is _State.RUNNING and self._thread.is_alive()

    def _run(self) -> None:
        asyncio.set_event_loop(self._loop)
        self._loop.call_soon(self._started.set)
        try:
            self._loop.run_forever()
        finally:
            self._cancel_leftovers()
            self._loop.close()

    def _cancel_leftovers(self) -> None:
        tasks = [t for t in asyncio.all_tasks(self._loop) if not t.done()]
        for t in tasks:
            t.cancel()
        if tasks:
            self._loop.run_until_complete(asyncio.gather(*tasks, return_exceptions=True))

    def start(self, timeout: float = 10.0) -> None:
        with self._lock:
            if self._state is not _State.NEW:
                raise RuntimeError(f"{self.name}: start() called in state {self._state.value}")
            self._thread.start()
            if not self._started.wait(timeout):
                raise DpexTimeoutError(f"{self.name}: event loop did not start within {timeout} s")
            self._state = _State.RUNNING

    def call_soon(self, fn: Callable[..., Any], *args: Any) -> None:
        """Schedule ``fn(*args)`` on the loop from any thread (no wait).

        Raises ``RuntimeError`` once the loop is stopped: the call would be lost.
        """
        if self._state is not _State.RUNNING:
            raise RuntimeError(f"{self.name}: the event loop is {self._state.value}")
        self._loop.call_soon_threadsafe(self._call_guarded, fn, args)

    def _call_guarded(self, fn: Callable[..., Any], args: tuple) -> None:
        try:
            fn(*args)
        except BaseException as exc:
            if self._on_error is None:
                raise
            self._on_error(exc)

    def run(self, coro: Awaitable[T], timeout: float) -> T:
        """Run ``coro`` on the loop and wait for its result at most ``timeout`` s."""
        fut = asyncio.run_coroutine_threadsafe(coro, self._loop)
        try:
            return fut.result(timeout)
        except concurrent.futures.TimeoutError:
            fut.cancel()
            raise DpexTimeoutError(
                f"{self.name}: operation did not finish within {timeout} s") from None

    async def _finish(self, cleanup: Callable[[], Awaitable[Any]] | None) -> None:
        try:
            if cleanup is not None:
                await cleanup()
        finally:
            self._loop.stop()

    def stop(self, cleanup: Callable[[], Awaitable[Any]] | None = None, timeout: float = 10.0) -> None:
        """Run ``cleanup()`` on the loop, stop it and join the thread. Idempotent."""
        with self._lock:
            if self._state is not _State.RUNNING:
                self._state = _State.STOPPED
                return
            self._state = _State.STOPPED
        if threading.current_thread() is self._thread:
            # A finalizer run by the garbage collector on this very thread: the loop
            # cannot be waited on from inside, so clean up and stop it from within.
            self._loop.create_task(self._finish(cleanup))
            return
        if cleanup is not None and self._thread.is_alive():
            try:
                self.run(cleanup(), timeout)
            except Exception:
                pass  # the loop is going away; what cleanup left is cancelled below
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout)
