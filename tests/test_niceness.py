"""A worker host takes the trainer's niceness for all of its threads (Ray starts its
workers at 15: dpex/server/_actor.py's _take_niceness); the Ray tier checks the
processes (tests/test_hosts.py)."""

import logging
import os
import threading

from dpex.server import _actor


def _nice(tid: int) -> int:
    return os.getpriority(os.PRIO_PROCESS, tid)


def test_every_thread_of_the_process_takes_the_niceness_and_later_threads_inherit_it():
    mine = _nice(0)
    seen, go = {}, threading.Event()

    def lowered():
        os.setpriority(os.PRIO_PROCESS, 0, mine + 5)  # (as Ray's 15: always allowed)
        seen["tid"] = threading.get_native_id()
        go.wait(10)
        seen["after"] = _nice(0)
        child = threading.Thread(target=lambda: seen.setdefault("child", _nice(0)))
        child.start()
        child.join(10)

    thread = threading.Thread(target=lowered)
    thread.start()
    while "tid" not in seen:
        thread.join(0.01)
    assert _nice(seen["tid"]) == mine + 5
    _actor._take_niceness(mine)
    go.set()
    thread.join(10)
    assert seen["after"] == mine and seen["child"] == mine


def test_where_the_priority_may_not_be_raised_the_log_says_how_to_start_the_cluster(
        monkeypatch, caplog):
    def refuse(which, who, niceness):
        raise PermissionError(13, "Permission denied")

    monkeypatch.setattr(_actor.os, "getpriority", lambda which, who: 15)
    monkeypatch.setattr(_actor.os, "setpriority", refuse)
    with caplog.at_level(logging.WARNING, logger="dpex"):
        _actor._take_niceness(0)
    assert "niceness 15, below the trainer's 0" in caplog.text
    assert "RAY_worker_niceness=0" in caplog.text


def test_no_niceness_given_changes_nothing(monkeypatch):
    monkeypatch.setattr(_actor.os, "setpriority", lambda *a: (_ for _ in ()).throw(
        AssertionError("set")))
    _actor._take_niceness(None)
