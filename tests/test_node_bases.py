"""A fleet's workers on one node share one fork base per dataset (issue 47; no Ray: two
fleet workers' base starters in this process, one registry directory): the second
finds the first's base, its sessions fork from it, and the owner stops it only once
no session of either uses it."""

import os
import time

import pytest
from test_framed import shipped

from dpex._spec import Parcel
from dpex.server._base_starter import BaseStarter
from dpex.server._fork_base import preloaded
from dpex.server._node_bases import NodeBases, Published
from dpex.server._session_process import mp_context

pytestmark = [pytest.mark.slow, pytest.mark.timeout(180)]


def report(conn):
    """A session's stand-in: its parent (the base) and the dataset it was forked with."""
    loader = preloaded()
    conn.send((os.getppid(), len(loader.dataset), loader.dataset[7]))
    conn.close()


def session(base):
    ctx = mp_context()
    mine, theirs = ctx.Pipe()
    proc = base.process(target=report, args=(theirs,), daemon=True)
    proc.start()
    theirs.close()
    assert mine.poll(60), "the session never answered"
    said = mine.recv()
    proc.join(10)
    return said


def test_two_fleet_workers_of_a_node_fork_from_one_base_which_waits_for_its_users(tmp_path):
    data = bytes(shipped(list(range(1000))))
    key = "ab" * 16
    node_a, node_b = NodeBases(str(tmp_path)), NodeBases(str(tmp_path))
    owner = BaseStarter(None, share_libraries=False, node=node_a).start(key, Parcel(data))
    other = BaseStarter(None, share_libraries=False, node=node_b).start(key, Parcel())  # no bytes
    assert isinstance(owner, Published) and not isinstance(other, Published)
    assert other.pid == owner.base.pid  # one base on the node, not two
    assert session(owner) == (owner.base.pid, 1000, 7)
    assert session(other) == (owner.base.pid, 1000, 7)  # forked by the owner's base

    use = node_b.use(key)  # a session of the other worker runs on it
    owner.stop()  # the owner retires it: held, not stopped
    assert owner.alive() and other.alive()
    assert session(other)[0] == owner.base.pid
    node_b.unuse(use)
    node_a.sweep()
    deadline = time.monotonic() + 10
    while other.alive() and time.monotonic() < deadline:
        time.sleep(0.05)
    assert not owner.alive() and not other.alive()
    assert node_b.find(key) is None  # withdrawn: the next worker starts another
