"""Fleet rules without Ray: finding a fleet's workers, choosing where a session goes
(and waiting while Ray restarts them), removing workers, and the ``dpex fleet`` command's
argument checks, and an interrupted stop (its drain undone). Ray's calls are replaced by
fakes driven on a fake clock."""

import pytest

from dpex import FleetError, cli
from dpex import _fleet_registry as registry

# -- finding a fleet's workers ---------------------------------------------------------


def test_a_worker_removed_between_listing_and_lookup_is_treated_as_gone(monkeypatch):
    listed = [{"namespace": "dpex", "name": f"prep/{i}"} for i in range(3)]
    monkeypatch.setattr(registry.ray.util, "list_named_actors", lambda all_namespaces: listed)

    def get_actor(name, namespace):
        if name == "prep/1":  # removed by `dpex fleet scale` after the listing
            raise ValueError(f"Failed to look up actor with name '{name}'")
        return f"handle {name}"

    monkeypatch.setattr(registry.ray, "get_actor", get_actor)
    assert registry.fleet_workers("prep") == [(0, "handle prep/0"), (2, "handle prep/2")]


# -- choosing workers: waiting for a restart -------------------------------------------


class FakeClock:
    def __init__(self) -> None:
        self.now = 0.0

    def __call__(self) -> float:
        return self.now

    def sleep(self, s: float) -> None:
        assert s > 0
        self.now += s


def stats(sessions=0, draining=False):
    return {"versions": registry.local_versions(), "sessions_active": sessions,
            "draining": draining, "node_ip": "10.0.0.1"}


def fake_fleet(monkeypatch, clock, answers):
    """A 1-worker fleet whose worker answers ``fleet_stats`` from ``answers(now)``."""
    monkeypatch.setattr(registry, "fleet_workers", lambda fleet: [(0, "worker 0")])
    monkeypatch.setattr(registry, "sample", lambda actors: answers(clock()))


def test_choosing_waits_for_ray_to_restart_the_only_worker(monkeypatch):
    clock = FakeClock()
    # dead until t=7 s (Ray restarts it), then it answers
    fake_fleet(monkeypatch, clock, lambda now: {} if now < 7.0 else {0: stats()})
    chosen = registry.choose_workers("prep", 2, wait_s=120.0, clock=clock, sleep=clock.sleep)
    assert chosen == ["worker 0", "worker 0"] and 7.0 <= clock.now < 9.0


def test_choosing_fails_after_the_wait_naming_it(monkeypatch):
    clock = FakeClock()
    fake_fleet(monkeypatch, clock, lambda now: {})
    with pytest.raises(FleetError, match=r"no worker of fleet 'prep' answered within "
                                         r"startup_timeout=30 s: .*1 worker.*restart"):
        registry.choose_workers("prep", 1, wait_s=30.0, clock=clock, sleep=clock.sleep)
    assert 30.0 <= clock.now < 32.0


def test_without_a_wait_choosing_fails_at_once(monkeypatch):
    clock = FakeClock()
    fake_fleet(monkeypatch, clock, lambda now: {})
    with pytest.raises(FleetError, match="no worker of fleet 'prep' answered"):
        registry.choose_workers("prep", 1, clock=clock, sleep=clock.sleep)
    assert clock.now == 0.0


def test_a_fleet_whose_every_worker_drains_takes_no_new_session(monkeypatch):
    clock = FakeClock()
    fake_fleet(monkeypatch, clock, lambda now: {0: stats(draining=True)})
    with pytest.raises(FleetError, match=r"fleet 'prep' is being stopped"):
        registry.choose_workers("prep", 1, wait_s=30.0, clock=clock, sleep=clock.sleep)


def test_draining_workers_are_passed_over(monkeypatch):
    monkeypatch.setattr(registry, "fleet_workers", lambda fleet: [(0, "w0"), (1, "w1")])
    monkeypatch.setattr(registry, "sample",
                        lambda actors: {0: stats(draining=True), 1: stats(sessions=5)})
    assert registry.choose_workers("prep", 3) == ["w1"] * 3


# -- the command's arguments -----------------------------------------------------------


@pytest.mark.parametrize("args,match", [
    (["start", "--workers", "2", "--session-timeout", "0"], "--session-timeout"),
    (["start", "--workers", "2", "--session-timeout", "nan"], "--session-timeout"),
    (["start", "--workers", "2", "--session-timeout", "-3"], "--session-timeout"),
    (["start", "--workers", "0"], "--workers"),
    (["scale", "--workers", "0"], "--workers"),
    (["start", "--workers", "2", "--timeout", "0"], "--timeout"),
    (["stop", "--timeout", "-1"], "--timeout"),
    (["autoscale", "--min", "1", "--max", "2", "--interval", "0"], "--interval"),
    (["autoscale", "--min", "0", "--max", "2"], "--min"),
    (["autoscale", "--min", "1", "--max", "2", "--patience", "0"], "--patience"),
])
def test_the_command_refuses_bad_numbers_before_it_joins_ray(monkeypatch, capsys, args, match):
    def no_ray(address):
        raise AssertionError("joined Ray with bad arguments")

    monkeypatch.setattr(cli, "_connect", no_ray)
    with pytest.raises(SystemExit) as exc:
        cli.main(["fleet", args[0], "--name", "prep", *args[1:]])
    assert exc.value.code == 2
    assert match in capsys.readouterr().err


# -- stopping a fleet: an interrupted stop undoes its drain ----------------------------


class FakeCall:
    """``worker.method.remote(...)``: runs the call at once (a KeyboardInterrupt raised
    there is the operator's Ctrl-C landing in the caller) and returns a reference that
    ``ray.get`` answers."""

    def __init__(self, fn):
        self.fn = fn

    def remote(self, *args, **kwargs):
        value = self.fn(*args, **kwargs)
        return lambda: value


class FakeWorker:
    """A fleet worker's control calls (``stop``, ``undrain``, ``reusable``,
    ``fleet_stats``) answered at once; ``ctrl_c`` raises KeyboardInterrupt where the
    operator's Ctrl-C lands: ``"poll"`` while the stop asks whether it is idle,
    ``"ending"`` the same once it was told to end its sessions."""

    def __init__(self, sessions=0, ctrl_c=None):
        self.sessions, self.draining, self.killed, self.ctrl_c = sessions, False, False, ctrl_c
        self.ended = False
        self.stop = FakeCall(self._stop)
        self.undrain = FakeCall(self._undrain)
        self.reusable = FakeCall(self._reusable)
        self.fleet_stats = FakeCall(lambda: stats(self.sessions, self.draining))

    def _stop(self, end_sessions=True):
        self.draining, self.ended = True, self.ended or end_sessions

    def _undrain(self):
        self.draining = False

    def _reusable(self):
        if self.ctrl_c == "poll" or (self.ctrl_c == "ending" and self.ended):
            raise KeyboardInterrupt
        return self.sessions == 0


def fake_ray(monkeypatch, workers, ctrl_c_at_kill=None):
    """Ray's calls for ``dpex.server._fleet`` on fake workers: every call answers at once;
    killing the ``ctrl_c_at_kill``-th worker (from 1) raises KeyboardInterrupt instead."""
    from types import SimpleNamespace

    from dpex.server import _fleet

    kills = []

    def kill(actor, no_restart):
        kills.append(actor)
        if len(kills) == ctrl_c_at_kill:
            raise KeyboardInterrupt
        actor.killed = True

    ray = SimpleNamespace(wait=lambda refs, num_returns=1, timeout=None: (list(refs), []),
                          get=lambda ref: ref(), kill=kill, exceptions=_fleet.ray.exceptions)
    monkeypatch.setattr(_fleet, "ray", ray)
    living = lambda fleet="prep": [(i, w) for i, w in enumerate(workers) if not w.killed]  # noqa: E731
    monkeypatch.setattr(_fleet, "fleet_workers", living)
    monkeypatch.setattr(registry, "fleet_workers", living)
    monkeypatch.setattr(registry, "sample",
                        lambda actors: {i: ray.get(w.fleet_stats.remote()) for i, w in actors})
    return _fleet


@pytest.mark.timeout(30)
@pytest.mark.parametrize("where,sessions,timeout,killed", [
    ("draining", [0, 2, 1], 60.0, 0),  # Ctrl-C while running sessions may go on
    ("ending", [0, 2, 1], 0.01, 0),  # Ctrl-C while the sessions left are being ended
    ("killing", [0, 0, 0], 60.0, 1),  # Ctrl-C after the first worker was removed
])
def test_an_interrupted_stop_undoes_its_drain_and_the_fleet_serves_again(
        monkeypatch, where, sessions, timeout, killed):
    # Issue 39, item 7: Ctrl-C during `dpex fleet stop` left every worker draining, and
    # every trainer that attached failed with "is being stopped" until another stop.
    ctrl_c = {"draining": "poll", "ending": "ending"}.get(where)
    workers = [FakeWorker(n, ctrl_c if n else None) for n in sessions]
    _fleet = fake_ray(monkeypatch, workers, ctrl_c_at_kill=2 if where == "killing" else None)
    lines = []
    with pytest.raises(KeyboardInterrupt):
        _fleet.stop_fleet("prep", timeout=timeout, progress=lines.append)
    assert [w.killed for w in workers] == [True] * killed + [False] * (3 - killed)
    assert not any(w.draining for w in workers if not w.killed)
    assert lines[-1] == (f"interrupted: {3 - killed} workers of fleet 'prep' take new "
                         f"sessions again ({killed} removed already)"), lines
    for w in workers:
        w.ctrl_c = None
    assert len(registry.choose_workers("prep", 2)) == 2  # a trainer attaches


@pytest.mark.timeout(30)
def test_status_shows_a_draining_worker_as_draining(monkeypatch):
    from dpex.server import _fleet

    def answer(i, draining):
        return {**stats(draining=draining), "pid": 100 + i, "sessions_served": 3,
                "batches_sent": 7, "bytes_sent": 2_000_000}

    monkeypatch.setattr(_fleet, "fleet_workers", lambda fleet: [(0, "w0"), (1, "w1"), (2, "w2")])
    monkeypatch.setattr(_fleet, "sample", lambda actors: {0: answer(0, False),
                                                          1: answer(1, True)})
    rows = _fleet.fleet_status("prep", interval=0.01)
    assert [r["state"] for r in rows] == ["alive", "draining", "not responding (restarting?)"]
    table = cli._status_table(rows).splitlines()
    assert table[3] == "| 1 | 10.0.0.1 | 101 | draining | 0 | 3 | 7 | 2.0 | 0 |", table
    assert table[4] == "| 2 |  |  | not responding (restarting?) |  |  |  |  |  |", table


@pytest.mark.timeout(30)
@pytest.mark.parametrize("how,code", [("ctrl-c", 130), ("sigterm", 143)])
def test_the_stop_command_exits_non_zero_when_interrupted(monkeypatch, capsys, how, code):
    import os
    import signal
    import time

    from dpex.server import _fleet

    def stop_fleet(fleet, timeout, now, progress):
        if how == "ctrl-c":
            raise KeyboardInterrupt
        os.kill(os.getpid(), signal.SIGTERM)
        time.sleep(5.0)  # (the signal lands in here)
        return 3

    terms = []
    before = signal.signal(signal.SIGTERM, lambda signum, frame: terms.append(signum))
    try:
        monkeypatch.setattr(cli, "_connect", lambda address: None)
        monkeypatch.setattr(_fleet, "stop_fleet", stop_fleet)
        assert cli.main(["fleet", "stop", "--name", "prep"]) == code
        assert terms == []  # the command's own handler took it, and then gave it back
        assert "dpex: interrupted" in capsys.readouterr().err
        assert signal.getsignal(signal.SIGTERM) not in (signal.SIG_DFL, None)
        os.kill(os.getpid(), signal.SIGTERM)
        assert terms == [signal.SIGTERM]
    finally:
        signal.signal(signal.SIGTERM, before)
