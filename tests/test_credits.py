import pytest

from dpex.client._credits import CreditWindow


def test_invariant_holds_through_acquire_and_release():
    w = CreditWindow(3)
    taken = [w.acquire() for _ in range(5)]
    assert taken == [True, True, True, False, False]
    assert (w.available, w.in_flight) == (0, 3)
    w.release()
    assert w.available + w.in_flight == w.capacity == 3
    assert w.acquire() and not w.acquire()


def test_release_without_credit_in_flight_is_an_error():
    w = CreditWindow(1)
    with pytest.raises(RuntimeError, match="none in flight"):
        w.release()


def test_reset_returns_every_credit():
    w = CreditWindow(2)
    w.acquire(), w.acquire()
    w.reset()
    assert w.available == 2


@pytest.mark.parametrize("capacity", [0, -1])
def test_capacity_must_be_positive(capacity):
    with pytest.raises(ValueError, match="capacity"):
        CreditWindow(capacity)
