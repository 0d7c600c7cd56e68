"""Marks along the start chain, for measuring it link by link (docs/BENCHMARKS.md,
"Cold start"; ``scripts/bench_cold_start.py``).

Where ``DPEX_START_TRACE`` names a file, every process of the chain (the trainer, its
embedded Ray's workers, a host, its forkserver, its fork bases, the sessions) appends
one JSON line per link it passes: the wall time, its pid, the link's name, its own CPU
seconds so far and where it has one the time its process started. Unset (the default),
:func:`mark` reads one environment variable and returns. The processes inherit the
variable from the trainer where the trainer starts them (the embedded default, a Ray
instance the same script started); a cluster started apart is not traced.
"""

from __future__ import annotations

import json
import os
import time

__all__ = ["ENV", "mark", "process_started"]

ENV = "DPEX_START_TRACE"


def mark(link: str, **extra: object) -> None:
    """Append ``link`` (and ``extra``) to the trace file, if one is named."""
    path = os.environ.get(ENV)
    if not path:
        return
    record = {"t": time.time(), "pid": os.getpid(), "link": link,
              "cpu": time.process_time(), **extra}
    try:  # one short append: whole lines, whichever process writes at once
        fd = os.open(path, os.O_WRONLY | os.O_APPEND | os.O_CREAT, 0o600)
        try:
            os.write(fd, (json.dumps(record) + "\n").encode())
        finally:
            os.close(fd)
    except OSError:
        pass  # a measurement aid never fails what it measures


def process_started(pid: int | None = None) -> float | None:
    """When process ``pid`` (this one by default) started, as wall time: its start in
    clock ticks after boot (``/proc/<pid>/stat``) against the uptime now."""
    try:
        with open(f"/proc/{pid or os.getpid()}/stat", encoding="ascii") as f:
            ticks = int(f.read().rsplit(")", 1)[1].split()[19])
        with open("/proc/uptime", encoding="ascii") as f:
            uptime = float(f.read().split()[0])
    except (OSError, ValueError, IndexError):
        return None
    return time.time() - (uptime - ticks / os.sysconf("SC_CLK_TCK"))
