"""A node that joins after the iterator opened (run by tests/test_accept_netns.py in the
head namespace, as root; no Ray).

The trainer: a session bound on the head's address with the accepted set dpex makes
by default (the head's subnet and the cluster's nodes, ``ray.nodes()`` answered here
from a list). A genuine worker (the session's credentials and route) runs in a host
on another subnet that is no node yet; after --join-after seconds its address joins
the list, as an autoscaler's node joins the cluster. Prints one JSON line: whether
its HELLO came before the join, how long after the join it came (null: never), and
the session's rejected counters. ``--worker`` is the worker's side (its spec on stdin).
"""

import argparse
import json
import os
import pickle
import queue
import subprocess
import sys
import time

import ray
import zmq

from dpex._event_loop import LoopThread
from dpex._protocol import Kind, Wire
from dpex._security import connect_promptly
from dpex.client._events import Handoff, WorkerHello
from dpex.client._session import TrainerSession


def worker() -> None:
    """Connect as worker 0 with what came on stdin and stay until killed."""
    keys, wire, identity, address = pickle.load(sys.stdin.buffer)
    ctx = zmq.Context()
    ctrl = ctx.socket(zmq.DEALER)
    ctrl.setsockopt(zmq.LINGER, 0)
    keys.apply(ctrl)
    connect_promptly(ctrl)
    ctrl.setsockopt(zmq.IDENTITY, identity)
    ctrl.connect(address)
    ctrl.send_multipart(wire.encode(Kind.HELLO, worker_id=0, payload={}))
    time.sleep(120)


def hello_within(handoff: Handoff, seconds: float) -> float | None:
    """Seconds until a WorkerHello came (None: none within ``seconds``)."""
    started = time.monotonic()
    while (left := started + seconds - time.monotonic()) > 0:
        try:
            if isinstance(handoff.get(timeout=min(left, 0.1)), WorkerHello):
                return time.monotonic() - started
        except queue.Empty:
            pass
    return None


def trainer(args: argparse.Namespace) -> None:
    nodes = [args.head_ip]
    ray.nodes = lambda: [{"NodeManagerAddress": a, "Alive": True} for a in nodes]
    handoff = Handoff()
    loop = LoopThread("late-node-loop")
    sess = TrainerSession(Wire.new(), args.head_ip, handoff)
    loop.start()
    loop.run(sess.open(), 10)
    here = os.path.abspath(__file__)
    far = subprocess.Popen(["ip", "netns", "exec", args.late_ns, sys.executable, here,
                            "--worker"], stdin=subprocess.PIPE)
    try:
        far.stdin.write(pickle.dumps((sess.keys.client, sess.wire, sess.routes.identity(0),
                                      sess.control_address)))
        far.stdin.close()
        before = hello_within(handoff, args.join_after) is not None
        nodes.append(args.late_ip)  # the node joins the cluster
        after = None if before else hello_within(handoff, 20.0)
        counters = loop.run(sess.snapshot(), 5)
    finally:
        far.kill()
        far.wait(10)
        loop.stop(cleanup=sess.close)
    print(json.dumps({"hello_before_join": before, "hello_after_join_s": after,
                      "rejected": counters["rejected"]}))


def main() -> None:
    p = argparse.ArgumentParser()
    p.add_argument("--worker", action="store_true")
    p.add_argument("--head-ip")
    p.add_argument("--late-ns")
    p.add_argument("--late-ip")
    p.add_argument("--join-after", type=float, default=4.0)
    args = p.parse_args()
    if args.worker:
        worker()
    else:
        trainer(args)


if __name__ == "__main__":
    main()
