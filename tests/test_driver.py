"""EpochDriver (dpex/client/_driver.py) on an in-memory runtime (tests/fake_runtime.py):
no Ray, no sockets, no threads. The loop thread runs what it is given at once, the
session records what it sends, the worker group records what it starts; workers
"answer" by putting events on the driver's queue, as the loop thread and the worker
group do (batches too: the session's data socket, which the training thread reads
itself, is empty here). What the live tests (test_lifecycle.py, test_errors.py,
test_lost.py, test_autoscale.py) check end to end, these check of the driver's own
rules, in milliseconds; test_driver_*.py do so with the fake playing the workers."""

from __future__ import annotations

import queue
import threading
import time

import pytest
from fake_runtime import Owner, Runtime, Workers, batch, draws, driver, hello

from dpex._config import DpexConfig
from dpex._protocol import Kind
from dpex.client._driver import EpochDriver
from dpex.client._events import LoopFailure, RngReply, WorkerExit, WorkerHello
from dpex.client._launch import plan_launch
from dpex.client._runtime import Seeds
from dpex.client._scheduler import EPOCH_END, Control, KillWorker, SendTasks
from dpex.errors import (
    DpexError,
    EventLoopError,
    ProtocolError,
    WorkerDiedError,
    WorkerStartupError,
)


def test_the_driver_opens_its_runtime_and_starts_every_worker_with_its_spec():
    d, runtime, _, _ = driver(3)
    assert runtime.opened
    assert [call[:2] for call in runtime.workers.calls] == [("start", [0, 1, 2])]
    assert runtime.workers.calls[0][2] is d.shipment
    assert [s.base_seed for s in d.specs] == [100] * 3
    assert {s.ring for s in d.specs} == {None}  # no ring could be made: the socket path


def test_a_failed_start_closes_the_runtime_it_was_given():
    runtime = Runtime()

    def ship():
        raise RuntimeError("object store full")

    with pytest.raises(RuntimeError, match="object store full"):
        EpochDriver(runtime, queue.SimpleQueue(), DpexConfig(),
                    plan_launch(num_workers=1, scaled_to=None, prefetch_factor=2,
                                iterable=False, worker_seeding="torch", resume=None),
                    Seeds(1, None), ship=ship, node_id="n",
                    prefetch_factor=2, in_order=True, iterable=False, timeout=0,
                    on_stop=Owner().stop, on_scaled=lambda n: None, free_resources=dict)
    assert runtime.closed and runtime.workers.calls == [("stop",)]


def test_an_epochs_batches_come_in_order():
    d, runtime, handoff, _ = driver(2)
    draw = draws(4)
    d.start_epoch(draw, shared_seed=None, first_worker=0, ended=frozenset(), skips={})
    handoff.put(hello(0))
    handoff.put(hello(1))
    handoff.put([batch(1, 1), batch(0, 0)])  # (worker 1's came first)
    assert d.next_message(draw).payload == 0
    assert d.next_message(draw).payload == 1
    handoff.put([batch(0, 2), batch(1, 3)])
    assert [d.next_message(draw).payload for _ in range(2)] == [2, 3]
    assert d.next_message(draw) is EPOCH_END


def test_a_worker_of_other_versions_stops_everything_then_is_refused_by_name():
    d, runtime, handoff, owner = driver(1)
    d.start_epoch(draws(), shared_seed=None, first_worker=0, ended=frozenset(), skips={})
    handoff.put(WorkerHello(0, {"versions": {"dpex": "0.0.1"}, "node_ip": "10.0.0.9"}))
    with pytest.raises(WorkerStartupError, match=r"worker 0 on node 10\.0\.0\.9 runs"):
        d.receive_one()
    assert owner.stops == 1 and runtime.closed


def test_a_dead_worker_is_replaced_with_the_next_incarnation_and_expected():
    d, runtime, handoff, owner = driver(2)
    draw = draws()
    d.start_epoch(draw, shared_seed=None, first_worker=0, ended=frozenset(), skips={})
    handoff.put(hello(0))
    handoff.put(hello(1))
    d.receive_one()
    d.receive_one()
    handoff.put(WorkerExit(1, RuntimeError("killed"), incarnation=0))
    d.receive_one()
    assert ("restart", 1, 1) in runtime.workers.calls
    assert ("expect", 1, 1) in runtime.session.sent
    assert owner.stops == 0 and not runtime.closed


def test_one_death_more_than_max_worker_restarts_stops_everything_then_says_so():
    d, runtime, handoff, owner = driver(1, max_restarts=0)
    d.start_epoch(draws(), shared_seed=None, first_worker=0, ended=frozenset(), skips={})
    handoff.put(hello(0))
    d.receive_one()
    handoff.put(WorkerExit(0, RuntimeError("segfault"), incarnation=0))
    with pytest.raises(WorkerDiedError, match=r"worker 0 \(pid 7, node 127\.0\.0\.1\) died "
                       r"after 0 restart\(s\).*max_worker_restarts=0.*segfault"):
        d.receive_one()
    assert owner.stops == 1 and runtime.closed


@pytest.mark.parametrize("error,raised", [
    (DpexError("dpex's own words"), DpexError),
    (ValueError("a bug"), EventLoopError),
])
def test_a_loop_failure_stops_everything_then_raises_in_dpexs_words(error, raised):
    d, runtime, handoff, owner = driver(1)
    handoff.put(LoopFailure(error))
    with pytest.raises(raised) as info:
        d.receive_one()
    assert owner.stops == 1 and runtime.closed
    assert info.value is error if raised is DpexError else info.value.__cause__ is error


def test_workers_that_never_start_stop_everything_then_are_named():
    d, runtime, handoff, owner = driver(2, startup_timeout=0.05)
    d.start_epoch(draws(), shared_seed=None, first_worker=0, ended=frozenset(), skips={})
    handoff.put(hello(0))
    d.receive_one()
    with pytest.raises(WorkerStartupError, match=r"workers \[1\] did not start within "
                       r"startup_timeout=0.05 s.*resources free now: \{'CPU': 0.0\}"):
        d.receive_one()
    assert owner.stops == 1 and runtime.closed


def test_the_workers_rng_states_are_asked_for_and_collected():
    d, runtime, handoff, _ = driver(2)
    d.start_epoch(draws(), shared_seed=None, first_worker=0, ended=frozenset(), skips={})
    handoff.put(RngReply(0, 1, 4, {"torch": "zero"}))
    handoff.put(RngReply(1, 1, 5, {"torch": "one"}))
    assert d.worker_rng_states({0: (1, 4), 1: (1, 5)}) == {
        0: {"torch": "zero"}, 1: {"torch": "one"}}
    assert ("send", 0, Kind.RNG_QUERY, 1, 4) in runtime.session.sent


def test_scaling_adds_workers_with_new_ids_and_retires_them_through_the_scheduler():
    d, runtime, handoff, owner = driver(1)
    draw = draws(40)
    d.start_epoch(draw, shared_seed=None, first_worker=0, ended=frozenset(), skips={})
    d.elastic.scale_to(3, draw)
    assert [c for c in runtime.workers.calls if c[0] == "add"] == [("add", 1, 2), ("add", 2, 3)]
    assert owner.scaled == [3] and [s.worker_id for s in d.specs] == [0, 1, 2]
    d.elastic.scale_to(2, draw)
    assert d.sched.num_workers == 2 and owner.scaled == [3, 2]


def test_a_count_asked_for_from_another_thread_waits_for_the_training_thread():
    d, runtime, handoff, owner = driver(1)
    draw = draws(40)
    d.start_epoch(draw, shared_seed=None, first_worker=0, ended=frozenset(), skips={})
    other = threading.Thread(target=d.elastic.scale_to, args=(2, draw))
    other.start()
    other.join(5)
    assert d.sched.num_workers == 1 and owner.scaled == []  # only asked for
    d.elastic.tick(draw)  # the training thread, before its next take
    assert d.sched.num_workers == 2 and owner.scaled == [2]


def test_the_messages_among_actions_go_out_together_in_their_order_from_this_thread():
    d, runtime, _, _ = driver(2)
    crossings = runtime.loop.crossings
    d.apply([SendTasks(0, 1, [(0, [0])]), Control(1, Kind.SKIP, 1, 2), KillWorker(1),
             SendTasks(0, 1, [(2, [2])])])
    assert runtime.session.sent == [("send_all", [("SendTasks", 0), ("Control", 1)]),
                                    ("send_all", [("SendTasks", 0)])]
    assert runtime.workers.calls[-1] == ("kill", 1)
    assert runtime.loop.crossings == crossings  # one hop: nothing crossed to the loop thread


@pytest.mark.parametrize("error, raised", [
    (ProtocolError("too-large", "the indices of batch 0 take 9 bytes"), ProtocolError),
    (OSError("socket gone"), EventLoopError),
])
def test_a_send_that_fails_on_the_training_thread_stops_everything_then_raises(error, raised):
    d, runtime, _, owner = driver(1)
    runtime.session.fail_with = error
    with pytest.raises(raised):
        d.apply([SendTasks(0, 1, [(0, [0])])])
    assert owner.stops == 1 and runtime.closed


def test_an_added_worker_not_ready_within_startup_timeout_is_given_up():
    d, runtime, handoff, _ = driver(1, startup_timeout=0.2)
    draw = draws(40)
    d.start_epoch(draw, shared_seed=None, first_worker=0, ended=frozenset(), skips={})
    handoff.put(hello(0))
    d.receive_one()
    d.elastic.scale_to(2, draw)
    d.elastic.give_up_unstarted()
    assert d.sched.num_workers == 2  # within its time
    time.sleep(0.25)
    d.elastic.give_up_unstarted()
    assert d.sched.num_workers == 1 and d.sched.workers[1].gone
    assert ("retire", 1) in runtime.workers.calls


def _asked_of_the_group() -> set[str]:
    """Every attribute dpex's client code uses on an iterator's worker group
    (``<x>.runtime.workers.<name>``, ``runtime.workers.<name>``), read off its source."""
    import ast
    import pathlib

    import dpex.client

    asked = set()
    for path in pathlib.Path(dpex.client.__file__).parent.glob("*.py"):
        for node in ast.walk(ast.parse(path.read_text())):
            if (isinstance(node, ast.Attribute) and isinstance(node.value, ast.Attribute)
                    and node.value.attr == "workers"
                    and isinstance(node.value.value, (ast.Attribute, ast.Name))
                    and getattr(node.value.value, "attr", getattr(node.value.value, "id", ""))
                    == "runtime"):
                asked.add(node.attr)
    return asked


def test_the_worker_group_protocol_is_what_the_driver_asks_and_every_group_has_it():
    from inprocess import _Workers

    from dpex.client import _fleet_group, _runtime, _workers

    declared = {name for name in vars(_runtime.Workers) if not name.startswith("_")}
    declared |= set(_runtime.Workers.__annotations__)
    asked = _asked_of_the_group()
    assert {"kill", "restart", "add", "retire", "warm", "options"} <= asked  # (the scan works)
    assert asked <= declared, asked - declared  # nothing asked that a group need not have
    from dpex._protocol import Wire

    for group in (_workers.WorkerGroup, _fleet_group.FleetGroup, Workers(),
                  _Workers(queue.SimpleQueue(), Wire.new())):
        have = set(dir(group))
        if isinstance(group, type):  # (made with Ray only: what its __init__ sets)
            have |= {"options", "actors", "warm"}
        assert declared <= have, (group, declared - have)


def test_each_group_sets_the_attributes_it_declares_when_made():
    import queue as queue_

    from dpex.client import _fleet_group

    group = _fleet_group.FleetGroup("pool", queue_.SimpleQueue())
    assert group.warm == frozenset() and group.actors == {} and group.options


class _Done:
    """A finished ``serve`` call's future, as Ray hands it to its done-callbacks."""

    def __init__(self, error: BaseException | None) -> None:
        self.error = error

    def result(self):
        if self.error is not None:
            raise self.error


@pytest.mark.parametrize("guest, error, lost", [
    (True, "actor", True),  # its host actor died: not the guest's own death
    (True, "task", False),  # its own session process died (the actor raised)
    (False, "actor", False),  # an actor of its own: its own death
])
def test_a_guest_lost_with_its_host_is_moved_not_charged_a_restart(guest, error, lost):
    import ray

    from dpex.client._workers import report_exit

    exc = (ray.exceptions.ActorDiedError() if error == "actor"
           else ray.exceptions.RayTaskError("serve", "traceback", RuntimeError("killed")))
    events: queue.SimpleQueue = queue.SimpleQueue()
    told: list = []
    report_exit(events, 2, 1, (lambda: told.append(1)) if guest else None)(_Done(exc))
    exit_ = events.get_nowait()
    assert (exit_.worker_id, exit_.incarnation, exit_.moved) == (2, 1, lost)
    assert not exit_.unplaced and told == ([1] if lost else [])  # the group hears its host died


@pytest.mark.parametrize("fleet, error, moved, unplaced", [
    (False, "unschedulable", False, True),  # its node went away before it was placed
    (False, None, False, False),  # its session ended cleanly (retired)
    (True, None, True, True),  # a fleet worker's clean end: removed by `dpex fleet scale`
    (True, "task", False, False),  # a fleet session that died: its own death
])
def test_the_group_says_in_the_exit_report_what_is_not_a_death_of_its_own(fleet, error,
                                                                        moved, unplaced):
    import ray

    from dpex.client._workers import report_exit

    exc = {"unschedulable": ray.exceptions.ActorUnschedulableError("its node is gone"),
           "task": ray.exceptions.RayTaskError("serve", "traceback", RuntimeError("died")),
           None: None}[error]
    events: queue.SimpleQueue = queue.SimpleQueue()
    report_exit(events, 0, 0, fleet=fleet)(_Done(exc))
    exit_ = events.get_nowait()
    assert (exit_.moved, exit_.unplaced) == (moved, unplaced)
