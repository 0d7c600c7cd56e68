"""A `ray start --head` cluster of our own, on loopback, for tests that need a real
cluster address (DDP ranks, fleets): started in its own process group and temp
dir, with a token (Ray >= 2.59 authenticates local clusters), stopped by PID."""

from __future__ import annotations

import contextlib
import json
import os
import secrets
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
from collections.abc import Iterator

HERE = os.path.dirname(os.path.abspath(__file__))
ROOT = os.path.dirname(HERE)
BIN = os.path.dirname(sys.executable)


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def ray_head(num_cpus: int | None = None, resources: dict | None = None
             ) -> Iterator[tuple[str, dict]]:
    """Yields (address, environment for its clients). ``num_cpus`` defaults to this
    machine's cores: a test never pretends to have more."""
    num_cpus = os.cpu_count() if num_cpus is None else num_cpus
    port = free_port()
    env = {k: v for k, v in os.environ.items() if k not in ("RAY_ADDRESS",)}
    env.update(RAY_AUTH_MODE="token", RAY_AUTH_TOKEN=secrets.token_hex(16),
               PYTHONPATH=os.pathsep.join(p for p in (ROOT, env.get("PYTHONPATH")) if p))
    temp_dir = tempfile.mkdtemp(prefix="dpexray")  # keeps /tmp/ray's "current cluster" as is
    head = subprocess.Popen(
        [os.path.join(BIN, "ray"), "start", "--head", "--block", "--node-ip-address=127.0.0.1",
         f"--port={port}", f"--num-cpus={num_cpus}", "--include-dashboard=false",
         *([f"--resources={json.dumps(resources)}"] if resources else []),
         "--disable-usage-stats", f"--temp-dir={temp_dir}"],
        env=env, start_new_session=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
    )
    try:
        deadline = time.monotonic() + 60
        while True:
            try:
                socket.create_connection(("127.0.0.1", port), 0.5).close()
                break
            except OSError:
                if head.poll() is not None or time.monotonic() > deadline:
                    raise RuntimeError("`ray start --head` did not come up") from None
                time.sleep(0.1)
        yield f"127.0.0.1:{port}", env
    finally:
        os.killpg(head.pid, signal.SIGTERM)
        try:
            head.wait(5)
        except subprocess.TimeoutExpired:
            os.killpg(head.pid, signal.SIGKILL)
            head.wait(5)
        shutil.rmtree(temp_dir, ignore_errors=True)


def run(cmd: list[str], env: dict, timeout: float = 240, check: bool = True
        ) -> subprocess.CompletedProcess:
    proc = subprocess.run(cmd, env=env, cwd=ROOT, capture_output=True, text=True,
                          timeout=timeout)
    if check:
        assert proc.returncode == 0, f"{cmd}\n{proc.stdout[-3000:]}\n{proc.stderr[-5000:]}"
    return proc


def run_together(cmds: list[list[str]], env: dict, timeout: float = 500) -> list[str]:
    """Run ``cmds`` at the same time (independent processes: a torch run and a dpex run
    of one script, say); return their stdouts once all succeeded."""
    procs = [subprocess.Popen(cmd, env=env, cwd=ROOT, stdout=subprocess.PIPE,
                              stderr=subprocess.PIPE, text=True) for cmd in cmds]
    outputs = []
    try:
        for cmd, proc in zip(cmds, procs, strict=True):
            out, err = proc.communicate(timeout=timeout)
            assert proc.returncode == 0, f"{cmd}\n{out[-3000:]}\n{err[-6000:]}"
            outputs.append(out)
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)
    return outputs
