"""RESUME and SKIP lost with a connection are made good by the next TASKS message (issue
25, item 15): the pure rules on both ends, and the worker's control reader over a real
socket pair."""

import asyncio

import pytest
from control_reader import control_reader

from dpex._epoch_marks import AppliedMarks, SentMarks
from dpex._protocol import Kind, Wire
from dpex.server._session import _RESUME, _SKIP

pytestmark = pytest.mark.timeout(60)


def test_the_trainer_repeats_this_epochs_marks_and_forgets_them_for_a_new_incarnation():
    sent = SentMarks()
    assert sent.of(0) is None
    sent.resume(0, 2, "seed")
    sent.skip(0, 2, 5)
    assert sent.of(0) == {"resume": (2, "seed"), "skip": (2, 5)}
    sent.resume(0, 3, None)  # a new epoch starts the marks anew
    assert sent.of(0) == {"resume": (3, None)}
    sent.replaced(0)
    assert sent.of(0) is None


def test_the_worker_applies_each_mark_once_however_it_came():
    marks = AppliedMarks()
    assert marks.resume(2) and not marks.resume(2) and not marks.resume(1)
    assert marks.skip(2, 5) and not marks.skip(2, 5) and not marks.skip(1, 3)
    assert marks.repair({"resume": (2, "s"), "skip": (2, 5)}) == []  # both came before
    assert marks.repair({"resume": (3, "t"), "skip": (3, 4)}) == [("resume", "t", 3),
                                                                  ("skip", 4, 3)]
    assert marks.repaired == 2 and marks.repair(None) == []


def test_a_skip_that_came_before_its_lost_resume_is_applied_again_after_it():
    """RESUME(2) lost, SKIP(2) came: it passed over the previous epoch's shard, which
    the repaired RESUME then replaces; the shard of epoch 2 must be passed over too."""
    marks = AppliedMarks()
    assert marks.skip(2, 5)  # (applied to the shard the worker had: epoch 1's)
    assert marks.repair({"resume": (2, "s"), "skip": (2, 5)}) == [("resume", "s", 2),
                                                                  ("skip", 5, 2)]
    assert marks.repair({"resume": (2, "s"), "skip": (2, 5)}) == []  # (once)


@pytest.mark.asyncio
async def test_a_lost_resume_and_skip_are_applied_before_the_tasks_that_need_them():
    """Before: a TASKS message carried tasks only; with the RESUME and SKIP lost (a
    connection that broke with them queued), the worker ran epoch 2's tasks on epoch 1's
    shard, unskipped, and nobody knew."""
    wire = Wire(b"s" * 16, b"k" * 32)
    async with control_reader(wire) as (router, inbox, session):
        sent = SentMarks()
        sent.resume(0, 2, "seed-2")  # RESUME (control seq 0) and SKIP (1) were lost
        sent.skip(0, 2, 3)
        for seq, task in ((2, (0, [None])), (3, (1, [None]))):
            await router.send_multipart([b"w", *wire.encode(
                Kind.TASKS, 2, seq, 0, ([task], sent.of(0)))])
        got = [await asyncio.to_thread(inbox.get, timeout=5) for _ in range(4)]
        assert got == [(_RESUME, "seed-2", 2), (_SKIP, 3, 2), (2, 0, [None]), (2, 1, [None])]
        assert session.epoch_floor == 2 and session.marks.repaired == 2
        await asyncio.sleep(0.2)
        assert inbox.empty()  # the second TASKS message repeated nothing
