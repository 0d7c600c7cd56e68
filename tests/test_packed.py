"""dpex.PackedStrings: a list of strings as two arrays, read like the list, shipped out of
band, and read in a fork without copying its pages (pytorch/pytorch#13246)."""

import os
import pickle

import pytest
from test_loader_pickle import pickle_part, shipped, unpickled

from dpex import PackedStrings

WORDS = ["", "a", "héllo", "日本語", "\ud800lone", "x" * 300, "tab\tand\nnewline", "a"]


def test_it_reads_as_the_list_it_was_made_from():
    packed = PackedStrings(WORDS)
    assert len(packed) == len(WORDS) and list(packed) == WORDS and packed == WORDS
    assert [packed[i] for i in range(-len(WORDS), len(WORDS))] == WORDS + WORDS
    assert packed[1:6:2] == WORDS[1:6:2] and packed[::-1] == WORDS[::-1]
    assert "日本語" in packed and "b" not in packed
    assert packed.index("a") == 1 and packed.count("a") == 2
    assert PackedStrings() == [] and len(PackedStrings()) == 0
    with pytest.raises(IndexError, match="index 8 out of range for 8 strings"):
        packed[8]
    with pytest.raises(IndexError):
        packed[-9]
    with pytest.raises(TypeError, match="holds str, not int: 3"):
        PackedStrings(["a", 3])
    with pytest.raises(TypeError):
        packed[1.0]  # as a list
    assert packed != tuple(WORDS) and packed == list(WORDS)  # as a list: no tuple is equal
    with pytest.raises(TypeError):
        packed[1] = "b"  # read-only
    assert "PackedStrings(['', 'a', 'héllo', ...], 8 strings" in repr(packed)


class Paths(PackedStrings):
    pass


def test_it_pickles_to_the_same_strings_and_class():
    packed = PackedStrings(WORDS)
    assert pickle.loads(pickle.dumps(packed)) == packed
    assert pickle.loads(pickle.dumps(packed, protocol=2)) == WORDS
    again = pickle.loads(pickle.dumps(Paths(WORDS)))
    assert type(again) is Paths and again == WORDS
    many = PackedStrings(str(i) for i in range(10_000))  # iteration over several chunks
    assert list(many) == [str(i) for i in range(10_000)]


def test_shipped_it_travels_beside_the_pickle_and_comes_back_as_views():
    words = [f"file-{i:07d}.jpg" for i in range(200_000)]
    packed = PackedStrings(words)
    shipment = shipped({"files": packed})
    assert pickle_part(shipment) < 4_000  # two buffers out of band, not 200,000 strings
    whole = bytearray(bytes(shipment))
    out = unpickled(whole)["files"]
    assert out == packed and out[123_456] == "file-0123456.jpg"
    assert out.nbytes == packed.nbytes == len("".join(words)) + 8 * len(words)


def _private_dirty_kib() -> int:
    with open("/proc/self/smaps_rollup") as f:
        for line in f:
            if line.startswith("Private_Dirty:"):
                return int(line.split()[1])
    raise AssertionError("no Private_Dirty in smaps_rollup")


def _pages_a_fork_copies_reading(items) -> int:
    """KiB that a forked child comes to hold privately by reading every item once."""
    r, w = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: read, report, leave without cleanup
        try:
            before = _private_dirty_kib()
            total = 0
            for i in range(len(items)):
                total += len(items[i])
            os.write(w, str(_private_dirty_kib() - before).encode())
        finally:
            os._exit(0)
    os.close(w)
    with os.fdopen(r) as f:
        grew = int(f.read())
    os.waitpid(pid, 0)
    return grew


@pytest.mark.e2e
def test_a_fork_reading_every_item_copies_the_lists_pages_but_not_the_packed_ones():
    words = [f"{i:08d}-sample-path.png" for i in range(500_000)]  # ~40 MiB as objects
    as_list = _pages_a_fork_copies_reading(words)
    packed = _pages_a_fork_copies_reading(PackedStrings(words))
    assert as_list > 20 * 1024, as_list  # the list's items' pages, copied on access
    assert packed < 2 * 1024, packed  # the interpreter's own few pages
