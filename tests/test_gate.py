"""The rules of who a trainer's sockets keep while their handshake runs (issue 39, items
4 and 11), without sockets: dpex._addresses.AcceptSet and dpex.client._gate."""

import logging

import pytest

from dpex import _addresses
from dpex._addresses import AcceptSet
from dpex.client._gate import Cut, HandshakeGate, caps


def never_through(fd, entry):
    return True  # every connection still in its handshake


def test_an_unknown_peer_waits_for_one_look_up_and_is_admitted_if_it_joined():
    """A node that joined after the set was made (another subnet) is looked up, once
    for all the connections that arrive meanwhile; one that is no node is cut, and
    until the next look-up is allowed an unknown peer is cut at once."""
    accept = AcceptSet(["10.0.0.0/24"], lookup=lambda: [], every=5.0)
    gate = HandshakeGate(accept, per_peer=4, total=8)
    assert gate.accepted(5, "10.0.0.7", 100, 0.0, never_through) == ([], False)  # subnet
    assert gate.accepted(6, "10.1.0.9", 100, 0.0, never_through) == ([], True)  # look up
    assert gate.accepted(7, "10.2.0.1", 100, 0.1, never_through) == ([], False)  # waits
    accept.update(["10.1.0.9"])  # what the look-up found: the new node
    assert gate.looked_up() == [Cut(7, 100, "10.2.0.1", "address")]
    assert gate.pending() == 2 and accept.admits("10.1.0.9")
    assert gate.accepted(8, "10.2.0.1", 100, 1.0, never_through) == (
        [Cut(8, 100, "10.2.0.1", "address")], False)  # no new look-up within 5 s
    assert gate.accepted(9, "10.2.0.1", 100, 5.0, never_through) == ([], True)
    accept.update([])  # the node left: no longer admitted
    assert gate.looked_up() == [Cut(9, 100, "10.2.0.1", "address")]
    assert not accept.admits("10.1.0.9") and accept.admits("10.0.0.200")


def test_over_a_cap_the_oldest_connection_still_in_its_handshake_is_cut():
    """Per peer address and in all; a connection found past its handshake (a
    genuine worker) is no longer counted, and is not cut."""
    through = {1}
    gate = HandshakeGate(AcceptSet(anyone=True), per_peer=2, total=3)

    def handshaking(fd, entry):
        return fd not in through

    assert gate.accepted(1, "a", 7, 0.0, handshaking) == ([], False)
    assert gate.accepted(2, "a", 7, 0.1, handshaking) == ([], False)
    assert gate.accepted(3, "a", 7, 0.2, handshaking) == ([], False)  # 1 was through
    assert gate.accepted(4, "a", 7, 0.3, handshaking)[0] == [Cut(2, 7, "a", "handshake-cap")]
    assert gate.accepted(5, "b", 8, 0.4, handshaking) == ([], False)
    assert gate.pending("a") == 2 and gate.pending() == 3
    assert gate.accepted(6, "c", 8, 0.5, handshaking)[0] == [Cut(3, 7, "a", "handshake-cap")]
    gate.ended(4)  # DISCONNECTED
    assert gate.pending() == 2


def test_connections_older_than_the_handshake_window_are_forgotten():
    """libzmq has dropped (or admitted) them by then: a lost DISCONNECTED event cannot
    keep a stale entry, nor its reused descriptor number, counted."""
    gate = HandshakeGate(AcceptSet(anyone=True), per_peer=2, total=2, window=4.0)
    gate.accepted(1, "a", 7, 0.0, never_through)
    gate.accepted(2, "a", 7, 1.0, never_through)
    assert gate.accepted(3, "a", 7, 4.5, never_through) == ([], False)  # 1 expired
    assert gate.accepted(2, "a", 7, 4.6, never_through) == ([], False)  # 2 reused
    assert gate.pending() == 2


def test_the_caps_leave_most_descriptors_to_the_training_loop():
    assert caps(512) == (64, 128)  # the hard limit: a quarter at most
    assert caps(20_000) == (64, 256)
    assert caps(40) == (16, 16)


def test_the_accepted_set_reads_ipv4_peers_of_a_dual_stack_socket_and_v6_networks():
    accept = AcceptSet(["192.0.2.0/24", "fd00::/8"], ["198.51.100.7"])
    assert accept.admits("::ffff:192.0.2.9") and accept.admits("198.51.100.7")
    assert accept.admits("fd00::1") and not accept.admits("fe80::1%eth0")
    assert not accept.admits("not an address") and not accept.admits("198.51.100.8")
    assert not accept.look_up_due(0.0)  # no lookup: a fixed set


def test_a_cluster_node_of_the_other_family_is_left_out_with_a_warning(monkeypatch, caplog):
    """Issue 39, item 5: a node address of the other family than the trainer's went
    into libzmq's filter and failed the iterator (``Invalid argument``)."""
    import ray

    monkeypatch.delenv("DPEX_ACCEPT_FROM", raising=False)
    monkeypatch.setattr(ray, "nodes", lambda: [
        {"NodeManagerAddress": "10.1.2.3", "Alive": True},
        {"NodeManagerAddress": "2001:db8::5", "Alive": True}])
    monkeypatch.setattr(_addresses, "subnet_of", lambda host: "192.0.2.0/24")
    with caplog.at_level(logging.WARNING, "dpex"):
        assert _addresses.accept_from("192.0.2.7") == ["192.0.2.0/24", "10.1.2.3",
                                                       "192.0.2.7"]
    assert "'2001:db8::5'" in caplog.text and "IPv4" in caplog.text
    accept = _addresses.accept_set("192.0.2.7")
    assert accept.admits("10.1.2.3") and accept.lookup is not None and not accept.tcp_filter
    assert accept.lookup() == ["10.1.2.3"]
    monkeypatch.setenv("DPEX_ACCEPT_FROM", "10.0.0.0/8")
    fixed = _addresses.accept_set("192.0.2.7")
    assert fixed.lookup is None and fixed.tcp_filter == ["10.0.0.0/8"]
    with pytest.raises(ValueError, match=r"DPEX_ACCEPT_FROM='2001:db8::/32'.*IPv4"):
        monkeypatch.setenv("DPEX_ACCEPT_FROM", "2001:db8::/32")
        _addresses.accept_from("192.0.2.7")
