"""One contract for every transport, without Ray or sockets.

The socket path (the batch's buffers are the message's frames), the shared-memory
ring and the in-memory fake carry a batch the same way; and the scheduler, driving
real TaskRunners (torch's worker loop) through any of them, delivers torch's epoch.
"""

import collections
import gc
import pickle
import random

import cloudpickle
import numpy as np
import pytest
import torch
from torch.utils.data import DataLoader, _DatasetKind
from torch.utils.data._utils.collate import default_collate

from dpex._codec import decode_batch
from dpex._protocol import Kind, Wire
from dpex._security import SessionKeys
from dpex._shm import TrainerRing, WorkerRing
from dpex._spec import Parcel, ShippedLoader, WorkerSpec
from dpex._transport import SOCKET, MemoryTransport, Receiver, RingTransport, encode_data
from dpex.client._scheduler import EPOCH_END, EpochScheduler, SendTasks
from dpex.errors import ProtocolError
from dpex.server._task_runner import TaskRunner

WIRE = Wire.new()
NODE = "node-a"


class Transports:
    """A worker's sending transport for each worker id, and the trainer's receiver."""

    def __init__(self, name: str, workers: int = 1) -> None:
        self.name, self.trainer_rings, self.worker_rings = name, {}, []
        if name == "socket":
            self.senders, receiving = [SOCKET] * workers, [SOCKET]
        elif name == "memory":
            fake = MemoryTransport()
            self.senders, receiving = [fake] * workers, [SOCKET, fake]
        else:
            for w in range(workers):
                self.trainer_rings[w] = TrainerRing(w, 32 << 20, NODE, worker_id=w)
                self.worker_rings.append(WorkerRing(self.trainer_rings[w].ref, NODE))
            self.senders = [RingTransport(sender=r) for r in self.worker_rings]
            receiving = [SOCKET, RingTransport(rings=self.trainer_rings)]
        self.receiver = Receiver(WIRE, receiving)

    def close(self) -> None:
        for ring in self.worker_rings:
            ring.close()
        for ring in self.trainer_rings.values():
            ring.close()


@pytest.fixture(params=["socket", "ring", "memory"])
def transports(request):
    made = []

    def make(workers: int = 1) -> Transports:
        made.append(Transports(request.param, workers))
        return made[-1]

    yield make
    for t in made:
        t.close()
    gc.collect()  # batches that view a ring keep its memfd until they are garbage


def a_batch():
    return {"image": torch.arange(300_000, dtype=torch.float32).reshape(100, 3000),  # > 64 kB
            "label": torch.tensor([1, 2, 3]), "mask": np.ones(5, dtype=bool), "name": "x"}


def test_a_batch_crosses_intact_and_says_how_it_came(transports):
    t = transports()
    frames = encode_data(WIRE, 1, 7, 0, a_batch(), t.senders[0])
    msg = t.receiver.decode([bytes(f) for f in frames])
    assert (msg.kind, msg.epoch, msg.seq, msg.worker_id) == (Kind.BATCH, 1, 7, 0)
    want = a_batch()
    assert torch.equal(msg.payload["image"], want["image"])
    assert torch.equal(msg.payload["label"], want["label"])
    assert np.array_equal(msg.payload["mask"], want["mask"]) and msg.payload["name"] == "x"
    assert msg.in_ring is (t.name != "socket")  # through memory the socket never saw


def test_what_the_transport_describes_is_under_the_mac(transports):
    t = transports()
    frames = [bytearray(bytes(f)) for f in encode_data(WIRE, 1, 0, 0, a_batch(), t.senders[0])]
    frames[2][0] ^= 1  # the descriptor's first byte (the structure's, for the socket)
    with pytest.raises(ProtocolError) as err:
        t.receiver.decode(frames)
    assert err.value.reason == "mac"


def test_a_transport_the_trainer_does_not_have_is_refused(transports):
    t = transports()
    frames = encode_data(WIRE, 1, 0, 0, a_batch(), t.senders[0])
    only_socket = Receiver(WIRE)
    if t.name == "socket":
        assert only_socket.decode(frames).kind is Kind.BATCH
        return
    with pytest.raises(ProtocolError) as err:
        only_socket.decode(frames)
    assert err.value.reason == "kind"


class OnlyHere:  # pickled by reference; the trainer below cannot import it
    pass


def test_a_batch_that_does_not_rebuild_is_an_error_in_its_slot(transports, monkeypatch):
    t = transports()
    frames = encode_data(WIRE, 2, 9, 0, {"x": torch.zeros(3), "o": OnlyHere()}, t.senders[0])
    monkeypatch.delattr(__import__(__name__), "OnlyHere")
    msg = t.receiver.decode(frames)
    assert (msg.kind, msg.seq) == (Kind.ERROR, 9)
    with pytest.raises(RuntimeError, match="the batch of batch 9 could not be rebuilt"):
        msg.payload.reraise()


def test_control_messages_never_pass_for_data_and_data_never_for_control(transports):
    t = transports()
    with pytest.raises(ProtocolError) as err:
        t.receiver.decode(WIRE.encode(Kind.TASKS, 1, 0, 0, [(0, [1])]))
    assert err.value.reason == "kind"
    with pytest.raises(ProtocolError) as err:
        WIRE.decode(encode_data(WIRE, 1, 0, 0, a_batch(), t.senders[0]))
    assert err.value.reason == "kind"


def test_the_fake_hands_over_by_reference_and_forgets_what_is_released():
    fake = MemoryTransport()
    receiver = Receiver(WIRE, [fake])
    image = torch.zeros(1000)
    frames = encode_data(WIRE, 1, 0, 0, image, fake)
    assert len(frames) == 3 and fake.parked == 1  # no buffer frames: parked in memory
    assert torch.equal(receiver.decode(frames).payload, image) and fake.parked == 0
    dropped = encode_data(WIRE, 1, 1, 0, image, fake)
    fake.release(0, memoryview(dropped[2]))
    assert fake.parked == 0
    msg = receiver.decode(dropped)  # its buffers are gone: an error in its slot, no hang
    assert msg.kind is Kind.ERROR and "memory descriptor" in msg.payload.exc_msg


# -- the scheduler over each transport, with torch's worker loop -----------------------

class Squares(torch.utils.data.Dataset):
    def __len__(self):
        return 45

    def __getitem__(self, i):
        return torch.full((40_000,), float(i * i)), i  # 160 kB: the ring copies it in


def run_epochs(t: Transports, loader: DataLoader, workers: int, epochs: int, seed: int,
               torch_seed: int):
    """Drive EpochScheduler with in-process TaskRunners over ``t``; the workers'
    results interleave at random (nothing is lost). The
    loader's sampler draws from torch's global RNG seeded with ``torch_seed`` after
    the runners seeded theirs (in this one process)."""
    rng = random.Random(seed)
    shipped = cloudpickle.dumps(ShippedLoader(
        dataset=loader.dataset, dataset_kind=_DatasetKind.Map, auto_collation=True,
        collate_fn=default_collate, drop_last=False, worker_init_fn=None))
    keys = SessionKeys.new().client
    runners = [TaskRunner(WorkerSpec(wire=WIRE, worker_id=w, num_workers=workers, base_seed=3,
                                     data_address="", control_address="", keys=keys),
                          Parcel(shipped), transport=t.senders[w]) for w in range(workers)]
    torch.manual_seed(torch_seed)
    sched = EpochScheduler(workers, 2)
    for w in range(workers):
        sched.ready(w, {})
    out, shared = [], 0
    for _ in range(epochs):
        queued: dict[int, collections.deque] = collections.defaultdict(collections.deque)
        draw = iter(loader)._next_index  # torch's own iterator draws, as dpex's does

        def apply(actions, queued=queued):
            for a in actions:
                if isinstance(a, SendTasks):
                    queued[a.worker_id].extend((a.epoch, seq, idx) for seq, idx in a.tasks)

        apply(sched.start_epoch(draw))
        epoch = []
        while True:
            got, actions = sched.take(draw)
            apply(actions)
            if got is EPOCH_END:
                break
            if got is not None:
                epoch.append(got.payload)
                continue
            busy = [w for w in queued if queued[w]]
            w = rng.choice(busy)
            # A worker's results arrive in its order (one connection); the workers'
            # interleave at random.
            done = [queued[w].popleft() for _ in range(rng.randint(1, len(queued[w])))]
            msgs = [t.receiver.decode(runners[w].run_task(*task)) for task in done]
            shared += sum(m.in_ring for m in msgs)
            apply(sched.results(msgs))
        out.append(epoch)
    return out, shared


@pytest.mark.parametrize("workers", [1, 3])
def test_the_scheduler_over_any_transport_delivers_torchs_epochs(transports, workers):
    t = transports(workers)
    torch.manual_seed(4)
    theirs = [list(DataLoader(Squares(), batch_size=4, shuffle=True)) for _ in range(2)]
    loader = DataLoader(Squares(), batch_size=4, shuffle=True)
    ours, shared = run_epochs(t, loader, workers, 2, seed=workers, torch_seed=4)
    assert len(ours) == 2 and [len(e) for e in ours] == [12, 12]
    for mine, want in zip(ours, theirs, strict=True):
        for (x, i), (wx, wi) in zip(mine, want, strict=True):
            assert torch.equal(x, wx) and torch.equal(i, wi)
    # Every batch came the transport's way (the ring had room for all of them).
    assert shared == (0 if t.name == "socket" else 24)


def test_the_contract_names_every_transport_the_trainer_receives():
    """A new transport must join the contract above: every data kind of the protocol
    has one here."""
    from dpex._protocol import DATA_KINDS

    covered = {SOCKET.kind, RingTransport.kind, MemoryTransport.kind}
    assert covered == set(DATA_KINDS) - {Kind.ERROR, Kind.END}
    assert pickle.loads(pickle.dumps(Kind.MEMORY_BATCH)) is Kind.MEMORY_BATCH


def test_a_batch_received_over_a_socket_is_the_frame_itself_not_a_copy():
    """The trainer spends no copy on a socket batch: its tensors view the frames libzmq
    received (memory of their own, writable, freed with the tensors); an unaligned
    frame, which a view cannot serve, is copied."""
    import zmq

    ctx = zmq.Context()
    pull, push = ctx.socket(zmq.PULL), ctx.socket(zmq.PUSH)
    try:
        for s in (pull, push):
            s.setsockopt(zmq.LINGER, 0)
        push.connect(f"tcp://127.0.0.1:{pull.bind_to_random_port('tcp://127.0.0.1')}")
        batch = {"x": torch.arange(50_000, dtype=torch.float32), "y": np.arange(9_000.0)}
        push.send_multipart(encode_data(WIRE, 1, 0, 0, batch), copy=False)
        assert pull.poll(5000)
        frames = pull.recv_multipart(copy=False)
        x_frame = np.frombuffer(frames[3], dtype=np.uint8)
        got = Receiver(WIRE).decode(frames).payload
        assert got["x"].data_ptr() == x_frame.ctypes.data  # the frame, not a copy
        assert np.shares_memory(got["y"], np.frombuffer(frames[4], dtype=np.uint8))
        del frames, x_frame
        gc.collect()
        got["x"].add_(1)  # writable, and still valid once the frame objects are gone
        assert torch.equal(got["x"], torch.arange(1, 50_001, dtype=torch.float32))
        assert np.array_equal(got["y"], np.arange(9_000.0))
    finally:
        ctx.destroy(0)
    odd = np.frombuffer(bytearray(9), dtype=np.uint8)[1:]  # 8 bytes at an odd address
    t = decode_batch(*_structure_and(torch.tensor([2.5, 3.5])), [odd])
    assert t.dtype is torch.float32 and t.data_ptr() % 4 == 0  # copied into aligned memory


def _structure_and(tensor: torch.Tensor) -> tuple:
    from dpex._codec import encode_batch

    structure, *_ = encode_batch(tensor)
    return (bytes(structure),)
