"""The same-node ring (dpex._shm) driven directly: no Ray, both ends in this process."""

import gc
import os
import random

import numpy as np
import pytest
import torch
from dsets import open_memfds
from torch.utils.data import default_collate
from torch.utils.data._utils import worker as torch_worker

from dpex._protocol import Kind, Wire
from dpex._shm import (
    INLINE,
    TICKETS,
    RingRef,
    RingUnavailable,
    TrainerRing,
    WorkerRing,
    collating_into,
    split_descriptor,
)
from dpex._transport import SOCKET, Receiver, RingTransport, encode_data
from dpex.errors import ProtocolError

NODE = "node-a"


@pytest.fixture
def rings():
    trainer = TrainerRing(0, 1 << 20, NODE)
    worker = WorkerRing(trainer.ref, NODE)
    yield trainer, worker
    worker.close()
    trainer.close()


def _memfds() -> list[str]:
    return open_memfds("dpex-ring")


def send(trainer, worker, buffers):
    descriptor, inline = worker.place(buffers)
    _, extents, _ = split_descriptor(memoryview(descriptor))
    spans = trainer.take(extents)
    frames = iter(inline)
    return [next(frames) if s is None else s for s in spans], extents


def test_a_collated_batch_crosses_without_a_copy(rings):
    trainer, worker = rings
    batch = torch.arange(4096, dtype=torch.float32).reshape(64, 64)
    arr = worker.allocate(batch.numel() * 4)
    arr[:] = batch.reshape(-1).view(torch.uint8).numpy()
    got, extents = send(trainer, worker, [arr])
    assert extents[0][0] != INLINE
    assert np.array_equal(got[0], arr)
    got[0][0] = 255  # the trainer's array is the very memory the worker wrote
    assert arr[0] == 255


def test_small_buffers_outside_the_ring_go_inline_and_big_ones_are_copied_in(rings):
    trainer, worker = rings
    small, big = np.arange(100, dtype=np.uint8), np.full(200_000, 7, np.uint8)
    got, extents = send(trainer, worker, [small, big])
    assert extents[0][0] == INLINE and extents[1][0] != INLINE
    assert got[0] is small and np.array_equal(got[1], big)


def test_held_regions_are_never_overwritten_whatever_is_held():
    trainer = TrainerRing(0, 4 << 20, NODE)
    worker = WorkerRing(trainer.ref, NODE)
    rng = random.Random(0)
    held: list[tuple[np.ndarray, int]] = []
    kept_by_worker: list[tuple[np.ndarray, int]] = []
    in_ring = 0
    for i in range(3000):
        n = rng.choice([64, 1000, 30_000, 150_000, 400_000])
        value = i % 251
        arr = worker.allocate(n)
        if arr is None:  # full: as a worker does, send from plain memory instead
            arr = np.empty(n, np.uint8)
        arr[:] = value
        got, extents = send(trainer, worker, [arr])
        in_ring += extents[0][0] != INLINE
        if rng.random() < 0.02:
            kept_by_worker.append((arr, value))  # a dataset that caches its batch
        del arr
        held.append((got[0], value))
        rng.shuffle(held)
        while len(held) > rng.choice([0, 1, 3, 8]):
            held.pop()  # the training loop drops batches in any order
        for a, v in held + kept_by_worker:
            assert a.min() == v == a.max(), f"a held buffer was overwritten at step {i}"
    assert in_ring > 2000, in_ring  # and the ring was in use, not bypassed
    held.clear()
    kept_by_worker.clear()
    worker.close()
    trainer.close()


def test_a_full_ring_sends_inline_and_recovers_when_freed(rings):
    trainer, worker = rings
    big = np.full(300_000, 1, np.uint8)
    held = [send(trainer, worker, [big])[0] for _ in range(3)]
    assert worker.allocate(300_000) is None  # 3 × 300 kB held in a 1 MiB ring
    got, extents = send(trainer, worker, [big])
    assert extents[0][0] == INLINE and np.array_equal(got[0], big)
    held.clear()
    assert worker.allocate(300_000) is not None


def test_a_buffer_held_for_a_whole_ticket_cycle_is_never_overwritten(rings):
    trainer, worker = rings
    arr = worker.allocate(64)
    arr[:] = 42
    first, extents = send(trainer, worker, [arr])
    del arr
    for _ in range(TICKETS + 10):  # every ticket slot comes round again; first's is taken
        got, extents = send(trainer, worker, [worker.allocate(64)])
        assert extents[0][0] != INLINE  # the held slot is skipped, not a reason to go inline
    filler = []
    while (arr := worker.allocate(4096)) is not None:
        arr[:] = 7  # fill the ring: nothing may land on first's region
        filler.append(arr)
    assert first[0].min() == first[0].max() == 42


def test_several_copied_buffers_of_one_message_never_overlap(rings):
    trainer, worker = rings  # 1 MiB: the second buffer does not fit, the third does
    bufs = [np.full(600_000, 1, np.uint8), np.full(500_000, 2, np.uint8),
            np.full(300_000, 3, np.uint8)]
    got, extents = send(trainer, worker, bufs)
    spans = sorted((pos, pos + n) for pos, n, _ in extents if pos != INLINE)
    assert all(a[1] <= b[0] for a, b in zip(spans, spans[1:], strict=False))
    for g, b in zip(got, bufs, strict=True):
        assert np.array_equal(g, b)


def test_keeping_the_labels_frees_the_images_region(rings):
    trainer, worker = rings
    images, labels = worker.allocate(700_000), worker.allocate(64)
    got, extents = send(trainer, worker, [images, labels])
    del images, labels
    kept_labels = got[1]
    del got
    assert worker.allocate(700_000) is not None  # only the labels' 64 bytes stay taken
    assert kept_labels is not None
@pytest.mark.parametrize("mutate", ["nonce", "node", "pid"])
def test_a_worker_that_cannot_reach_the_ring_says_why(mutate):
    trainer = TrainerRing(0, 1 << 20, NODE)
    ref = trainer.ref
    bad = {"nonce": RingRef(0, NODE, ref.pid, ref.fd, b"x" * 16, ref.capacity),
           "node": RingRef(0, "node-b", ref.pid, ref.fd, ref.nonce, ref.capacity),
           "pid": RingRef(0, NODE, 2**22 + 1, ref.fd, ref.nonce, ref.capacity)}[mutate]
    with pytest.raises(RingUnavailable, match={"nonce": "nonce", "node": "another Ray node",
                                               "pid": "cannot open"}[mutate]):
        WorkerRing(bad, NODE)
    trainer.close()


def receiving(wire, rings):
    """The trainer's data plane with these rings."""
    return Receiver(wire, [SOCKET, RingTransport(rings=rings)])


def test_a_bad_descriptor_is_an_error_in_its_slot_and_frees_its_tickets(rings):
    trainer, worker = rings
    with pytest.raises(ValueError, match="outside the ring"):
        trainer.take([(trainer.capacity - 10, 64, 0)])
    wire = Wire.new()
    frames = encode_data(wire, 1, 3, 1, torch.zeros(64), RingTransport(sender=worker))  # worker 1, ring of 0
    msg = receiving(wire, {0: trainer}).decode(frames)
    assert msg.kind is Kind.ERROR and "belongs to worker 0" in str(msg.payload.exc_msg)
    _, extents, _ = split_descriptor(memoryview(frames[2]))
    assert trainer._map[1024 + extents[0][2]] == 1  # its ticket was freed


def test_late_messages_of_a_retired_ring_are_dropped(rings):
    trainer, worker = rings
    wire = Wire.new()
    frames = encode_data(wire, 1, 3, 0, torch.zeros(64), RingTransport(sender=worker))
    trainer.retired = True
    with pytest.raises(ProtocolError, match="replaced worker") as err:
        receiving(wire, {0: trainer}).decode(frames)
    assert err.value.reason == "retired-ring"


def test_default_collate_writes_into_the_ring_only_inside_the_block(rings):
    _, worker = rings
    items = [torch.full((3, 8, 8), i, dtype=torch.float32) for i in range(4)]
    torch_worker._worker_info = torch_worker.WorkerInfo(id=0, num_workers=1, seed=0,
                                                        dataset=None)
    try:
        with collating_into(worker):
            inside = default_collate(items)
        outside = default_collate(items)
        with collating_into(None):  # no ring (a remote worker): plain memory
            plain = default_collate(items)
    finally:
        torch_worker._worker_info = None
    assert torch.equal(inside, outside) and torch.equal(plain, outside)
    assert worker._region_of(inside.reshape(-1).view(torch.uint8).numpy()) is not None
    assert worker._region_of(outside.reshape(-1).view(torch.uint8).numpy()) is None
    assert outside.is_shared() and not plain.is_shared()  # torch's own shm outside only


def test_a_ring_batch_message_round_trips_through_the_wire(rings):
    trainer, worker = rings
    wire = Wire.new()
    batch = {"x": torch.randn(32, 3, 16, 16), "y": torch.arange(32), "id": "b7"}
    frames = encode_data(wire, 1, 5, 0, batch, RingTransport(sender=worker))
    msg = receiving(wire, {0: trainer}).decode(frames)
    assert msg.kind is Kind.BATCH and msg.in_ring and msg.seq == 5
    assert torch.equal(msg.payload["x"], batch["x"]) and msg.payload["id"] == "b7"
    assert receiving(wire, {}).decode(frames).kind is Kind.ERROR  # an unknown ring: no hang


def test_closing_leaves_no_memfd_and_live_batches_stay_readable():
    before = _memfds()
    trainer = TrainerRing(0, 1 << 20, NODE)
    worker = WorkerRing(trainer.ref, NODE)
    arr = worker.allocate(1000)
    arr[:] = 9
    kept = send(trainer, worker, [arr])[0][0]
    del arr
    worker.close()
    trainer.close()
    assert kept.min() == kept.max() == 9  # the mapping lives as long as a batch views it
    del kept
    gc.collect()
    assert _memfds() == before  # and then nothing of the ring is left in this process


def test_tensors_kept_after_close_hold_their_pages_not_the_whole_ring():
    """20 small tensors kept from a 64 MiB ring: once the ring is closed only the pages
    they view keep memory."""
    trainer = TrainerRing(0, 64 << 20, NODE)
    worker = WorkerRing(trainer.ref, NODE)
    probe = os.dup(trainer.ref.fd)  # to read the memfd's allocated size after close

    def allocated_mib() -> float:
        return os.fstat(probe).st_blocks * 512 / (1 << 20)

    try:
        kept = []
        for i in range(20):  # batches of a small label and a big image, spread over the ring
            label, image = worker.allocate(64), worker.allocate(3 << 20)
            label[:], image[:] = i, i
            spans, _ = send(trainer, worker, [label, image])
            kept.append(spans[0])  # the loop keeps the labels only
            del label, image, spans
        before = allocated_mib()
        assert before > 55, before  # the ring's pages were written
        worker.close()
        trainer.close()
        after = allocated_mib()
        assert after < 1, (before, after)  # the labels' pages (20 x 4 KiB), not 64 MiB
        assert all(int(k[0]) == i for i, k in enumerate(kept))  # the kept ones still read
    finally:
        os.close(probe)


@pytest.mark.parametrize("side", ["trainer", "worker"])
def test_dpex_shm_ring_0_turns_the_ring_off_so_batches_take_the_socket(side, monkeypatch):
    """For nodes where tenants share a uid (issue 25, item 19): any process of the uid can
    open a ring through /proc/<pid>/fd. DPEX_SHM_RING=0 in the trainer's environment means
    it offers no ring (the iterator's worker gets none and uses the socket); in a worker's
    (the node's Ray workers), it maps none and says why."""
    from types import SimpleNamespace

    from dpex.client._driver import EpochDriver

    ready = TrainerRing(0, 1 << 20, NODE)  # offered before the variable was set
    monkeypatch.setenv("DPEX_SHM_RING", "0")
    if side == "trainer":
        before = set(_memfds())  # (other tests' rings may still await collection)
        with pytest.raises(OSError, match="DPEX_SHM_RING=0"):
            TrainerRing(1, 1 << 20, NODE)
        driver = SimpleNamespace(
            _ring_bytes=1 << 20, _node_id=NODE,
            session=SimpleNamespace(new_ring=lambda c, n, w: TrainerRing(0, c, n, w).ref))
        assert EpochDriver.new_ring(driver, 0) is None
        assert not [link for link in set(_memfds()) - before if "dpex-ring" in link]
    else:
        with pytest.raises(RingUnavailable, match="DPEX_SHM_RING=0"):
            WorkerRing(ready.ref, NODE)
    monkeypatch.setenv("DPEX_SHM_RING", "1")
    WorkerRing(ready.ref, NODE).close()  # any other value leaves them on
    ready.close()
