"""A worker's view of one session without sockets or Ray: torch's worker loop."""

import time

import cloudpickle
import torch
from torch.utils.data import IterableDataset, _DatasetKind
from torch.utils.data._utils.collate import default_collate

from dpex._protocol import Kind, Wire
from dpex._security import SessionKeys
from dpex._spec import Parcel, ShippedLoader, WorkerSpec
from dpex._transport import Receiver
from dpex.server._task_runner import TaskRunner

WIRE = Wire.new()


class Count(IterableDataset):
    def __iter__(self):
        return iter(range(8))


def replacement(dataset=None) -> TaskRunner:
    """Incarnation 1 of worker 0 of a persistent IterableDataset loader (batch size 2)."""
    shipped = cloudpickle.dumps(ShippedLoader(
        dataset=dataset or Count(), dataset_kind=_DatasetKind.Iterable, auto_collation=True,
        collate_fn=default_collate, drop_last=False, worker_init_fn=None))
    spec = WorkerSpec(wire=WIRE, worker_id=0, num_workers=1, base_seed=1,
                      data_address="", control_address="", keys=SessionKeys.new().client,
                      incarnation=1)
    return TaskRunner(spec, Parcel(shipped))


def batch(state: TaskRunner, epoch: int, seq: int):
    msg = Receiver(WIRE).decode(state.run_task(epoch, seq, [None, None]))
    assert msg.kind is Kind.BATCH, msg
    return msg.payload.tolist()


def test_a_skip_fast_forwards_its_own_epoch_only():
    state = replacement()
    state.skip(2, epoch=1)  # the predecessor delivered [0, 1] and [2, 3]
    assert batch(state, 1, 2) == [4, 5]


def test_a_pending_skip_does_not_carry_into_the_next_epoch():
    # The replacement was told to skip 3 batches of epoch 1 but got no task of epoch 1
    # (the user broke out of the epoch, or the shard had ended): epoch 2 starts at 0.
    state = replacement()
    state.skip(3, epoch=1)
    state.resume(epoch=2)
    assert batch(state, 2, 0) == [0, 1]


def test_a_skip_of_an_earlier_epoch_arriving_late_is_ignored():
    state = replacement()
    state.resume(epoch=2)
    state.skip(3, epoch=1)
    assert batch(state, 2, 0) == [0, 1]
    assert torch.equal(torch.tensor(batch(state, 2, 1)), torch.tensor([2, 3]))


class Loud(torch.utils.data.Dataset):
    """Item 3 raises an error whose message alone is 3 MiB."""

    def __len__(self):
        return 8

    def __getitem__(self, i):
        if i == 3:
            raise ValueError("start " + "x" * (3 << 20) + " end")
        return i


def test_an_error_over_max_message_bytes_still_reaches_the_trainer_as_an_error():
    wire = Wire.new(max_message_bytes=1 << 20)
    shipped = cloudpickle.dumps(ShippedLoader(
        dataset=Loud(), dataset_kind=_DatasetKind.Map, auto_collation=True,
        collate_fn=default_collate, drop_last=False, worker_init_fn=None))
    spec = WorkerSpec(wire=wire, worker_id=0, num_workers=1, base_seed=1, data_address="",
                      control_address="", keys=SessionKeys.new().client)
    msg = Receiver(wire).decode(TaskRunner(spec, Parcel(shipped)).run_task(1, 0, [2, 3]))  # not dropped
    assert msg.kind is Kind.ERROR and msg.payload.exc_type is ValueError
    text = msg.payload.exc_msg
    assert "ValueError: start xxx" in text and text.rstrip().endswith("end")
    assert "characters of this error message cut" in text and "max_message_bytes" in text


def test_the_rng_recorder_takes_numpys_state_exactly_even_when_it_skips_the_slow_call():
    import numpy as np

    from dpex.server._rng import RngRecorder, restore_rng

    def full():
        kind, keys, pos, has_gauss, cached = np.random.get_state()
        return (kind, keys.tobytes(), int(pos), int(has_gauss), float(cached))

    def draw(step):
        value = step()
        return None if value is None else float(value)

    np.random.seed(3)
    recorder = RngRecorder()
    # Draws between captures: none (the slow call is skipped), uniform, a first normal
    # (caches its twin), a second normal (uses the cache: the generator's words do not
    # change, only the cache flag), and so on.
    steps = [lambda: None, np.random.rand, np.random.randn, np.random.randn, lambda: None,
             np.random.randn, lambda: None, np.random.rand, np.random.randn]
    taken, drawn = [], []
    for step in steps:
        drawn.append(draw(step))
        state = recorder.capture()
        kind, keys, pos, has_gauss, cached = state["numpy"]
        assert (kind, keys.numpy().tobytes(), pos, has_gauss, cached) == full()
        taken.append(state)
    assert recorder._fast  # the words were read in place: the fast path ran
    for i, state in enumerate(taken[:-1]):  # a resumed worker draws what the first drew
        restore_rng(state)
        assert [draw(step) for step in steps[i + 1:]] == drawn[i + 1:], i


def test_the_rng_log_keeps_the_newest_states_and_its_epochs_start():
    from dpex.server._rng import RngLog

    log = RngLog(keep=2)
    log.epoch_began(1, {"at": "start"})
    for seq in range(4):
        log.task_done(1, seq, {"at": seq})
    assert log.after(1, -1) == {"at": "start"} and log.after(2, -1) is None
    assert [log.after(1, seq) for seq in range(4)] == [None, None, {"at": 2}, {"at": 3}]


class Sleepy(torch.utils.data.Dataset):
    def __len__(self):
        return 8

    def __getitem__(self, i):
        time.sleep(0.01)
        return i


def test_a_batch_says_how_long_its_worker_worked_on_it():
    wire = Wire.new()
    shipped = cloudpickle.dumps(ShippedLoader(
        dataset=Sleepy(), dataset_kind=_DatasetKind.Map, auto_collation=True,
        collate_fn=default_collate, drop_last=False, worker_init_fn=None))
    spec = WorkerSpec(wire=wire, worker_id=0, num_workers=1, base_seed=1, data_address="",
                      control_address="", keys=SessionKeys.new().client)
    runner = TaskRunner(spec, Parcel(shipped))
    time.sleep(0.05)  # (idle time before the task is none of its time)
    msg = Receiver(wire).decode(runner.run_task(1, 0, [2, 3]))
    assert msg.kind is Kind.BATCH and 20_000 <= msg.took_us < 50_000
