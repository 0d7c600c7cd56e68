"""Issue 39, item 4, across hosts: a node that joins the cluster after the iterator
opened, on another subnet than the trainer's (one subnet per zone is common), is
admitted. Network namespaces (scripts/netns_cluster.py: a head on 198.51.100.1/25, a
host on the other /25), no Ray: tests/late_node_app.py answers ``ray.nodes()`` from a
list that the late host joins. Skipped, with the reason, where namespaces cannot be
built."""

import json
import os
import subprocess
import sys

import pytest

HERE = os.path.dirname(os.path.abspath(__file__))
sys.path.insert(0, os.path.join(os.path.dirname(HERE), "scripts"))
import netns_cluster  # noqa: E402

REASON = netns_cluster.available()
pytestmark = [pytest.mark.skipif(REASON is not None, reason=str(REASON)),
              pytest.mark.slow, pytest.mark.timeout(120)]


def test_a_node_that_joins_after_the_iterator_opened_on_another_subnet_is_admitted():
    """The accepted set was frozen when the iterator opened (libzmq's
    TCP_ACCEPT_FILTER, copied into the listener at bind): the late node's worker was
    refused for good and its epoch failed. It is now looked up again when an unknown
    address connects (at most every few seconds): refused while it is no node,
    admitted once it is one."""
    with netns_cluster.other_subnet(nodes=1) as hosts:
        env = {**os.environ, "PYTHONPATH": os.pathsep.join(
            p for p in (os.path.dirname(HERE), os.environ.get("PYTHONPATH")) if p)}
        env.pop("DPEX_ACCEPT_FROM", None)
        proc = subprocess.run(
            hosts.cmd(hosts.head_ns, sys.executable, os.path.join(HERE, "late_node_app.py"),
                      "--head-ip", netns_cluster.HEAD_IP, "--late-ns", hosts.node_nss[0],
                      "--late-ip", hosts.node_ips[0], "--join-after", "4"),
            env=env, capture_output=True, text=True, timeout=90)
    assert proc.returncode == 0, proc.stdout[-2000:] + proc.stderr[-4000:]
    result = json.loads(proc.stdout.strip().splitlines()[-1])
    print(result)
    assert result["hello_before_join"] is False  # not a node yet: refused
    assert result["hello_after_join_s"] is not None and result["hello_after_join_s"] < 10
    assert result["rejected"].get("address", 0) >= 1
