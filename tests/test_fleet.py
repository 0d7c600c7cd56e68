"""Standalone fleets: `dpex fleet start | status | stop` on a `ray start` cluster, and
trainers (separate processes) attaching with worker_pool=NAME."""

import json
import os
import select
import signal
import subprocess
import sys
import time

import dsets
import pytest
import raycluster

from dpex import DpexDataLoader, FleetError

pytestmark = [pytest.mark.slow, pytest.mark.timeout(300)]
TRAINER = os.path.join(raycluster.HERE, "fleet_trainer.py")


# `dpex fleet ...` run by dpex.cli's own main in one process that joined the cluster
# once: a test that looks at a fleet's status again and again (or scales it) does not
# start an interpreter and join Ray per look (about 2.6 s each here). The console
# script itself runs where a test is about it (start, stop, an unknown fleet).
CLI_PROCESS = r"""
import contextlib, io, json, sys
from dpex import cli
cli._connect(sys.argv[1])
cli._connect = lambda address: None  # (joined once, above)
print("READY", flush=True)
for line in sys.stdin:
    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli.main(json.loads(line))
    print(json.dumps([code, out.getvalue(), err.getvalue()]), flush=True)
"""


@pytest.fixture(scope="module")
def cluster():
    # A head with this machine's cores: fleets are detached actors, which need a
    # cluster that outlives the process that starts them (not the embedded default).
    with raycluster.ray_head(num_cpus=os.cpu_count()) as head:
        address, env = head
        cli = subprocess.Popen([sys.executable, "-c", CLI_PROCESS, address], env=env,
                               cwd=raycluster.ROOT, stdin=subprocess.PIPE,
                               stdout=subprocess.PIPE, text=True)
        try:
            assert cli.stdout.readline().strip() == "READY"
            yield address, env, cli
        finally:
            cli.kill()
            cli.wait(30)


DPEX = os.path.join(raycluster.BIN, "dpex")  # the console script a fresh install puts there


def dpex_fleet(cluster, *args, check=True, via=(DPEX, "fleet")):
    """The console script, as a user runs it."""
    address, env, _ = cluster
    return raycluster.run([*via, *args, "--address", address], env, check=check)


def fleet_cli(cluster, *args, check=True) -> subprocess.CompletedProcess:
    """`dpex fleet ARGS` in the cluster's CLI process (dpex.cli.main, joined once)."""
    _, _, cli = cluster
    cli.stdin.write(json.dumps(["fleet", *args]) + "\n")
    cli.stdin.flush()
    ready, _, _ = select.select([cli.stdout], [], [], 240)  # (as raycluster.run's limit)
    assert ready, f"dpex fleet {args} did not answer within 240 s"
    code, out, err = json.loads(cli.stdout.readline())
    if check:
        assert code == 0, f"{args}\n{out[-3000:]}\n{err[-5000:]}"
    return subprocess.CompletedProcess(["dpex", "fleet", *args], code, out, err)


def trainer(cluster, fleet, *args):
    address, env, _ = cluster
    return subprocess.Popen([sys.executable, TRAINER, "--address", address, "--fleet", fleet,
                             *args], env=env, cwd=raycluster.ROOT, text=True,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE)


def result(proc, timeout=180):
    out, err = proc.communicate(timeout=timeout)
    assert proc.returncode == 0, out[-2000:] + err[-4000:]
    return json.loads(out.strip().splitlines()[-1])


def status_rows(cluster, name):
    out = fleet_cli(cluster, "status", "--name", name).stdout
    rows = [line.split("|")[1:-1] for line in out.splitlines()[2:]]
    return [[c.strip() for c in r] for r in rows]


@pytest.fixture(scope="module")
def fleet(cluster):
    # More workers than the cluster has CPUs: they reserve none (dpex places them).
    out = dpex_fleet(cluster, "start", "--name", "prep", "--workers", "3",
                     "--cpus-per-worker", "0", "--session-timeout", "3").stdout
    assert "3/3 workers up" in out and "worker_pool='prep'" in out
    yield "prep"
    dpex_fleet(cluster, "stop", "--name", "prep", check=False)


def test_two_trainers_at_once_get_exactly_torchs_batches(cluster, fleet):
    procs = [trainer(cluster, fleet) for _ in range(2)]
    stats = [result(p)["stats"] for p in procs]
    for s in stats:  # 2 epochs of SeedProbe: seeds and worker info as torch's own workers
        assert s["received"] == 12 and s["recoveries"] == []
    rows = status_rows(cluster, fleet)
    assert len(rows) == 3 and all(r[3] == "alive" for r in rows)
    assert sum(int(r[5]) for r in rows) >= 4  # sessions served: 2 trainers × 2 workers
    assert sum(int(r[6]) for r in rows) == 24  # batches
    assert all(r[4] == "0" for r in rows)  # no session left open


def test_a_sessions_ray_calls_see_its_trainers_namespace(cluster, fleet):
    """A dataset that looks up its trainer's named actor (``ray.get_actor``) works on a
    fleet as on the loader's own workers: the session joins the trainer's namespace.
    Before, the lookup ran in an anonymous namespace of its own and failed."""
    out = result(trainer(cluster, fleet, "--dataset", "named", "--epochs", "1"))
    assert out["ok"] and out["stats"]["recoveries"] == []


def test_a_trainer_resumes_mid_epoch_on_the_fleet_exactly(cluster, fleet):
    # SeedProbe: every batch carries its worker's RNG draws, equal to torch's only if the
    # resumed sessions start where the saved ones stood.
    out = result(trainer(cluster, fleet, "--resume-at", "2"))
    assert out["ok"] and out["stats"]["recoveries"] == []


def test_a_killed_fleet_worker_is_replaced_and_the_epoch_is_exact(cluster, fleet):
    out = result(trainer(cluster, fleet, "--dataset", "squares", "--kill-after", "5"))
    assert [r["worker"] for r in out["stats"]["recoveries"]] == [1], out["stats"]["recoveries"]
    deadline = time.monotonic() + 60  # Ray restarts the killed fleet worker
    while time.monotonic() < deadline:
        rows = status_rows(cluster, fleet)
        if all(r[3] == "alive" for r in rows):
            break
    assert len(rows) == 3 and all(r[3] == "alive" for r in rows), rows


def wait_sessions(cluster, fleet, n, limit=30.0):
    deadline = time.monotonic() + limit
    while sum(int(r[4]) for r in status_rows(cluster, fleet)) != n:
        assert time.monotonic() < deadline, status_rows(cluster, fleet)
        time.sleep(0.5)


def wait_line(proc, prefix, limit=120.0):
    """The first line of ``proc``'s output that starts with ``prefix``."""
    line, deadline = "", time.monotonic() + limit
    while not line.startswith(prefix) and time.monotonic() < deadline:
        line = proc.stdout.readline()
    assert line.startswith(prefix), proc.stderr.read()[-3000:]
    return line


def test_a_killed_session_process_moves_its_session_and_leaves_the_fleet_worker_be(
        cluster, fleet):
    pids = {r[0]: r[2] for r in status_rows(cluster, fleet)}
    out = result(trainer(cluster, fleet, "--dataset", "squares", "--kill-after", "5",
                         "--kill", "session_pid"))
    assert [r["worker"] for r in out["stats"]["recoveries"]] == [1]  # and the epochs exact
    assert {r[0]: r[2] for r in status_rows(cluster, fleet)} == pids  # no worker restarted


def test_a_stalled_trainer_blocks_no_one_and_when_it_vanishes_its_sessions_go(cluster, fleet):
    proc = trainer(cluster, fleet, "--stall")
    wait_line(proc, "STALLED")
    assert sum(int(r[4]) for r in status_rows(cluster, fleet)) == 2
    # A stalled session blocks nobody: another trainer, sharing a fleet worker with it
    # (3 workers, 4 sessions), gets its whole epochs meanwhile.
    assert result(trainer(cluster, fleet))["stats"]["received"] == 12
    proc.send_signal(signal.SIGKILL)
    proc.wait(10)
    wait_sessions(cluster, fleet, 0)  # the session timeout is 3 s


def test_a_hung_dataset_delays_no_other_session_of_its_worker(cluster, fleet):
    hung = trainer(cluster, fleet, "--hang")
    line = wait_line(hung, "HUNG")
    hung_pids = {w["pid"] for w in json.loads(line.split(" ", 1)[1]).values()}
    try:
        # 3 fleet workers, 2 of them in a fetch that lasts 120 s: one of this trainer's
        # 2 sessions shares a fleet worker with a hung session. Its batches (SeedProbe:
        # seeds and worker info compared with torch's) still come as fast as ever.
        out = result(trainer(cluster, fleet), timeout=120)
        pids = {w["pid"] for w in out["stats"]["workers"].values()}
        assert pids & hung_pids, (pids, hung_pids)
        assert out["stats"]["received"] == 12
        assert out["longest_wait_s"] < 5.0, out
        sessions = {w["session_pid"] for w in out["stats"]["workers"].values()}
        assert len(sessions) == 2 and not sessions & pids  # a process per session
    finally:
        hung.send_signal(signal.SIGKILL)
        hung.wait(10)
    wait_sessions(cluster, fleet, 0)  # the hung sessions' processes go with their trainer


def test_a_fleet_the_cluster_cannot_place_fails_and_leaves_nothing(cluster, fleet):
    proc = dpex_fleet(cluster, "start", "--name", "huge", "--workers", "2",
                      "--cpus-per-worker", "64", check=False)
    assert proc.returncode == 1 and "cannot place 2 dpex workers" in proc.stderr
    proc = dpex_fleet(cluster, "status", "--name", "huge", check=False,
                      via=(os.path.join(raycluster.ROOT, "scripts", "dpex-fleet"),))
    assert proc.returncode == 1 and "no dpex fleet named 'huge'" in proc.stderr
    proc = dpex_fleet(cluster, "start", "--name", fleet, "--workers", "1", check=False)
    assert proc.returncode == 1 and "is running already" in proc.stderr


def test_sessions_added_and_retired_mid_epoch_on_a_fleet_keep_the_epoch_exact(cluster, fleet):
    out = result(trainer(cluster, fleet, "--dataset", "squares", "--scale-to", "3:4",
                         "--epochs", "2"))  # (2 logical workers -> 4, on 3 fleet workers)
    assert out["stats"]["dropped"]["added"] == 2
    assert {w for w, info in out["stats"]["workers"].items()} == {"0", "1", "2", "3"}


def test_a_one_worker_fleet_waits_for_ray_to_restart_its_worker(cluster):
    # Issue 25, item 8: both logical workers' sessions are on the only fleet worker;
    # SIGKILLed, it answers nobody until Ray has restarted it (it failed at once with
    # "no worker answered" before). The epoch waits for it and stays exact.
    dpex_fleet(cluster, "start", "--name", "solo", "--workers", "1", "--cpus-per-worker",
               "0", "--session-timeout", "3")
    try:
        out = result(trainer(cluster, "solo", "--dataset", "squares", "--kill-after", "5"))
        assert sorted(r["worker"] for r in out["stats"]["recoveries"]) == [0, 1]
    finally:
        dpex_fleet(cluster, "stop", "--name", "solo", check=False)


def scale_down_in_a_slow_fetch(cluster, tmp_path, name, *trainer_args, into_fetch_s=0.0):
    """A 3-worker fleet scaled to 1 while the removed busy worker's session is in an 8 s
    fetch, ``into_fetch_s`` seconds into it: (what ``dpex fleet scale`` printed, seconds
    it took, the trainer's stats, the busy workers' status rows, the rows after). The
    fleet is stopped at the end."""
    dpex_fleet(cluster, "start", "--name", name, "--workers", "3", "--cpus-per-worker",
               "0", "--session-timeout", "3")
    try:
        go, flag = tmp_path / "go", tmp_path / "flag"
        proc = trainer(cluster, name, "--dataset", "slowstop", "--slow-flag", str(flag),
                       "--max-restarts", "0", "--wait-file", str(go), "--step-s", "0.05",
                       "--epochs", "1", *trainer_args)
        line = wait_line(proc, "WAITING")
        logical = {w["pid"]: int(w_id) for w_id, w in
                   json.loads(line.split(" ", 1)[1]).items()}
        busy = [r for r in status_rows(cluster, name) if int(r[4]) > 0]
        assert len(busy) == 2, busy
        victim = max(busy, key=lambda r: int(r[0]))  # the newest busy worker goes
        flag.write_text(str(logical[int(victim[2])]))
        go.touch()
        deadline = time.monotonic() + 30
        while not (tmp_path / "flag.done").exists():  # its session is in the slow fetch
            assert time.monotonic() < deadline
            time.sleep(0.05)
        time.sleep(into_fetch_s)
        t0 = time.monotonic()
        out = fleet_cli(cluster, "scale", "--name", name, "--workers", "1").stdout
        took = time.monotonic() - t0
        stats = result(proc)["stats"]
        return out, took, stats, busy, status_rows(cluster, name)
    finally:
        dpex_fleet(cluster, "stop", "--name", name, check=False)


def test_a_scale_down_waits_for_a_slow_session_to_move(cluster, tmp_path):
    # Issue 25, item 13: the removed worker's session is in an 8 s fetch when it is
    # told to end (its clean-up waits for it). It was killed after 5 s, and the trainer
    # saw a death (max_worker_restarts=0: the epoch failed). Now the worker is killed
    # only once its session has ended and moved. (The trainer waits for the slow batch,
    # as the move is what is tested: a backup would finish the epoch without it.)
    out, took, stats, busy, after = scale_down_in_a_slow_fetch(cluster, tmp_path, "slow",
                                                               "--no-backups")
    assert "3 -> 1 workers" in out and "killed" not in out, out
    assert took > 5.0  # it waited past the old 5 s limit
    assert stats["dropped"].get("restarted", 0) >= 1  # max_worker_restarts=0: not spent
    assert [r[0] for r in after] == [min(r[0] for r in busy)]


def test_a_session_its_trainer_ends_while_the_fleet_drains_it_leaves_the_worker_idle(
        cluster, tmp_path):
    # Issue 48: with a backup the trainer finishes the epoch before the slow session has
    # moved, and ends it (cancels its serve call) while the fleet worker stops it. The
    # cancel skipped the rest of the worker's clean-up: the child stayed listed, the
    # worker was never idle, and the scale-down killed it after 60 s.
    # (6.5 s into the 8 s fetch: past the straggler limit, 5 s, and the next check, so
    # the trainer has its backup under way when the fleet starts draining the session)
    out, _, stats, busy, after = scale_down_in_a_slow_fetch(cluster, tmp_path, "slowbk",
                                                            into_fetch_s=6.5)
    assert stats["backups"]["won"] >= 1, stats["backups"]
    assert "3 -> 1 workers" in out and "killed" not in out, out
    assert [r[0] for r in after] == [min(r[0] for r in busy)]


def test_stop_ends_the_fleet(cluster, fleet):  # last of the fleet's tests
    out = dpex_fleet(cluster, "stop", "--name", fleet).stdout
    assert f"stopped 3 workers of fleet '{fleet}'" in out
    assert dpex_fleet(cluster, "status", "--name", fleet, check=False).returncode == 1


@pytest.mark.usefixtures("ray_session")
def test_an_unknown_fleet_is_a_clear_error():
    loader = DpexDataLoader(dsets.Squares(8), batch_size=2, num_workers=2,
                            distribute_mode=True, worker_pool="nowhere")
    with pytest.raises(FleetError, match="no dpex fleet named 'nowhere'.*dpex fleet start"):
        iter(loader)


@pytest.mark.parametrize("timeout", [0, -1, float("nan")])
def test_a_session_timeout_that_would_free_every_session_at_once_is_refused(timeout):
    from dpex.server._fleet import start_fleet

    with pytest.raises(FleetError, match=r"--session-timeout must be > 0 seconds"):
        start_fleet("prep", 2, session_timeout=timeout)  # (before Ray is asked anything)


def test_worker_pool_and_ray_remote_args_do_not_mix():
    with pytest.raises(ValueError, match="ray_remote_args has no effect with worker_pool"):
        DpexDataLoader(dsets.Squares(8), distribute_mode=True, worker_pool="prep",
                       ray_remote_args={"num_cpus": 2})


@pytest.mark.usefixtures("ray_session")
def test_a_fleet_running_another_dpex_is_refused_at_attach(monkeypatch):
    from dpex import _fleet_registry
    from dpex.server import _fleet

    _fleet.start_fleet("elsewhere", 1, progress=lambda line: None)
    try:
        monkeypatch.setattr(_fleet_registry, "local_versions",
                            lambda: {"dpex": "9.9", "protocol": 99, "python": "3.99"})
        loader = DpexDataLoader(dsets.Squares(8), batch_size=2, num_workers=2,
                                distribute_mode=True, worker_pool="elsewhere")
        with pytest.raises(FleetError, match=r"fleet 'elsewhere' worker 0 .* runs .*'dpex': "
                                             r"'0\.1\.0'.* this trainer runs .*'9\.9'"):
            iter(loader)
    finally:
        assert _fleet.stop_fleet("elsewhere") == 1


def test_fleet_scale_grows_and_shrinks_and_moved_sessions_cost_no_restart(cluster, tmp_path):
    dpex_fleet(cluster, "start", "--name", "elastic", "--workers", "2", "--cpus-per-worker",
               "0", "--session-timeout", "3")
    try:
        out = fleet_cli(cluster, "scale", "--name", "elastic", "--workers", "4").stdout
        assert "2 -> 4 workers" in out and len(status_rows(cluster, "elastic")) == 4
        go = tmp_path / "go"
        # max_worker_restarts=0: a session moved off a removed worker must not count
        proc = trainer(cluster, "elastic", "--dataset", "squares", "--max-restarts", "0",
                       "--wait-file", str(go), "--step-s", "0.02")
        wait_line(proc, "WAITING")
        busy = [r[0] for r in status_rows(cluster, "elastic") if int(r[4]) > 0]
        out = fleet_cli(cluster, "scale", "--name", "elastic", "--workers", "1").stdout
        assert "4 -> 1 workers" in out
        left = [r[0] for r in status_rows(cluster, "elastic")]
        assert len(left) == 1 and left[0] in busy  # idle ones went first
        go.touch()
        stats = result(proc)["stats"]
        assert stats["dropped"].get("restarted", 0) >= 1  # (one of its 2 sessions moved)
        # policy mode: an idle fleet shrinks to --min after --patience rounds
        fleet_cli(cluster, "scale", "--name", "elastic", "--workers", "3")
        out = dpex_fleet(cluster, "autoscale", "--name", "elastic", "--min", "1", "--max", "4",
                         "--interval", "0.2", "--patience", "2", "--rounds", "4").stdout
        assert "scaling to 1" in out and len(status_rows(cluster, "elastic")) == 1
    finally:
        dpex_fleet(cluster, "stop", "--name", "elastic", check=False)


@pytest.mark.usefixtures("ray_session")
def test_a_scaler_steps_over_names_another_took_and_leaves_nothing_behind(monkeypatch):
    # Issue 25, item 14: `scale` and `autoscale` at once both list the fleet, then start
    # the same next names. Here the other one took race/2 after this one listed race/0
    # only: race/1 was started, race/2 raised ActorAlreadyExistsError (a raw traceback)
    # and race/1 was left behind. Now it steps over race/2.
    from dpex import _fleet_registry
    from dpex.server import _fleet

    quiet = {"progress": lambda line: None}
    _fleet.start_fleet("race", 1, cpus_per_worker=0, **quiet)
    try:
        setting = {"num_cpus": 0, "resources": {}}
        _fleet._start_workers("race", [2], setting, 30.0, 60.0, held={}, **quiet)
        stale = [w for w in _fleet_registry.fleet_workers("race") if w[0] == 0]
        monkeypatch.setattr(_fleet, "fleet_workers", lambda fleet: stale)
        assert _fleet.scale_fleet("race", 3, timeout=60.0, **quiet) == (1, 3)
        monkeypatch.undo()
        assert [i for i, _ in _fleet_registry.fleet_workers("race")] == [0, 1, 2, 3]
    finally:
        _fleet.stop_fleet("race", now=True)


@pytest.mark.usefixtures("ray_session")
def test_stop_drains_a_running_epoch_finishes_and_no_new_session_starts():
    # Issue 25, item 14: `stop` killed the workers at once, in the middle of epochs.
    # Now it drains: the running epoch ends exactly, a new iterator is refused by name,
    # and the workers go once their sessions ended.
    import threading

    import torch

    from dpex.server import _fleet

    _fleet.start_fleet("draining", 1, cpus_per_worker=0, progress=lambda line: None)
    dataset = dsets.Squares(48, max_sleep=0.01)
    kw = {"batch_size": 4, "num_workers": 2, "shuffle": True}
    want = dsets.epochs(dsets.torch_loader(dataset, generator=torch.Generator().manual_seed(3),
                                           **kw))[0]
    loader = DpexDataLoader(dataset, generator=torch.Generator().manual_seed(3),
                            distribute_mode=True, worker_pool="draining",
                            max_worker_restarts=0, **kw)
    stopped = []
    stopper = threading.Thread(target=lambda: stopped.append(
        _fleet.stop_fleet("draining", timeout=60.0, progress=lambda line: None)))
    try:
        it = iter(loader)
        got = [next(it)]
        stopper.start()
        time.sleep(1.0)  # the fleet drains now
        with pytest.raises(FleetError, match="'draining' is being stopped"):
            iter(DpexDataLoader(dataset, batch_size=4, num_workers=1, distribute_mode=True,
                                worker_pool="draining"))
        for batch in it:
            got.append(batch)
            time.sleep(0.02)
        for g, w in zip(got, want, strict=True):
            dsets.assert_same(g, w)
        t0 = time.monotonic()
        stopper.join(90)  # the epoch's end ended its sessions: the stop goes on at once
        assert stopped == [1] and time.monotonic() - t0 < 30
    finally:
        loader.close()
        if stopper.ident:
            stopper.join(90)


@pytest.mark.usefixtures("ray_session")
def test_stop_ends_sessions_still_open_after_its_timeout_and_their_trainer_is_told():
    # A persistent iterator keeps its sessions between epochs: `stop --timeout 2` ends
    # them after 2 s, cleanly, and the trainer's next epoch fails saying why.
    from dpex.server import _fleet

    _fleet.start_fleet("closing", 1, cpus_per_worker=0, progress=lambda line: None)
    loader = DpexDataLoader(dsets.Squares(16), batch_size=4, num_workers=2,
                            distribute_mode=True, worker_pool="closing",
                            persistent_workers=True)
    try:
        assert len(list(loader)) == 4
        lines: list[str] = []
        t0 = time.monotonic()
        assert _fleet.stop_fleet("closing", timeout=2.0, progress=lines.append) == 1
        assert 2.0 <= time.monotonic() - t0 < 40, lines
        assert lines == ["1 workers still serve sessions after 2 s: ending them"], lines
        # (told while stopping, or once the fleet is gone: whichever it sees first)
        with pytest.raises(FleetError, match="'closing' is being stopped|fleet named 'closing'"):
            list(loader)
    finally:
        loader.close()


@pytest.mark.usefixtures("ray_session")
def test_an_interrupted_stop_is_undone_and_a_trainer_attaches(monkeypatch):
    # Issue 39, item 7: Ctrl-C during `dpex fleet stop` left the fleet draining (and
    # `status` said "alive"): every trainer failed with "is being stopped" until
    # another stop. Now the drain is undone and `status` shows it while it lasts.
    from dpex.server import _fleet

    _fleet.start_fleet("halted", 1, cpus_per_worker=0, progress=lambda line: None)
    seen: list[str] = []

    def ctrl_c(actors, timeout):  # lands while the stop waits for running sessions
        seen.extend(r["state"] for r in _fleet.fleet_status("halted", interval=0.1))
        raise KeyboardInterrupt

    try:
        monkeypatch.setattr(_fleet, "_wait_idle", ctrl_c)
        lines: list[str] = []
        with pytest.raises(KeyboardInterrupt):
            _fleet.stop_fleet("halted", progress=lines.append)
        monkeypatch.undo()
        assert seen == ["draining"]
        assert lines == ["interrupted: 1 workers of fleet 'halted' take new sessions again "
                         "(0 removed already)"]
        assert [r["state"] for r in _fleet.fleet_status("halted", interval=0.1)] == ["alive"]
        loader = DpexDataLoader(dsets.Squares(8), batch_size=2, num_workers=1,
                                distribute_mode=True, worker_pool="halted")
        assert len(list(loader)) == 4
    finally:
        assert _fleet.stop_fleet("halted", now=True) == 1
