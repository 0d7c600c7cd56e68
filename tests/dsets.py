"""Datasets and helpers shared by the integration tests (shipped to workers by value)."""

from __future__ import annotations

import io
import json
import os
import random
import signal
import struct
import threading
import time

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset, IterableDataset, Sampler, get_worker_info


def jitter(max_s: float) -> None:
    """Sleep a random time drawn from the OS, not from the seeded RNGs users see."""
    if max_s > 0:
        time.sleep(os.urandom(1)[0] / 255 * max_s)


class Squares(Dataset):
    """Map-style: item i is (tensor([i, i*i]), i); random sleeps scramble arrival order."""

    def __init__(self, n: int = 50, max_sleep: float = 0.003) -> None:
        self.n, self.max_sleep = n, max_sleep

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        jitter(self.max_sleep)
        return torch.tensor([i, i * i], dtype=torch.float32), i


class BatchedSquares(Squares):
    """Has ``__getitems__``: returns a whole batch at once, marked as such."""

    def __getitems__(self, indices):
        jitter(self.max_sleep)
        return [(torch.tensor([i, -i]), "batched") for i in indices]


class SeedProbe(Dataset):
    """Reports what the worker sees: worker info, torch / random / numpy draws."""

    def __len__(self) -> int:
        return 24

    def __getitem__(self, i: int):
        info = get_worker_info()
        return {
            "i": i,
            "worker": -1 if info is None else info.id,
            "num_workers": -1 if info is None else info.num_workers,
            "seed": -1 if info is None else info.seed,
            "initial_seed": torch.initial_seed(),
            "same_dataset": info is not None and info.dataset is self,
            "torch": torch.rand(1),
            "random": random.random(),
            "numpy": float(np.random.rand()),
            "init_marker": os.environ.get("DPEX_TEST_INIT", ""),
        }


class Augmented(Dataset):
    """A random augmentation per sample, drawn from torch, ``random`` and NumPy's global
    RNGs (what transforms use): the batch depends on where the worker's RNG stands."""

    def __init__(self, n: int = 40, max_sleep: float = 0.002) -> None:
        self.n, self.max_sleep = n, max_sleep

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        jitter(self.max_sleep)
        return {"i": i, "crop": torch.randint(0, 100, (2,)), "flip": random.random() < 0.5,
                "noise": float(np.random.normal())}


def mark_init(worker_id: int) -> None:
    os.environ["DPEX_TEST_INIT"] = os.environ.get("DPEX_TEST_INIT", "") + f"{worker_id},"


def failing_init(worker_id: int) -> None:
    raise ZeroDivisionError(f"init of {worker_id} failed")


class ShardedRange(IterableDataset):
    """IterableDataset: worker k yields k, k+w, ... below n; worker 0 has extra items."""

    def __init__(self, n: int = 37, extra_for_worker0: int = 5, max_sleep: float = 0.003):
        self.n, self.extra, self.max_sleep = n, extra_for_worker0, max_sleep

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        for i in range(wid, self.n, nw):
            jitter(self.max_sleep)
            yield torch.tensor([i, wid])
        if wid == 0:
            for j in range(self.extra):
                yield torch.tensor([1000 + j, 0])

    def __len__(self) -> int:
        return self.n + self.extra


class FailsAt(Dataset):
    """Raises ValueError for index ``bad``."""

    def __init__(self, bad: int, n: int = 20) -> None:
        self.bad, self.n = bad, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.bad:
            raise ValueError(f"bad index {i}")
        return torch.tensor(i)


class Slow(Dataset):
    def __init__(self, delay: float, n: int = 8) -> None:
        self.delay, self.n = delay, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        time.sleep(self.delay)
        return torch.tensor(i)


class HangsFrom(Dataset):
    """Items from index ``first`` on take ``hold`` seconds each (a hung dataset)."""

    def __init__(self, first: int, hold: float, n: int = 24) -> None:
        self.first, self.hold, self.n = first, hold, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i >= self.first:
            time.sleep(self.hold)
        return torch.tensor(i)


class Images(Dataset):
    """~9.2 MiB uint8 image batches at batch_size 64 (3x224x224 per item)."""

    def __init__(self, n: int = 192) -> None:
        self.n = n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        return torch.randint(0, 256, (3, 224, 224), dtype=torch.uint8, generator=g), i


class Mixed(Dataset):
    """Items with a float image, a float64 ndarray, a label and a string; use
    ``mixed_collate`` to keep the ndarrays as ndarrays."""

    def __init__(self, n: int = 96, side: int = 32) -> None:
        self.n, self.side = n, side

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        g = torch.Generator().manual_seed(i)
        img = torch.randn(3, self.side, self.side, generator=g)
        return {"img": img, "arr": np.full(16, i / 7.0), "label": i, "name": f"item{i}"}


def mixed_collate(items):
    from torch.utils.data import default_collate

    batch = default_collate([{k: v for k, v in it.items() if k != "arr"} for it in items])
    batch["arr"] = np.stack([it["arr"] for it in items])
    return batch


class ReversedSampler(Sampler):
    def __init__(self, n):
        self.n = n

    def __iter__(self):
        return iter(range(self.n - 1, -1, -1))

    def __len__(self):
        return self.n


def sum_collate(items):
    return {"sum": torch.stack([x for x, _ in items]).sum(0), "ids": [i for _, i in items]}


class CountingBatchSampler(Sampler):
    """Counts what the trainer drew; infinite when ``n`` is None."""

    def __init__(self, n=None, batch_size=2):
        self.n, self.batch_size, self.drawn = n, batch_size, 0

    def __iter__(self):
        i = 0
        while self.n is None or i < self.n:
            self.drawn += 1
            yield [i * self.batch_size + k for k in range(self.batch_size)]
            i += 1


def torch_loader(*args, **kwargs) -> DataLoader:
    """torch's DataLoader as a reference. Its workers start by forkserver: forking a
    process connected to Ray breaks Ray's client in the parent (a Ray limitation)."""
    if kwargs.get("num_workers", 0) > 0:
        kwargs.setdefault("multiprocessing_context", "forkserver")
    return DataLoader(*args, **kwargs)


def round_trip(state):
    """What a checkpoint gives back: ``torch.save`` (pickle protocol 3: a bytes object
    would not survive otherwise), then ``torch.load(weights_only=True)``."""
    buf = io.BytesIO()
    torch.save(state, buf, pickle_protocol=3)
    buf.seek(0)
    return torch.load(buf, weights_only=True)


def json_trip(state):
    """What a JSON checkpoint gives back: ``json.loads(json.dumps(state))``."""
    return json.loads(json.dumps(state))


def assert_same(a, b, path: str = "batch") -> None:
    assert type(a) is type(b), f"{path}: {type(a)} != {type(b)}"
    if isinstance(a, torch.Tensor):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{tuple(a.shape)} != {b.dtype}{tuple(b.shape)}"
        assert torch.equal(a, b), f"{path}: values differ"
    elif isinstance(a, np.ndarray):
        assert a.dtype == b.dtype and a.shape == b.shape, f"{path}: {a.dtype}{a.shape}"
        assert np.array_equal(a, b), f"{path}: values differ"
    elif isinstance(a, dict):
        assert a.keys() == b.keys(), path
        for k in a:
            assert_same(a[k], b[k], f"{path}[{k!r}]")
    elif isinstance(a, (list, tuple)):
        assert len(a) == len(b), f"{path}: length {len(a)} != {len(b)}"
        for i, (x, y) in enumerate(zip(a, b, strict=True)):
            assert_same(x, y, f"{path}[{i}]")
    else:
        assert a == b, f"{path}: {a!r} != {b!r}"


def epochs(loader, n: int = 1) -> list[list]:
    return [list(loader) for _ in range(n)]


def live_workers() -> list[dict]:
    """The dpex worker actors of the Ray cluster that are not dead yet."""
    import ray

    table = ray._private.state.state.actor_table(None)
    return [info for info in table.values()
            if info.get("ActorClassName") == "DpexWorker" and info.get("State") != "DEAD"]


def busy_workers() -> list[dict]:
    """Live dpex worker actors that are not idle in this process's warm pool."""
    from dpex.client._warm import POOL

    kept = POOL.actor_ids()
    return [w for w in live_workers() if w.get("ActorID") not in kept]


def wait_released(pids, limit: float = 10.0) -> list[int]:
    """Wait until each worker process in ``pids`` ended or is idle in this process's warm
    pool (its session over); return those still busy."""
    from dpex.client._warm import POOL

    deadline = time.monotonic() + limit
    POOL.wait_settled(limit)
    while True:
        busy = [pid for pid in pids_alive(pids)
                if pid in {w.get("Pid") for w in busy_workers()}]
        if not busy or time.monotonic() > deadline:
            return busy
        time.sleep(0.1)


def wait_no_workers(limit: float = 30.0) -> None:
    """Wait until every dpex worker actor is dead or idle in this process's warm pool
    (which has checked that it serves no session and runs no compute thread) and no
    worker group of this process is live: actors killed by earlier tests die
    asynchronously."""
    from dpex.client._warm import POOL
    from dpex.client._workers import live_groups

    deadline = time.monotonic() + limit
    POOL.wait_settled(limit)
    while busy_workers() or live_groups():
        if time.monotonic() > deadline:
            raise TimeoutError(f"dpex workers still alive after {limit} s: "
                               f"{[w.get('Pid') for w in busy_workers()]}, "
                               f"{len(live_groups())} live worker groups")
        time.sleep(0.1)


def wait_gone(pids, limit: float = 10.0) -> list[int]:
    """Wait until none of ``pids`` lives, at most ``limit`` s; return those still alive."""
    deadline = time.monotonic() + limit
    while pids_alive(pids) and time.monotonic() < deadline:
        time.sleep(0.05)
    return pids_alive(pids)


def descendants(pid: int) -> list[int]:
    """Every process under ``pid`` (its children, theirs, ...), from /proc."""
    parents: dict[int, list[int]] = {}
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                with open(f"/proc/{name}/stat") as f:
                    ppid = int(f.read().rsplit(")", 1)[1].split()[1])
            except (OSError, IndexError, ValueError):
                continue  # gone meanwhile
            parents.setdefault(ppid, []).append(int(name))
    found, todo = [], [pid]
    while todo:
        for child in parents.get(todo.pop(), []):
            found.append(child)
            todo.append(child)
    return found


def pids_alive(pids) -> list[int]:
    alive = []
    for pid in pids:
        try:
            os.kill(pid, 0)
        except ProcessLookupError:
            continue
        alive.append(pid)
    return alive


class HangsInWorker0(Dataset):
    """Worker 0 hangs (``hold`` s) on item ``at``; any other worker computes it at once."""

    def __init__(self, at: int, hold: float = 600.0, n: int = 40) -> None:
        self.at, self.hold, self.n = at, hold, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if i == self.at and get_worker_info().id == 0:
            time.sleep(self.hold)
        time.sleep(0.01)
        return torch.tensor(i)


class StopsWorker0(HangsInWorker0):
    """Worker 0 stops its own process (SIGSTOP: every thread, as a debugger or an
    operator's ``kill -STOP`` would) on item ``at``; any other worker computes it."""

    def __getitem__(self, i: int):
        if i == self.at and get_worker_info().id == 0:
            os.kill(os.getpid(), signal.SIGSTOP)
        time.sleep(0.01)
        return torch.tensor(i)


class BlocksWorker0(Dataset):
    """Worker 0's items wait until ``flag`` exists (60 s at most); other workers are fast."""

    def __init__(self, flag: str, n: int = 40) -> None:
        self.flag, self.n = flag, n

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        if get_worker_info().id == 0:
            deadline = time.monotonic() + 60
            while not os.path.exists(self.flag) and time.monotonic() < deadline:
                time.sleep(0.01)
        return torch.tensor(i)


def init_fails_for_worker0(worker_id: int) -> None:
    if worker_id == 0:
        raise ZeroDivisionError("init of worker 0 failed")


class SleepyInit:
    """A worker_init_fn that takes ``seconds``."""

    def __init__(self, seconds: float) -> None:
        self.seconds = seconds

    def __call__(self, worker_id: int) -> None:
        time.sleep(self.seconds)


def outcomes(loader, n_epochs: int = 1) -> list[list]:
    """Every ``next()`` of each epoch: the batch, or the type name and text of what it raised."""
    result = []
    for _ in range(n_epochs):
        it, epoch = iter(loader), []
        while True:
            try:
                epoch.append(next(it))
            except StopIteration:
                break
            except Exception as exc:
                # torch's first line, without the part dpex adds: " (dpex worker on node ...)".
                line = str(exc).split("\n")[0].split(" (dpex worker")[0].rstrip(".")
                epoch.append((type(exc).__name__, line))
        result.append(epoch)
    return result


class NoisySquares(Squares):
    """Squares plus one torch draw per item: equal only if worker seeds are equal too."""

    def __getitem__(self, i: int):
        x, i = super().__getitem__(i)
        return x, i, torch.randint(0, 1 << 30, ())


def big_for_batch_1(items):
    """Collate: the batch holding index 2 carries 1 MiB, the others a few bytes."""
    batch = torch.utils.data.default_collate(items)
    if 2 in batch[1].tolist():
        return batch[0], torch.zeros(1 << 18)
    return batch[0], torch.zeros(1)


class OnDevice(Squares):
    """Returns tensors on a device ("meta" stands in for CUDA on a machine without one)."""

    def __getitem__(self, i: int):
        return torch.empty(2, device="meta")


def lossy(worker_id: int, victim: int, seqs: tuple[int, ...], once: str = "") -> None:
    """worker_init_fn: worker ``victim`` loses the first data message of each of ``seqs``
    (with ``once``, a file path: only the first process of that worker to get here)."""
    if worker_id != victim:
        return
    if once:
        try:
            os.close(os.open(once, os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return
    import dpex.server._session as session
    from dpex._protocol import HEADER_SIZE, Kind

    data_kinds = {Kind.BATCH, Kind.RING_BATCH, Kind.ERROR, Kind.END}

    send = session.send_frames  # (what a worker's session sends every message with)
    left = set(seqs)

    def send_frames(sock, frames, *args, **kwargs):
        head = memoryview(frames[0]).tobytes() if frames else b""
        if len(head) == HEADER_SIZE:
            kind, seq = head[1], struct.unpack_from("<q", head, 22)[0]
            if kind in data_kinds and seq in left:
                left.discard(seq)
                return None  # gone on the way
        return send(sock, frames, *args, **kwargs)

    session.send_frames = send_frames


class NoisyShards(ShardedRange):
    """ShardedRange plus one draw from the worker's torch RNG per item: equal to torch's
    only if each worker's RNG stood where torch's did."""

    def __iter__(self):
        for x in super().__iter__():
            yield torch.cat([x, torch.randint(0, 1 << 20, (1,))])


class PositionedShards(ShardedRange):
    """An IterableDataset that keeps its own position (``state_dict`` /
    ``load_state_dict``, torchdata's convention): a resumed worker starts where its
    saved shard stood, drawing nothing for the items before; one torch draw per item."""

    def __init__(self, n: int = 37, extra_for_worker0: int = 5) -> None:
        super().__init__(n, extra_for_worker0, max_sleep=0.0)
        self.start = self.pos = 0

    def __iter__(self):
        info = get_worker_info()
        wid, nw = (0, 1) if info is None else (info.id, info.num_workers)
        items = list(range(wid, self.n, nw)) + (
            [1000 + j for j in range(self.extra)] if wid == 0 else [])
        start, self.start = self.start, 0
        for k in range(start, len(items)):
            self.pos = k + 1  # the next to yield, while suspended after yielding k
            yield torch.tensor([items[k], wid, int(torch.randint(0, 1 << 20, ()))])

    def state_dict(self):
        return {"pos": self.pos}

    def load_state_dict(self, state):
        self.start = state["pos"]


class RayRefs(Dataset):
    """Reads its items through Ray: an object the trainer put, and the cluster the
    worker is connected to (a dataset that reads Ray Data shards or object refs)."""

    def __init__(self, n: int = 8, hold_ref: bool = True) -> None:
        import ray

        self.n = n
        self.ref = ray.put(torch.arange(2 * n).view(n, 2)) if hold_ref else None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        import ray

        if self.ref is None:  # Ray's API only: the first call connects
            address = ray.get_runtime_context().gcs_address
            return ray.get(ray.put(torch.tensor([2 * i, 2 * i + 1])), timeout=30), address
        return ray.get(self.ref, timeout=30)[i], ray.get_runtime_context().gcs_address


class BulkyPositionedShards(PositionedShards):
    """``PositionedShards`` whose ``state_dict()`` also holds ``blob`` bytes."""

    def __init__(self, blob: int) -> None:
        super().__init__()
        self.blob = blob

    def state_dict(self):
        return {**super().state_dict(), "blob": b"x" * self.blob}


class Rows(Dataset):
    """Rows of a tensor the dataset holds in memory (``mib`` MiB of float32)."""

    def __init__(self, mib: int, width: int = 256) -> None:
        self.data = torch.arange(mib * 2**20 // 4, dtype=torch.float32).reshape(-1, width)

    def __len__(self) -> int:
        return len(self.data)

    def __getitem__(self, i: int) -> torch.Tensor:
        return self.data[i].clone()


class WhereHeld(Dataset):
    """A tensor and an array the dataset holds in memory; item ``i`` is
    ``[i, tensor's pages are the trainer's memfd, array's pages are, tensor + array
    at i]``, after writing to both (a worker's dataset is its own to change)."""

    def __init__(self, n: int = 20_000) -> None:  # (out of band: over 64 KiB each)
        import numpy as np

        self.tensor = torch.zeros(n, dtype=torch.float32)
        self.array = np.zeros(n, dtype=np.float64)
        self._where: tuple[bool, bool] | None = None  # (read once per worker)

    def __len__(self) -> int:
        return len(self.tensor)

    @staticmethod
    def _in_memfd(address: int) -> bool:
        with open("/proc/self/maps") as maps:
            for line in maps:
                lo, hi = (int(x, 16) for x in line.split()[0].split("-"))
                if lo <= address < hi:
                    return "memfd:dpex-shipment" in line
        return False

    def __getitem__(self, i: int) -> torch.Tensor:
        if self._where is None:
            self._where = (self._in_memfd(self.tensor.untyped_storage().data_ptr()),
                           self._in_memfd(self.array.ctypes.data))
        self.tensor[i] += i
        self.array[i] += 1
        return torch.tensor([i, *self._where, float(self.tensor[i]) + float(self.array[i])])


def open_memfds(name: str) -> list[str]:
    """This process's open memfds whose name contains ``name`` (their /proc links)."""
    out = []
    for fd in os.listdir("/proc/self/fd"):
        try:
            out.append(os.readlink(f"/proc/self/fd/{fd}"))
        except OSError:
            pass  # closed meanwhile
    return [link for link in out if name in link]


def private_mib(pid: int) -> float:
    """The pages only ``pid`` holds (what its exit would free), in MiB."""
    kib = 0
    with open(f"/proc/{pid}/smaps_rollup") as f:
        for line in f:
            if line.startswith(("Private_Clean:", "Private_Dirty:")):
                kib += int(line.split()[1])
    return kib / 1024


class SessionEvents:
    """What the training thread sees of a ``TrainerSession``, with a queue's face for
    tests: the handoff's events, and the batches it reads from the data socket itself
    (one list per read), in that order."""

    def __init__(self, session, handoff) -> None:
        self.session, self.handoff = session, handoff

    def put(self, item) -> None:
        self.handoff.put(item)

    def empty(self) -> bool:
        return self.handoff.empty()  # (events only: batches are read, not queued)

    def get_nowait(self):
        import queue

        try:
            return self.handoff.get_nowait()
        except queue.Empty:
            pass
        data = self.session.receive()
        if data:
            return data
        raise queue.Empty

    def get(self, timeout: float = 5.0):
        import queue

        deadline = time.monotonic() + timeout
        while True:
            try:
                return self.get_nowait()
            except queue.Empty:
                left = deadline - time.monotonic()
                if left <= 0:
                    raise
            self.session.wait(min(left, 0.1))


class Records(Dataset):
    """Fixed-size records of a file, read by seek + read through a handle the dataset
    drops in ``__getstate__`` and opens again in ``__setstate__`` (what
    DatasetNotPicklableError advises). Item ``i`` is ``[i, the record's number as read,
    whether this process opened the handle]``: two processes sharing one open file
    description move each other's offset, and read another item's record."""

    RECORD = 64

    def __init__(self, path: str, n: int = 20_000) -> None:
        self.path, self.n = path, n
        with open(path, "wb") as f:
            for i in range(n):
                f.write(struct.pack("<q", i) * (self.RECORD // 8))
        self._open()

    def _open(self) -> None:
        self.f = open(self.path, "rb", buffering=0)
        self.opened_in = os.getpid()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "f": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self._open()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        self.f.seek(i * self.RECORD)
        record = self.f.read(self.RECORD)
        return torch.tensor([i, struct.unpack_from("<q", record)[0],
                             int(self.opened_in == os.getpid())])


class EntropyRng(Dataset):
    """An RNG made from entropy in ``__setstate__``: item ``i`` is ``[i, the worker's
    id, a draw]`` (each worker its own stream under torch's spawn)."""

    def __init__(self, n: int = 200) -> None:
        self.n = n
        self.rng = np.random.default_rng()

    def __getstate__(self) -> dict:
        return {**self.__dict__, "rng": None}

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.rng = np.random.default_rng()

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        return torch.tensor([i, get_worker_info().id, int(self.rng.integers(2**62))])


class WhereHeldReopening(WhereHeld):
    """:class:`WhereHeld` whose unpickling runs its own code: each worker unpickles it."""

    def __setstate__(self, state: dict) -> None:
        self.__dict__.update(state)
        self.unpickled_in = os.getpid()


class BlockedFromSecondBatch(Dataset):
    """Worker 1 blocks forever in its second ``__getitem__`` (a dead mount, a lock never
    released); everything else is instant."""

    def __init__(self, n: int = 20) -> None:
        self.n = n
        self.calls = 0

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int):
        info = get_worker_info()
        if info is not None and info.id == 1:
            self.calls += 1
            if self.calls == 2:
                threading.Event().wait()  # forever
        return torch.tensor([i])


# -- datasets holding open handles (issue 51): opened on first use, touched in the trainer


class RecordFile(Dataset):
    """Fixed-size records read from a file it keeps open (seek, then read): with one
    file description shared by several processes, a read could land at another's
    offset. Item ``i``: the record's bytes as a tensor."""

    RECORD = 16

    def __init__(self, path: str, n: int) -> None:
        self.path, self.n, self.f = path, n, None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.f is None:
            self.f = open(self.path, "rb")  # noqa: SIM115 - kept open, as such datasets do
        self.f.seek(i * self.RECORD)
        return torch.frombuffer(bytearray(self.f.read(self.RECORD)), dtype=torch.uint8)


class SqliteIndex(Dataset):
    """Rows of an sqlite3 table, the connection opened on first use and kept."""

    def __init__(self, path: str, n: int, read_only: bool = True) -> None:
        self.path, self.n, self.read_only, self.db = path, n, read_only, None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.db is None:
            import sqlite3

            self.db = (sqlite3.connect(f"file:{self.path}?mode=ro", uri=True)
                       if self.read_only else sqlite3.connect(self.path))
        x, y = self.db.execute("select x, y from rows where i = ?", (i,)).fetchone()
        return torch.tensor([i, x, y], dtype=torch.float64)


class H5Rows(Dataset):
    """Rows of an HDF5 dataset, the file (and the dataset) opened on first use and kept."""

    def __init__(self, path: str, n: int) -> None:
        self.path, self.n, self.f, self.rows = path, n, None, None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.f is None:
            import h5py

            self.f = h5py.File(self.path, "r")
            self.rows = self.f["rows"]
        return torch.from_numpy(self.rows[i].copy())


class LmdbRows(Dataset):
    """Values of an LMDB environment opened read-only on first use and kept."""

    def __init__(self, path: str, n: int) -> None:
        self.path, self.n, self.env = path, n, None

    def __len__(self) -> int:
        return self.n

    def __getitem__(self, i: int) -> torch.Tensor:
        if self.env is None:
            import lmdb

            self.env = lmdb.open(self.path, readonly=True, lock=False)
        with self.env.begin() as txn:
            return torch.frombuffer(bytearray(txn.get(b"%08d" % i)), dtype=torch.uint8)


def write_handle_data(kind: str, where: str, n: int) -> str:
    """The file a handle dataset of ``kind`` reads (made once under ``where``)."""
    import numpy as np

    if kind == "file":
        path = os.path.join(where, "records.bin")
        with open(path, "wb") as f:
            for i in range(n):
                f.write(bytes((i * 7 + j) % 251 for j in range(RecordFile.RECORD)))
    elif kind == "sqlite":
        import sqlite3

        path = os.path.join(where, "index.db")
        with sqlite3.connect(path) as db:
            db.execute("create table rows (i integer primary key, x real, y real)")
            db.executemany("insert into rows values (?, ?, ?)",
                           [(i, i * 0.5, i % 7) for i in range(n)])
        db.close()
    elif kind == "h5py":
        import h5py

        path = os.path.join(where, "rows.h5")
        with h5py.File(path, "w") as f:
            f["rows"] = np.arange(n * 4, dtype=np.float32).reshape(n, 4)
    else:
        import lmdb

        path = os.path.join(where, "rows.lmdb")
        env = lmdb.open(path, map_size=1 << 24)
        with env.begin(write=True) as txn:
            for i in range(n):
                txn.put(b"%08d" % i, bytes((i + j) % 256 for j in range(8)))
        env.close()
    return path


def handle_dataset(kind: str, path: str, n: int) -> Dataset:
    return {"file": RecordFile, "sqlite": SqliteIndex, "h5py": H5Rows,
            "lmdb": LmdbRows}[kind](path, n)


class Niceness(Dataset):
    """Item i: (i, the niceness of the process that fetched it)."""

    def __len__(self) -> int:
        return 8

    def __getitem__(self, i: int):
        return torch.tensor([i, os.getpriority(os.PRIO_PROCESS, 0)])
