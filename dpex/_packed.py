"""``PackedStrings``: a read-only list of strings held in two NumPy arrays.

A Python list of strings is millions of objects, each with a reference count. Pickling
it for the workers takes ~350 ns an item here (1.0 s for 2.85 M strings), and every
process forked from the one holding it, torch's workers and dpex's alike, copies the
pages of the items it reads as their counts change (pytorch/pytorch#13246). Packed, the
same strings are one UTF-8 buffer and the end offset of each: they pickle as two
buffers out of band (:mod:`dpex._loader_pickle`), which a host maps from the trainer's memfd
as they are, and reading an item writes nothing, so forks share every page.
"""

from __future__ import annotations

import operator
from collections.abc import Iterable, Iterator, Sequence
from typing import Any, overload

import numpy as np

__all__ = ["PackedStrings"]

_CODEC = ("utf-8", "surrogatepass")  # (any str, lone surrogates included, round-trips)
_CHUNK = 4096


class PackedStrings(Sequence):
    """A read-only sequence of ``str`` in two arrays: ``PackedStrings(paths)`` where a
    dataset held ``list(paths)``. Items, negative indexes, ``len``, iteration, ``in``
    and ``index`` work as on the list; a slice gives a list. It pickles as two buffers,
    and what torch's or dpex's workers read of it is never copied into them."""

    __slots__ = ("_data", "_ends")

    def __init__(self, strings: Iterable[str] = ()) -> None:
        encoded = []
        for s in strings:
            if not isinstance(s, str):
                raise TypeError(f"PackedStrings holds str, not {type(s).__name__}: {s!r}")
            encoded.append(s.encode(*_CODEC))
        self._ends = np.cumsum(np.fromiter(map(len, encoded), dtype=np.int64,
                                           count=len(encoded)), dtype=np.int64)
        self._data = np.frombuffer(b"".join(encoded), dtype=np.uint8).copy()

    @classmethod
    def _from_arrays(cls, data: np.ndarray, ends: np.ndarray) -> PackedStrings:
        packed = cls.__new__(cls)
        packed._data, packed._ends = data, ends
        return packed

    def __reduce__(self) -> tuple:
        return _rebuild, (type(self), self._data, self._ends)

    def __len__(self) -> int:
        return len(self._ends)

    @overload
    def __getitem__(self, i: int) -> str: ...

    @overload
    def __getitem__(self, i: slice) -> list[str]: ...

    def __getitem__(self, i: Any) -> Any:
        if isinstance(i, slice):
            return [self[j] for j in range(*i.indices(len(self)))]
        n = len(self._ends)
        j = operator.index(i)  # (TypeError for a float, as a list gives)
        if j < 0:
            j += n
        if not 0 <= j < n:
            raise IndexError(f"PackedStrings index {i} out of range for {n} strings")
        start = int(self._ends[j - 1]) if j else 0
        return self._data[start:int(self._ends[j])].tobytes().decode(*_CODEC)

    def __iter__(self) -> Iterator[str]:
        data, start = self._data, 0
        for at in range(0, len(self._ends), _CHUNK):  # (a few thousand ints at a time)
            for end in self._ends[at:at + _CHUNK].tolist():
                yield data[start:end].tobytes().decode(*_CODEC)
                start = end

    def __eq__(self, other: object) -> bool:
        if isinstance(other, PackedStrings):
            return np.array_equal(self._ends, other._ends) and \
                np.array_equal(self._data, other._data)
        if isinstance(other, list):  # (as a list: never equal to a tuple)
            return len(other) == len(self) and all(a == b for a, b in zip(self, other, strict=True))
        return NotImplemented

    __hash__ = None  # type: ignore[assignment]  # (compared by value, as a list)

    def __repr__(self) -> str:
        head = ", ".join(repr(s) for s in self[:3])
        more = ", ..." if len(self) > 3 else ""
        return f"PackedStrings([{head}{more}], {len(self)} strings, {self.nbytes} bytes)"

    @property
    def nbytes(self) -> int:
        """The bytes it holds: the UTF-8 text and 8 per string."""
        return int(self._data.nbytes + self._ends.nbytes)


def _rebuild(cls: type, data: np.ndarray, ends: np.ndarray) -> PackedStrings:
    return cls._from_arrays(data, ends)
