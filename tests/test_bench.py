"""scripts/bench.py runs end to end (a smoke run; figures live in docs/BENCHMARKS.md)."""

import json
import math
import os
import re
import subprocess
import sys

import pytest
import raycluster

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))


@pytest.fixture(scope="module")
def ray_env():
    """The benchmarks' smoke runs join one running Ray (``ray start``, this machine's
    cores), as a user whose cluster runs does: each script's own embedded start costs
    ~6 CPU-s here and is no part of what these runs check (the embedded default is
    tested by the examples, the frameworks and scripts/bench_cold_start.py)."""
    with raycluster.ray_head() as (address, env):
        env["RAY_ADDRESS"] = address
        yield env


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_quick_run_writes_table_json_and_plot(tmp_path, ray_env):
    env = ray_env
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench.py"), "--quick",
         "--scenarios", "cpu", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=220, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "bench.json").read_text())
    for loader in ("torch", "dpex", "dpex-socket", "dpex-socket-enc", "zmq-raw",
                   "zmq-raw-curve"):
        assert data["results"]["cpu"][loader]["batches_per_s"]["median"] > 0
        assert data["results"]["cpu"][loader]["cpu_ms_per_mib"]["median"] > 0
    assert "| cpu | dpex |" in proc.stdout and (tmp_path / "bench.png").stat().st_size > 5000
    # Each socket path is set against the raw ZeroMQ reference of its own security.
    row = re.search(r"\| cpu \| dpex-socket-enc \|[^|]*\|[^|]*\|[^|]*\| ([\d.]+) \|",
                    proc.stdout)
    assert row and float(row.group(1)) > 0, proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(180)
def test_scale_model_measures_the_costs_and_finds_the_limit(ray_env):
    env = ray_env
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "scale_model.py"), "--scenario", "small",
         "--batches", "300", "--bandwidth-gbps", "10", "--max-workers", "64",
         "--loop-step-ms", "0.5"],
        capture_output=True, text=True, timeout=170, cwd=ROOT, env=env)
    assert proc.returncode == 0, proc.stderr[-3000:]
    costs = re.search(r"worker ([\d.]+) ms CPU/batch, trainer (\d+) µs CPU/batch", proc.stdout)
    assert costs and float(costs[1]) > 0 and int(costs[2]) > 0, proc.stdout
    rows = [line for line in proc.stdout.splitlines() if line.startswith("| ") and "---" not in line]
    assert [r.split("|")[1].strip() for r in rows[1:]] == ["1", "2", "4", "8", "16", "32", "64"]
    predicted = [float(r.split("|")[2]) for r in rows[1:]]
    assert predicted == sorted(predicted)  # more workers never predict less
    assert rows[1].endswith("| workers |")  # one worker cannot saturate a rank
    assert rows[-1].endswith(("| trainer CPU |", "| network |"))  # 64 can
    # the workers a 0.5 ms loop step needs: worker CPU per batch / step, +15 %
    need = re.search(r"a loop whose step takes 0.5 ms needs (\d+) workers", proc.stdout)
    assert need and abs(int(need[1]) - math.ceil(float(costs[1]) / 0.5 * 1.15)) <= 1, (
        proc.stdout)  # (the printed cost is rounded)


@pytest.mark.slow
@pytest.mark.timeout(600)
def test_autoscale_bench_writes_its_table_and_plot(tmp_path, ray_env):
    env = ray_env
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_autoscale.py"), "--loops", "slow",
         "--seconds", "4", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=580, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "autoscale.json").read_text())
    summary = data["results"]["slow"]["summary"]
    assert summary["best_fixed"] == 1 and summary["chosen"] <= 2  # a slow loop needs one
    assert "| slow |" in proc.stdout and (tmp_path / "autoscale.png").stat().st_size > 5000


@pytest.mark.slow
@pytest.mark.timeout(300)
def test_first_batch_bench_runs_the_alternation_for_both_loaders(tmp_path, ray_env):
    env = ray_env
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_first_batch.py"), "--epochs", "2",
         "--repeats", "1", "--train-batches", "4", "--val-batches", "2", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=280, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads((tmp_path / "first_batch.json").read_text())
    for loader in ("torch", "dpex"):
        assert len(data["runs"][loader][0]["first_ms"]) == 4  # 2 epochs x (train, val)
        assert f"| {loader} |" in proc.stdout
    assert (tmp_path / "first_batch.png").stat().st_size > 5000


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_bench_latency_reports_each_path_beside_raw_zeromq(tmp_path, ray_env):
    env = ray_env
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_latency.py"), "--scenarios",
         "small", "--batches", "20", "--interval-ms", "20", "--out", str(tmp_path)],
        capture_output=True, text=True, timeout=220, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    results = json.loads((tmp_path / "latency.json").read_text())["results"]["small"]
    assert set(results) == {"dpex", "dpex-socket", "dpex-socket-enc", "zmq-raw", "zmq-raw-curve"}
    for name, r in results.items():
        assert r["n"] == 20 and 0 < r["p50_ms"] <= r["p99_ms"] <= r["max_ms"] < 1000, (name, r)
    # each socket path's added part is against the raw reference of its own security
    row = re.search(r"\| small \| dpex-socket-enc \| ([\d.]+) \|[^|]*\|[^|]*\| (-?[\d.]+) \|",
                    proc.stdout)
    assert row and float(row[2]) == pytest.approx(
        float(row[1]) - results["zmq-raw-curve"]["p50_ms"], abs=0.011), proc.stdout
    assert (tmp_path / "latency.png").stat().st_size > 5000


@pytest.mark.slow
@pytest.mark.timeout(240)
def test_reshard_bench_states_the_resume_and_per_sample_costs(tmp_path, ray_env):
    env = ray_env
    out = tmp_path / "reshard.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_reshard.py"), "--samples",
         "20000", "--workers", "1", "--out", str(out)],
        capture_output=True, text=True, timeout=220, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    data = json.loads(out.read_text())
    resumed = [row for row in data["resume"] if row["resume"] == "4 ranks -> 3"]
    assert len(resumed) == 2 and all(row["first_batch_ms"] > 0 and 0 < row["state_kib"] < 64
                                     for row in resumed)
    assert data["seeding"]["seed_us_per_sample"] > 0 and data["seeding"]["epoch_s_per_sample"] > 0
    assert "| 4 ranks -> 3 | 1 |" in proc.stdout


@pytest.mark.slow
@pytest.mark.timeout(400)
def test_worker_cost_bench_sets_each_loader_beside_torch(tmp_path, ray_env):
    env = ray_env
    out = tmp_path / "worker_cost.json"
    proc = subprocess.run(
        [sys.executable, os.path.join(ROOT, "scripts", "bench_worker_cost.py"), "--quick",
         "--kinds", "tensor", "--setup", "0", "--settle", "1", "--ray-address",
         env["RAY_ADDRESS"], "--out", str(out)],  # (no head start to wait)
        capture_output=True, text=True, timeout=380, env=env, cwd=ROOT)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-3000:]
    for kind in ("tensor",):  # (one kind: each configuration starts a Ray of its own)
        for loader in ("torch", "dpex"):
            for n in (1, 2):
                assert f"| {kind} | {n} | {loader} |" in proc.stdout, proc.stdout
        assert re.search(rf"^\| {kind} \| -?\d+ \| -?\d+ \|", proc.stdout, re.M), proc.stdout
    results = json.loads(out.read_text())["results"]
    dpex = results["dpex"]["tensor"]["2"]
    assert dpex["worker_processes"] >= 2 and dpex["workers_pss_mib"] > 0
    assert dpex["first_batch_s"] > 0 and results["torch"]["tensor"]["2"]["first_batch_s"] > 0
    assert (tmp_path / "worker_cost.png").stat().st_size > 5000
