"""The ``dpex`` command: ``dpex fleet start | status | scale | autoscale | stop``.

    dpex fleet start --name prep --workers 8 [--cpus-per-worker 2] [--address HEAD:6379]
                     [--resources '{"cpu_node": 1}'] [--session-timeout 30]
    dpex fleet status --name prep
    dpex fleet scale --name prep --workers 12 [--drain-timeout 60]
    dpex fleet autoscale --name prep --min 2 --max 32 [--interval 2] [--patience 5]
    dpex fleet stop --name prep [--timeout 60] [--now]

Exit status: 0 on success, 1 when the fleet cannot be started, found or reached
(the message says why), 2 for bad arguments (refused before Ray is joined), 130 or
143 when Ctrl-C or SIGTERM interrupts ``stop`` (its drain is undone: the fleet serves).
"""

from __future__ import annotations

import argparse
import json
import math
import os
import signal
import sys
import threading
from collections.abc import Callable

__all__ = ["main"]


def _number(kind: type, low: float, low_allowed: bool, unit: str = "") -> Callable:
    """An argparse type: a finite ``kind`` (int or float) above ``low`` (or equal, with
    ``low_allowed``). A number of seconds is never 0 (it would free every session at
    once) nor NaN (which compares false with everything)."""
    def parse(text: str) -> float:
        try:
            value = kind(text)
        except ValueError:
            what = "a whole number" if kind is int else "a number"
            raise argparse.ArgumentTypeError(f"not {what}: {text!r}") from None
        if not (math.isfinite(value) and (value >= low if low_allowed else value > low)):
            raise argparse.ArgumentTypeError(
                f"must be {'>=' if low_allowed else '>'} {low:g}{unit}, got {text}")
        return value
    return parse


_positive_float = _number(float, 0, False, " seconds")
_at_least_one = _number(int, 1, True)
_not_negative = _number(float, 0, True)


def _parser() -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(prog="dpex", description="dpex: preprocessing on a Ray cluster")
    sub = p.add_subparsers(dest="command", required=True)
    fleet = sub.add_parser("fleet", help="a standalone pool of dpex workers that loaders share")
    actions = fleet.add_subparsers(dest="action", required=True)
    for name, text in (("start", "start a fleet of detached workers"),
                       ("status", "one line per worker: node, state, sessions, traffic"),
                       ("scale", "grow or shrink the fleet to --workers workers"),
                       ("autoscale", "follow the trainers' demand: one worker per session, "
                                     "within --min and --max, until interrupted"),
                       ("stop", "drain the fleet (no new sessions; running ones may end "
                                "within --timeout) and remove its workers")):
        a = actions.add_parser(name, help=text)
        a.add_argument("--name", required=True, help="the fleet's name (worker_pool=NAME)")
        a.add_argument("--address", default=None,
                       help="Ray cluster to join (default: RAY_ADDRESS, else the running one)")
        if name == "scale":
            a.add_argument("--workers", type=_at_least_one, required=True)
            a.add_argument("--timeout", type=_positive_float, default=120.0,
                           help="seconds to wait for new workers to be placed and up")
            a.add_argument("--drain-timeout", type=_positive_float, default=60.0,
                           help="seconds a removed worker's sessions get to move off it "
                                "before it is killed (default 60; a session takes up to 15 s)")
        if name == "autoscale":
            a.add_argument("--min", type=_at_least_one, required=True)
            a.add_argument("--max", type=_at_least_one, required=True)
            a.add_argument("--interval", type=_positive_float, default=2.0,
                           help="seconds per round")
            a.add_argument("--patience", type=_at_least_one, default=5,
                           help="rounds a worker stays idle before it is removed")
            a.add_argument("--rounds", type=int, default=None, help=argparse.SUPPRESS)
        if name == "stop":
            a.add_argument("--timeout", type=_positive_float, default=60.0,
                           help="seconds running sessions may go on (their trainers finish "
                                "or close them) before they are ended and the workers "
                                "removed (default 60)")
            a.add_argument("--now", action="store_true",
                           help="kill the workers at once: their sessions' trainers see "
                                "them die")
        if name == "start":
            a.add_argument("--workers", type=_at_least_one, required=True)
            a.add_argument("--cpus-per-worker", type=_not_negative, default=1.0,
                           help="CPUs each worker reserves in Ray (default 1); 0 reserves "
                                "none and dpex spreads the workers over the CPU nodes")
            a.add_argument("--resources", type=json.loads, default=None,
                           help='custom Ray resources per worker, as JSON: \'{"cpu_node": 1}\'')
            a.add_argument("--session-timeout", type=_positive_float, default=30.0,
                           help="seconds a session may stay silent before its worker frees it")
            a.add_argument("--timeout", type=_positive_float, default=120.0,
                           help="seconds to wait for every worker to be placed and up")
    return p


def _connect(address: str | None) -> None:
    import ray

    address = address or os.environ.get("RAY_ADDRESS") or "auto"
    ray.init(address=address, namespace="dpex", log_to_driver=False,
             logging_level="ERROR")


def _status_table(rows: list[dict]) -> str:
    lines = ["| worker | node | pid | state | sessions active | sessions served | batches "
             "| MB over socket | batches/s |", "|---:|---|---:|---|---:|---:|---:|---:|---:|"]
    for r in rows:
        if "node_ip" not in r:  # it did not answer
            lines.append(f"| {r['worker']} |  |  | {r['state']} |  |  |  |  |  |")
            continue
        rate = "" if r["batches_per_s"] is None else f"{r['batches_per_s']:.0f}"
        lines.append(f"| {r['worker']} | {r['node_ip']} | {r['pid']} | {r['state']} | "
                     f"{r['sessions_active']} | {r['sessions_served']} | {r['batches_sent']} | "
                     f"{r['bytes_sent'] / 1e6:.1f} | {rate} |")
    return "\n".join(lines)


class _Terminated(KeyboardInterrupt):
    """SIGTERM during ``dpex fleet stop``: handled as Ctrl-C is (the drain is undone)."""


def _terminate(signum: int, frame: object) -> None:
    raise _Terminated


def _stop(args: argparse.Namespace, stop_fleet: Callable[..., int]) -> int:
    """``dpex fleet stop``. Ctrl-C or SIGTERM undoes the drain (see ``stop_fleet``) and
    exits 130 or 143 (128 + the signal), as a shell reports a command so ended."""
    here = threading.current_thread() is threading.main_thread()  # (signals: main only)
    previous = signal.signal(signal.SIGTERM, _terminate) if here else None
    try:
        if not args.now:
            print(f"draining fleet {args.name!r}: no new sessions; running ones may go "
                  f"on for {args.timeout:g} s (Ctrl-C undoes the drain)", flush=True)
        stopped = stop_fleet(args.name, args.timeout, args.now,
                             progress=lambda line: print(line, flush=True))
    except KeyboardInterrupt as exc:
        print(f"dpex: interrupted: the stop of fleet {args.name!r} is undone (`dpex fleet "
              f"stop --name {args.name}` starts it again)", file=sys.stderr)
        return 128 + (signal.SIGTERM if isinstance(exc, _Terminated) else signal.SIGINT)
    finally:
        if previous is not None:  # (None: not set from Python, cannot be put back)
            signal.signal(signal.SIGTERM, previous)
    print(f"stopped {stopped} workers of fleet {args.name!r}")
    return 0


def main(argv: list[str] | None = None) -> int:
    parser = _parser()
    args = parser.parse_args(argv)
    if args.action == "autoscale" and args.min > args.max:
        parser.error(f"--min must be <= --max, got {args.min} and {args.max}")
    from dpex.errors import FleetError
    from dpex.server._fleet import (
        autoscale_fleet,
        fleet_status,
        scale_fleet,
        start_fleet,
        stop_fleet,
    )

    try:
        _connect(args.address)
    except Exception as exc:  # noqa: BLE001 — any failure to join is reported the same way
        print(f"dpex: cannot join the Ray cluster: {exc}", file=sys.stderr)
        return 1
    try:
        if args.action == "start":
            print(f"starting fleet {args.name!r}: {args.workers} workers, "
                  f"each reserving {args.cpus_per_worker:g} CPU", flush=True)
            start_fleet(args.name, args.workers, args.cpus_per_worker, args.resources,
                        args.session_timeout, args.timeout,
                        progress=lambda line: print(line, flush=True))
            print(f"fleet {args.name!r} is up: DpexDataLoader(..., distribute_mode=True, "
                  f"worker_pool={args.name!r})")
        elif args.action == "status":
            print(_status_table(fleet_status(args.name)))
        elif args.action == "scale":
            before, after = scale_fleet(args.name, args.workers, args.timeout,
                                        progress=lambda line: print(line, flush=True),
                                        drain_s=args.drain_timeout)
            print(f"fleet {args.name!r}: {before} -> {after} workers")
        elif args.action == "autoscale":
            print(f"fleet {args.name!r}: one worker per session, {args.min} to {args.max} "
                  "workers (Ctrl-C to stop)", flush=True)
            try:
                autoscale_fleet(args.name, args.min, args.max, args.interval, args.patience,
                                args.rounds, progress=lambda line: print(line, flush=True))
            except KeyboardInterrupt:
                print("stopped following; the fleet keeps its size")
        else:
            return _stop(args, stop_fleet)
    except FleetError as exc:
        print(f"dpex: {exc}", file=sys.stderr)
        return 1
    return 0


if __name__ == "__main__":
    sys.exit(main())
