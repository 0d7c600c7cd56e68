"""A worker's random number generators: per-batch seeding, and the states taken after
each task for ``state_dict()``.

``worker_seeding="per_batch"`` seeds torch, ``random`` and NumPy before every batch
from which batch it is (:func:`batch_seed`, :func:`seed_batch`). Otherwise a worker
keeps its global RNG states right after each of its recent tasks (:class:`RngLog`,
taken cheaply by :class:`RngRecorder`), so that ``state_dict()`` can ask for those of
the last batch the training loop took, and a resumed worker starts from them
(:func:`restore_rng`).
"""

from __future__ import annotations

import collections
import ctypes
import hashlib
import random
import struct
import sys
import threading
from typing import Any

import torch

__all__ = ["RngLog", "RngRecorder", "batch_seed", "restore_rng", "sample_seed", "seed_batch",
           "seed_sample"]


def batch_seed(base_seed: int, epoch: int, position: int) -> bytes:
    """worker_seeding="per_batch": 32 bytes that depend only on which batch this is
    (the iterator's base seed, the epoch it serves, the batch's place in the epoch)."""
    return hashlib.blake2b(struct.pack("<Qqq", base_seed & (2**64 - 1), epoch, position),
                           digest_size=32, person=b"dpex-batch-seed").digest()


def sample_seed(seed: int, epoch: int, position: int) -> bytes:
    """worker_seeding="per_sample": 32 bytes that depend only on which sample of the
    epoch this is (its position, not the index it draws: a padded epoch repeats an
    index at another position), for :func:`seed_batch`."""
    return hashlib.blake2b(struct.pack("<Qqq", seed & (2**64 - 1), epoch, position),
                           digest_size=32, person=b"dpex-sample-seed").digest()


def _seed_torch(seed: int) -> None:
    """``torch.manual_seed(seed)`` for what a worker uses: the CPU generator, and CUDA's
    where this process initialised CUDA. (``torch.manual_seed`` also asks every other
    device backend: ~350 µs here, against ~2 µs for this.)"""
    torch.default_generator.manual_seed(seed)
    if torch.cuda.is_initialized():
        torch.cuda.manual_seed_all(seed)


def seed_batch(digest: bytes) -> None:
    """Seed torch, ``random`` and NumPy (where installed) from :func:`batch_seed`."""
    seed = int.from_bytes(digest[:8], "little") >> 1  # torch takes up to 2**63 - 1 here
    _seed_torch(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(np.frombuffer(digest[8:24], dtype=np.uint32))


def seed_sample(digest: bytes) -> None:
    """Seed torch, ``random`` and NumPy (where installed) from :func:`sample_seed`,
    cheaply enough to do before every sample (NumPy from 32 bits of it: ~3 µs, where
    seeding it from more costs ~27 µs)."""
    seed = int.from_bytes(digest[:8], "little") >> 1
    _seed_torch(seed)
    random.seed(seed)
    np = sys.modules.get("numpy")
    if np is not None:
        np.random.seed(int.from_bytes(digest[8:12], "little"))


_MT_STATE_BYTES = 624 * 4 + 4  # numpy's mt19937_state: uint32 key[624]; int pos


class RngRecorder:
    """Takes this process's torch, ``random`` and NumPy global RNG states after every
    task, as plain data (a checkpoint reads them back with ``torch.load(weights_only=
    True)``), cheaply.

    NumPy's ``get_state()`` costs ~60 µs, most of a small batch's time, while most
    datasets never touch NumPy's global RNG. So its state is taken again only when
    its generator's raw words (read in place: ~1 µs) changed, or when the last one
    taken holds a cached Gaussian (which the next normal draw uses up without
    touching the words). If the words cannot be read as expected, every capture
    takes the full state.
    """

    def __init__(self) -> None:
        self._numpy: tuple | None = None  # the last NumPy state taken
        self._words: bytes | None = None  # its raw generator words
        self._fast = True

    def capture(self) -> dict:
        state: dict[str, Any] = {"torch": torch.get_rng_state(), "random": random.getstate()}
        np = sys.modules.get("numpy")  # torch seeds it only where it is installed
        if np is not None:
            state["numpy"] = self._numpy_state(np)
        return state

    def _numpy_state(self, np: Any) -> tuple:
        words = self._raw_words(np) if self._fast else None
        if words is None or words != self._words or self._numpy is None or self._numpy[3]:
            kind, keys, pos, has_gauss, cached = np.random.get_state()
            # (the words as a tensor: torch.load(weights_only=True) reads any pickle of it)
            self._numpy = (kind, torch.from_numpy(keys.view(np.int32).copy()), int(pos),
                           int(has_gauss), float(cached))
            if words is not None and words != keys.tobytes() + int(pos).to_bytes(4, "little"):
                self._fast, words = False, None  # not the layout expected: always in full
            self._words = words
        return self._numpy

    def _raw_words(self, np: Any) -> bytes | None:
        try:
            address = np.random.mtrand._rand._bit_generator.ctypes.state_address
        except AttributeError:
            self._fast = False
            return None
        return ctypes.string_at(address, _MT_STATE_BYTES)


def restore_rng(state: dict) -> None:
    """Put back what :meth:`RngRecorder.capture` took."""
    torch.set_rng_state(state["torch"])
    random.setstate(state["random"])
    if "numpy" in state:
        import numpy as np

        kind, keys, pos, has_gauss, cached = state["numpy"]
        np.random.set_state((kind, keys.numpy().view(np.uint32).copy(), pos, has_gauss,
                             cached))


class RngLog:
    """The states right after each of a worker's recent tasks, by (epoch, seq), and
    when its epoch began (seq -1). Written by the fetch thread, read by the control
    thread (thread-safe); keeps the newest ``keep``."""

    def __init__(self, keep: int) -> None:
        self.keep = keep
        self._after: collections.OrderedDict[tuple[int, int], dict] = collections.OrderedDict()
        self._epoch_start: tuple[int, dict] | None = None
        self._lock = threading.Lock()

    def epoch_began(self, epoch: int, state: dict) -> None:
        with self._lock:
            self._epoch_start = (epoch, state)

    def task_done(self, epoch: int, seq: int, state: dict) -> None:
        with self._lock:
            self._after[(epoch, seq)] = state
            while len(self._after) > self.keep:
                self._after.popitem(last=False)

    def after(self, epoch: int, seq: int) -> dict | None:
        """The states right after task ``seq`` of ``epoch`` (seq -1: when the epoch
        began; None if this worker did not run it, or not recently)."""
        with self._lock:
            if seq == -1:
                start = self._epoch_start
                return start[1] if start is not None and start[0] == epoch else None
            return self._after.get((epoch, seq))
