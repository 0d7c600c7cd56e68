"""The pickled loader through the trainer's memfd (no Ray): read once by a host on its
node, released once every worker started, the object store's copy only when needed."""

import logging

import pytest
from dsets import open_memfds

from dpex._framed import PickleParts
from dpex._shipfile import Delivery, ShipmentFile, ShipmentUnavailable, read_shipment

NODE = "a" * 56


def memfds() -> list[str]:
    return open_memfds("dpex-shipment")


def test_a_host_reads_the_bytes_and_a_closed_or_foreign_file_is_refused():
    file = ShipmentFile(b"x" * 100_000 + b"end", NODE)
    assert read_shipment(file.ref) == b"x" * 100_000 + b"end"
    forged = file.ref.__class__(NODE, file.ref.pid, file.ref.fd, b"\0" * 16, file.ref.size)
    with pytest.raises(ShipmentUnavailable, match="nonce"):
        read_shipment(forged)  # another file at that number: not ours
    file.close()
    with pytest.raises(ShipmentUnavailable):
        read_shipment(file.ref)


class Store:
    def __init__(self):
        self.puts = []

    def put(self, data, refs):
        self.puts.append((bytes(data), refs))
        return f"ref{len(self.puts)}"


def delivery(data=b"pickled", repickle=lambda: PickleParts([b"pickled"]), stored=None):
    store, told = Store(), []
    shipment = PickleParts([data[:3], data[3:]], refs=("r1",))
    d = Delivery(shipment, NODE, shipment.digest(), stored=stored, put=store.put,
                 repickle=repickle, on_stored=told.append)
    return d, store, told


def test_nothing_is_stored_unless_a_worker_needs_the_object_store():
    d, store, told = delivery()
    assert read_shipment(d.local) == b"pickled" and store.puts == []
    assert d.object_ref() == "ref1" and d.object_ref() == "ref1"  # put once, from the file
    assert store.puts == [(b"pickled", ("r1",))] and told == ["ref1"]
    d.release_local()
    assert d.local is None and memfds() == []


def test_the_loaders_stored_copy_is_reused_and_none_is_put():
    d, store, _ = delivery(stored="kept")
    assert d.object_ref() == "kept" and store.puts == []
    d.release_local()


def test_after_release_the_loader_is_pickled_again_and_a_change_is_logged(caplog):
    calls = []
    d, store, _ = delivery(repickle=lambda: calls.append(1) or PickleParts([b"changed"]))
    before = memfds()
    d.release_local()
    assert len(memfds()) == len(before) - 1  # the trainer holds no copy any more
    with caplog.at_level(logging.WARNING, logger="dpex"):
        assert d.object_ref() == "ref1"
    assert calls == [1] and store.puts == [(b"changed", ("r1",))]
    assert "changed since this iterator started" in caplog.text


def test_a_dropped_delivery_closes_its_file():
    before = len(memfds())
    d, _, _ = delivery()
    assert len(memfds()) == before + 1
    del d
    assert len(memfds()) == before
