"""Fleet rules without Ray: finding a fleet's workers, choosing where a session goes
(and waiting while Ray restarts them), removing workers, and the ``dpex fleet`` command's
argument checks. Ray's calls are replaced by fakes driven on a fake clock."""

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
