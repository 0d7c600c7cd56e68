import random

import pytest

from dpex.client._ordering import DuplicateSequenceError, OrderingBuffer


def drain(buf):
    out = []
    while (item := buf.pop()) is not None:
        out.append(item)
    return out


def test_scrambled_arrivals_leave_in_order():
    rng = random.Random(7)
    buf = OrderingBuffer()
    seqs = list(range(200))
    rng.shuffle(seqs)
    released = []
    for s in seqs:
        assert buf.put(s, f"b{s}")
        released += drain(buf)
    assert released == [(s, f"b{s}") for s in range(200)]
    assert len(buf) == 0 and buf.next_seq == 200


def test_nothing_released_until_the_next_slot_arrives():
    buf = OrderingBuffer()
    buf.put(1, "one")
    assert buf.pop() is None
    buf.put(0, "zero")
    assert drain(buf) == [(0, "zero"), (1, "one")]


def test_duplicate_while_held_is_an_error():
    buf = OrderingBuffer()
    buf.put(3, "x")
    with pytest.raises(DuplicateSequenceError):
        buf.put(3, "y")


def test_late_duplicate_of_a_consumed_slot_is_dropped():
    buf = OrderingBuffer()
    buf.put(0, "a")
    assert buf.pop() == (0, "a")
    assert buf.put(0, "again") is False
    assert buf.pop() is None


def test_error_takes_its_own_slot():
    buf = OrderingBuffer()
    err = ValueError("boom")
    buf.put(2, "c"), buf.put(1, err), buf.put(0, "a")
    assert [item for _, item in drain(buf)] == ["a", err, "c"]


def test_skip_passes_over_an_empty_slot_and_drops_its_late_item():
    buf = OrderingBuffer()
    buf.put(1, "b")
    buf.skip(0)
    assert buf.pop() == (1, "b")
    assert buf.put(0, "late") is False


def test_out_of_order_mode_releases_arrivals_but_prefers_next_seq():
    buf = OrderingBuffer(in_order=False)
    buf.put(2, "c"), buf.put(1, "b")
    assert buf.pop() == (2, "c")
    buf.put(0, "a")
    assert buf.pop() == (0, "a")
    assert buf.pop() == (1, "b")
    assert buf.next_seq == 3
    assert buf.put(2, "dup") is False


def test_reset_starts_again_at_zero():
    buf = OrderingBuffer()
    buf.put(0, "a"), buf.pop(), buf.put(5, "f")
    buf.reset()
    assert buf.next_seq == 0 and len(buf) == 0
    assert buf.put(0, "new")
