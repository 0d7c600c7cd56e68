"""Standalone worker fleets: detached, named dpex workers that training ranks share.

A fleet ``NAME`` is the Ray actors ``NAME/0`` … ``NAME/N-1`` in the ``dpex``
namespace, created detached (they outlive the script that started them and
every trainer) and restartable (Ray starts a dead one again, with the same
name). Each is an ordinary :class:`~dpex.server._actor.DpexWorker`: every loader
iterator that attaches opens one session per logical worker on it, with its own
sockets, key, dataset and compute thread.

These functions need a connected Ray (``dpex.cli`` connects, the loader does).
"""

from __future__ import annotations

import os
import time
from collections.abc import Callable, Mapping
from typing import Any

import ray

from dpex._cluster import check_placeable, choose_nodes, on_node
from dpex._fleet_registry import NAMESPACE, fleet_name, fleet_workers, sample
from dpex._placement import reserves
from dpex.errors import FleetError, WorkerStartupError
from dpex.server._actor import SHARE_BASES, DpexWorker
from dpex.server._session_process import STOP_GRACE_S

__all__ = ["start_fleet", "fleet_status", "stop_fleet", "scale_fleet", "fleet_target",
           "autoscale_fleet"]

# How long a removed worker's sessions get to move off it before it is killed. A
# session ends within STOP_GRACE_S (its process is asked, then killed), so the default
# leaves room for that on a loaded node; past it the trainer sees a death.
DRAIN_S = 60.0
_MAX_SKIPS = 1000  # names taken by concurrent scalers that a start steps over
_CALL_S = 10.0  # how long a control call to the workers is waited for


def start_fleet(fleet: str, workers: int, cpus_per_worker: float = 1.0,
                resources: Mapping[str, float] | None = None, session_timeout: float = 30.0,
                timeout: float = 120.0, progress: Callable[[str], None] = print) -> list[dict]:
    """Start ``workers`` detached workers named ``fleet/i``; return their stats once
    all are up. Raises :class:`FleetError` (and leaves nothing behind) when the
    fleet exists already or the cluster cannot place every worker in ``timeout``.

    Each worker reserves ``cpus_per_worker`` CPUs and ``resources``, and Ray spreads
    them over the nodes where those are free and restarts a dead one wherever they are
    free. With nothing reserved (``cpus_per_worker=0``) dpex spreads them over the
    CPU nodes in proportion to their CPUs, as a loader's own workers, and a worker
    restarts on its node (so one whose node is lost is not moved)."""
    if not fleet or "/" in fleet:
        raise FleetError(f"fleet name {fleet!r}: give a non-empty name without '/'")
    if workers < 1:
        raise FleetError(f"--workers must be >= 1, got {workers}")
    if not session_timeout > 0:  # (NaN too) 0 would free every session at once
        raise FleetError(f"--session-timeout must be > 0 seconds (how long a session may "
                         f"hear nothing from its trainer before it is freed), got "
                         f"{session_timeout}")
    if fleet_workers(fleet):
        raise FleetError(f"a dpex fleet named {fleet!r} is running already; stop it first "
                         f"(dpex fleet stop --name {fleet})")
    options: dict[str, Any] = {"num_cpus": cpus_per_worker, "resources": dict(resources or {})}
    if os.environ.get(SHARE_BASES) == "0":  # (an opt-out: docs/FLEET.md)
        options["runtime_env"] = {"env_vars": {SHARE_BASES: "0"}}
    return _start_workers(fleet, list(range(workers)), options, session_timeout, timeout,
                          progress, {})


def _start_workers(fleet: str, indices: list[int], options: dict, session_timeout: float,
                   timeout: float, progress: Callable[[str], None],
                   held: Mapping[str, int]) -> list[dict]:
    """Start ``len(indices)`` workers ``fleet/i``, from the first of ``indices`` on;
    their stats once all are up (nothing left behind if they cannot be). An index whose
    name is taken meanwhile (a concurrent ``dpex fleet scale`` or ``autoscale`` chose
    it too) is skipped for the next free one. ``held``: workers per node already."""
    workers = len(indices)
    try:
        check_placeable(options, workers)
    except WorkerStartupError as exc:
        raise FleetError(str(exc).replace("ray_remote_args", "--cpus-per-worker and --resources")
                         .replace("without num_cpus", "with --cpus-per-worker 0")) from None
    if reserves(options):
        strategies: list[Any] = ["SPREAD"] * workers
    else:
        strategies = [on_node(node) if node else "DEFAULT"
                      for node in choose_nodes(workers, held)]
    cls = ray.remote(DpexWorker)
    setting = {"options": options, "session_timeout": session_timeout}
    actors: list[Any] = []
    names: list[int] = []
    infos: dict[int, dict] = {}
    deadline = time.monotonic() + timeout
    try:  # (every actor created is inside: none is left behind by a failure)
        index = indices[0]
        for strategy in strategies:
            while True:
                try:
                    actors.append(cls.options(
                        name=fleet_name(fleet, index), namespace=NAMESPACE,
                        lifetime="detached", max_restarts=-1, max_task_retries=0,
                        scheduling_strategy=strategy, **options,
                    ).remote(session_timeout=session_timeout, fleet=True,
                             fleet_setting=setting))
                    break
                except ValueError:  # ActorAlreadyExistsError: another scaler took it
                    if not _taken(fleet, index) or index - indices[0] > _MAX_SKIPS:
                        raise
                    index += 1
            names.append(index)
            index += 1
        pending = {a.fleet_stats.remote(): i for i, a in enumerate(actors)}
        while pending:
            left = deadline - time.monotonic()
            done, _ = ray.wait(list(pending), num_returns=1, timeout=max(0.0, left))
            if not done:
                raise FleetError(
                    f"only {len(infos)} of {workers} workers of fleet {fleet!r} started within "
                    f"{timeout:g} s: the cluster could not place the rest (each asks for "
                    f"{options}; free now: {ray.available_resources()})")
            i = pending.pop(done[0])
            infos[i] = ray.get(done[0])
            progress(f"{len(infos)}/{workers} workers up (worker {names[i]} on node "
                     f"{infos[i]['node_ip']}, pid {infos[i]['pid']})")
    except BaseException:
        for actor in actors:
            ray.kill(actor, no_restart=True)
        raise
    return [infos[i] for i in range(workers)]


def _taken(fleet: str, index: int) -> bool:
    try:
        ray.get_actor(fleet_name(fleet, index), namespace=NAMESPACE)
    except ValueError:
        return False
    return True


def fleet_status(fleet: str, interval: float = 1.0) -> list[dict]:
    """One row per worker: index, node, state, sessions, batches, bytes, batches/s
    (over ``interval`` seconds). Raises :class:`FleetError` if there is no such fleet."""
    actors = fleet_workers(fleet)
    if not actors:
        raise FleetError(f"no dpex fleet named {fleet!r} in this Ray cluster")
    first = sample(actors)
    time.sleep(interval)
    second = sample(actors)
    rows = []
    for i, _ in actors:
        a, b = first.get(i), second.get(i)
        if b is None:
            rows.append({"worker": i, "state": "not responding (restarting?)"})
            continue
        rate = (b["batches_sent"] - a["batches_sent"]) / interval if a else None
        state = "draining" if b.get("draining") else "alive"
        rows.append({"worker": i, "state": state, "batches_per_s": rate, **b})
    return rows


def stop_fleet(fleet: str, timeout: float = DRAIN_S, now: bool = False,
               progress: Callable[[str], None] = print) -> int:
    """Remove the fleet's workers; return how many.

    A drain first: every worker takes no new session at once, and the sessions it
    serves may go on for ``timeout`` seconds (their trainers finish their epochs or
    close them). Sessions still open then are ended; their trainers find no worker
    to move to and fail with :class:`FleetError` (the fleet is being stopped, or gone).
    ``now``: kill the workers at once (their trainers see them die).

    Interrupted (KeyboardInterrupt; ``dpex fleet stop`` raises it on SIGTERM too), the
    stop is undone, not finished: the workers not yet removed take new sessions again,
    ``progress`` says how many, and the KeyboardInterrupt goes on. Ctrl-C means "do not",
    not "hurry" (``--now`` hurries), and a SIGTERM comes from a supervisor or a time
    limit, not from an operator who chose to cut trainers off: finishing would end the
    running sessions that the drain lets go on, while undoing ends nothing more (only
    sessions past ``timeout`` were ended already), and a second ``stop`` starts over.
    Left draining, the fleet served nobody until another ``stop``."""
    actors = fleet_workers(fleet)
    if not actors:
        raise FleetError(f"no dpex fleet named {fleet!r} in this Ray cluster")
    handles = [actor for _, actor in actors]
    if now:
        for actor in handles:
            _kill(actor)
        return len(actors)
    removed: list[Any] = []
    try:
        _drain_and_kill(handles, timeout, progress, removed)
    except KeyboardInterrupt:
        left = handles[len(removed):]
        answered = _call_all(left, "undrain")
        late = (f"; {len(left) - answered} did not answer within {_CALL_S:g} s and may "
                "still drain (a restarted worker does not)" if answered < len(left) else "")
        progress(f"interrupted: {answered} workers of fleet {fleet!r} take new sessions "
                 f"again ({len(removed)} removed already){late}")
        raise
    return len(actors)


def _drain_and_kill(actors: list[Any], timeout: float, progress: Callable[[str], None],
                    removed: list[Any]) -> None:
    """:func:`stop_fleet`'s drain, then kill the workers in order, appending each one
    killed to ``removed`` (so an interrupt knows which are left)."""
    _call_all(actors, "stop", end_sessions=False)
    busy = _wait_idle(actors, timeout)
    if busy:
        progress(f"{len(busy)} workers still serve sessions after {timeout:g} s: "
                 "ending them")
        _call_all(busy, "stop")
        grace = STOP_GRACE_S + 10.0
        still = _wait_idle(busy, grace)
        if still:
            progress(f"{len(still)} workers still served sessions after {grace:g} s more: "
                     "killed (their trainers see a death)")
    for actor in actors:
        _kill(actor)
        removed.append(actor)


def scale_fleet(fleet: str, workers: int, timeout: float = 120.0,
                progress: Callable[[str], None] = print,
                drain_s: float = DRAIN_S) -> tuple[int, int]:
    """Grow or shrink ``fleet`` to ``workers``; return (before, after).

    New workers get the settings the fleet was started with. Shrinking removes idle
    workers (no session) first, then the newest, each drained first: it takes no new
    session and ends the ones it serves, whose trainers move them to the other workers,
    as after a death but without spending one of their ``max_worker_restarts``; it is
    killed once idle (or after ``drain_s`` seconds)."""
    if workers < 1:
        raise FleetError(f"--workers must be >= 1, got {workers}")
    actors = fleet_workers(fleet)
    if not actors:
        raise FleetError(f"no dpex fleet named {fleet!r} in this Ray cluster")
    stats = sample(actors)
    if not stats:
        raise FleetError(f"no worker of fleet {fleet!r} answered")
    before = len(actors)
    if workers > before:
        setting = next(iter(stats.values())).get("fleet_setting") or {}
        held: dict[str, int] = {}
        for info in stats.values():
            held[info["node_id"]] = held.get(info["node_id"], 0) + 1
        top = max(i for i, _ in actors)
        _start_workers(fleet, list(range(top + 1, top + 1 + workers - before)),
                       setting.get("options", {"num_cpus": 1.0, "resources": {}}),
                       setting.get("session_timeout", 30.0), timeout, progress, held)
    elif workers < before:
        order = sorted(actors, key=lambda a: (stats.get(a[0], {}).get("sessions_active", 0) > 0,
                                              -a[0]))
        _remove([actor for _, actor in order[:before - workers]], progress, drain_s)
    return before, workers


def _remove(actors: list[Any], progress: Callable[[str], None],
            drain_s: float = DRAIN_S) -> None:
    """Drain the workers, then kill them: each takes no new session, ends the ones it
    serves (their trainers move them to the other workers, which costs none of their
    restarts), and is killed once idle, or after ``drain_s`` seconds (its trainers then
    see a death; the message says so)."""
    _call_all(actors, "stop")
    busy = _wait_idle(actors, drain_s)
    for actor in actors:
        _kill(actor)
    if busy:
        progress(f"{len(busy)} of the removed workers still served sessions after "
                 f"{drain_s:g} s: killed (their trainers see a death and restart them)")
    progress(f"removed {len(actors)} workers")


def _call_all(actors: list[Any], method: str, **kwargs: Any) -> int:
    """Call ``method`` on every worker; wait for the calls at most _CALL_S (a dead or
    restarting worker must not hold up the rest); return how many answered then."""
    refs = [getattr(a, method).remote(**kwargs) for a in actors]
    if not refs:
        return 0
    done, _ = ray.wait(refs, num_returns=len(refs), timeout=_CALL_S)
    answered = 0
    for ref in done:
        try:
            ray.get(ref)
            answered += 1
        except ray.exceptions.RayError:
            pass  # died meanwhile: not answered
    return answered


def _wait_idle(actors: list[Any], timeout: float) -> list[Any]:
    """Wait until every worker serves no session and runs nothing of an ended one (so
    every ``serve`` call has returned and each trainer sees its session end cleanly),
    at most ``timeout`` seconds; return those still busy then. A worker that cannot be
    asked (dead) counts as idle: it serves nobody."""
    busy = list(actors)
    deadline = time.monotonic() + timeout
    while busy:
        left = deadline - time.monotonic()
        if left <= 0:
            return busy
        refs = {a.reusable.remote(): a for a in busy}
        done, _ = ray.wait(list(refs), num_returns=len(refs), timeout=min(1.0, left))
        for ref in done:
            try:
                idle = ray.get(ref)
            except ray.exceptions.RayError:
                idle = True
            if idle:
                busy.remove(refs[ref])
        if busy:
            time.sleep(min(0.2, max(0.0, deadline - time.monotonic())))
    time.sleep(0.5)  # (the serve calls' replies on their way to the trainers)
    return []


def _kill(actor: Any) -> None:
    try:
        ray.kill(actor, no_restart=True)
    except ValueError:
        pass  # gone already (another scaler removed it)


def fleet_target(sessions: int, workers: int, idle: int, idle_streak: int, minimum: int,
                 maximum: int, patience: int) -> int:
    """The policy mode's fleet size: one worker per session the trainers hold (their
    own autoscalers add sessions while they stall), within [minimum, maximum]; up at
    once, down only by idle workers (no session) after ``patience`` idle rounds."""
    want = max(minimum, min(maximum, sessions))
    if want > workers:
        return want
    if want < workers and idle_streak >= patience:
        return max(want, workers - idle)
    return workers


def autoscale_fleet(fleet: str, minimum: int, maximum: int, interval: float = 2.0,
                    patience: int = 5, rounds: int | None = None,
                    progress: Callable[[str], None] = print) -> None:
    """Follow the trainers' demand (``dpex fleet autoscale``): every ``interval`` s,
    grow to one worker per active session, shrink idle workers after ``patience``
    rounds; until interrupted (or ``rounds`` rounds)."""
    if not 1 <= minimum <= maximum:
        raise FleetError(f"need 1 <= --min <= --max, got {minimum} and {maximum}")
    streak = 0
    n = 0
    while rounds is None or n < rounds:
        n += 1
        actors = fleet_workers(fleet)
        if not actors:
            raise FleetError(f"no dpex fleet named {fleet!r} in this Ray cluster")
        stats = sample(actors)
        sessions = sum(s["sessions_active"] for s in stats.values())
        idle = [i for i, _ in actors if stats.get(i, {}).get("sessions_active", 1) == 0]
        streak = streak + 1 if idle and sessions < len(actors) else 0
        target = fleet_target(sessions, len(actors), len(idle), streak, minimum, maximum,
                              patience)
        if target != len(actors):
            progress(f"{sessions} sessions on {len(actors)} workers: scaling to {target}")
            if target > len(actors):
                try:
                    scale_fleet(fleet, target, timeout=max(interval, 10.0), progress=progress)
                except FleetError as exc:  # no room now: the next round tries again
                    progress(f"could not grow to {target}: {exc}")
            else:
                handles = dict(actors)
                victims = sorted(idle, reverse=True)[:len(actors) - target]
                _remove([handles[i] for i in victims], progress)
            streak = 0
        time.sleep(interval)
