"""The pickled loader through the trainer's memfd (no Ray): read once by a host on its
node, released once every worker started, the object store's copy only when needed."""

import logging

import pytest
from dsets import open_memfds

from dpex import _shipfile as shipfile
from dpex._loader_pickle import PickleParts
from dpex._shipfile import Delivery, ShipmentFile, ShipmentUnavailable, map_shipment

NODE = "a" * 56


def memfds() -> list[str]:
    return open_memfds("dpex-shipment")


def read_shipment(ref) -> bytes:
    return bytes(map_shipment(ref))


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


def delivery(data=b"pickled", repickle=lambda: PickleParts([b"pickled"]), stored=None,
             out_of_band=0):
    store, told = Store(), []
    shipment = PickleParts([data[:3], data[3:]], refs=("r1",), out_of_band=out_of_band)
    d = Delivery(shipment, NODE, shipment.digest(), stored=stored, put=store.put,
                 repickle=repickle, on_stored=told.append)
    return d, store, told


@pytest.fixture
def closing(monkeypatch):
    """Deliveries close their memfd once the first workers started (a large pickle)."""
    monkeypatch.setattr(shipfile, "KEEP_IN_BAND_BYTES", 0)


def test_a_delivery_of_buffers_keeps_its_memfd_until_it_is_dropped():
    """Mostly buffers (in-band pickle up to KEEP_IN_BAND_BYTES): the memfd is the base's
    dataset pages, so it stays open for later workers, and nothing is stored."""
    d, store, _ = delivery(b"p" * 100, out_of_band=90)
    assert d.kept
    before = len(memfds())
    assert d.lend() == d.local  # a worker on a host was given it
    d.release_local()  # every first worker said hello
    assert d.local is not None and read_shipment(d.local) == b"p" * 100
    assert store.puts == [] and len(memfds()) == before
    large, _, _ = delivery(b"p" * 100, out_of_band=0)
    assert large.kept  # 100 bytes in band: under the limit
    large.release_local()  # ... but no host was given it: nobody maps it, it goes
    assert large.local is None and len(memfds()) == before
    d.close()  # the iterator ended
    assert d.local is None and len(memfds()) == before - 1


def test_a_delivery_with_a_pickle_over_the_limit_is_not_kept(monkeypatch):
    monkeypatch.setattr(shipfile, "KEEP_IN_BAND_BYTES", 50)
    assert not delivery(b"p" * 100, out_of_band=49)[0].kept  # 51 bytes in band
    assert delivery(b"p" * 100, out_of_band=50)[0].kept
    assert not Delivery(b"raw bytes", NODE, b"", put=None, repickle=None).kept
    again = PickleParts([b"p" * 100], out_of_band=100)  # the previous iterator's bytes
    assert not Delivery(again, NODE, b"", put=None, repickle=None, keep=False).kept


@pytest.mark.usefixtures("closing")
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


@pytest.mark.usefixtures("closing")
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


def test_the_memfd_is_sealed_against_writes_yet_a_base_maps_it_copy_on_write():
    """Any process of the trainer's user can open the memfd by its /proc path: sealed,
    nobody can rewrite a later worker's dataset, while a base's private mapping still
    takes writes of its own. A memfd without the seals is refused."""
    import errno
    import os

    file = ShipmentFile(b"dataset" * 1000, NODE)
    path = f"/proc/{file.ref.pid}/fd/{file.ref.fd}"
    with pytest.raises(PermissionError) as raised:
        fd = os.open(path, os.O_RDWR)
        try:
            os.pwrite(fd, b"evil", 100)
        finally:
            os.close(fd)
    assert raised.value.errno == errno.EPERM
    view = map_shipment(file.ref)
    view[:4] = b"mine"  # (copy-on-write: the file keeps its bytes)
    assert read_shipment(file.ref)[:7] == b"dataset"
    file.close()
    unsealed = os.memfd_create("dpex-shipment-test", os.MFD_CLOEXEC)
    try:
        os.pwrite(unsealed, file.ref.nonce + bytes(48) + b"x" * 10, 0)
        forged = file.ref.__class__(NODE, os.getpid(), unsealed, file.ref.nonce, 10)
        with pytest.raises(ShipmentUnavailable, match="not sealed"):
            map_shipment(forged)
    finally:
        os.close(unsealed)
