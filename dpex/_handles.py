"""Open handles that travel: a dataset holding an open file, an sqlite3 connection,
an h5py file (or one of its datasets and groups) or an LMDB environment is shipped as
"open this again", and each worker reopens its own.

torch's forked workers inherit the trainer's open handles (and share them: one file
offset for all, the well-known wrong data from one HDF5 handle read by several forked
workers). dpex pickles the dataset, and a handle cannot be pickled: without this, such
a dataset is refused (:class:`~dpex.errors.DatasetNotPicklableError`) and its author
must reopen the handle in ``__setstate__`` or lazily. Here the shipment's pickler
(``client/_shipping.py``) reduces the handles it knows, read-only ones only:

- a file opened for reading (binary, text, unbuffered): reopened by its absolute path
  and mode (a text file's encoding and errors kept) at the trainer's position;
- an ``sqlite3.Connection`` on a database file: reopened on that file, read-only where
  the trainer's connection is (``isolation_level``, ``row_factory``, ``text_factory``
  kept); an in-memory or temporary database is refused by name;
- an ``h5py.File`` opened read-only, and its datasets and groups: the file reopened by
  name with its driver (once per worker and file), the object found again by its path;
- an ``lmdb.Environment`` opened read-only: reopened by path with its flags and sizes.

A handle open for writing, a socket, a pipe, anything else unknown, is refused by
name as before (the error names the attribute, the type and why). Each reopened handle
is the worker's own: unpickling opens a descriptor, so each worker unpickles its own
loader (``server/_unpickling.py``), and the trainer's handle is only read (its name,
mode and position). The packages stay optional: h5py's and LMDB's handles are
recognised only where the trainer has imported the package.
"""

from __future__ import annotations

import io
import os
import sqlite3
import sys
import weakref
from typing import Any

__all__ = ["HandleRefused", "describe", "reduce_handle"]


class HandleRefused(TypeError):
    """A handle that cannot travel, and why (the shipment names the attribute)."""


def reduce_handle(obj: Any) -> tuple | None:
    """How ``obj`` travels if it is a handle dpex reopens in each worker (a reduce
    tuple); None if it is not one of those (the same for every object of its type: the
    shipment's pickler asks once per type, ``client/_shipping.py``);
    :class:`HandleRefused` for one of those kinds that cannot travel (open for writing,
    an in-memory database)."""
    if isinstance(obj, (io.FileIO, io.BufferedReader, io.BufferedRandom, io.BufferedWriter,
                        io.TextIOWrapper)):
        return _reduce_file(obj)
    if isinstance(obj, sqlite3.Connection):
        return _reduce_sqlite(obj)
    h5py = sys.modules.get("h5py")
    if h5py is not None and isinstance(obj, (h5py.File, h5py.Dataset, h5py.Group)):
        return _reduce_h5(h5py, obj)
    lmdb = sys.modules.get("lmdb")
    if lmdb is not None and isinstance(obj, lmdb.Environment):
        return _reduce_lmdb(obj)
    return None


def describe(obj: Any) -> str:
    """What a reopened handle is, for the log: its type and what it opens."""
    name = getattr(obj, "name", None) if not isinstance(obj, sqlite3.Connection) \
        else _sqlite_file(obj)
    h5py = sys.modules.get("h5py")
    if h5py is not None and isinstance(obj, (h5py.Dataset, h5py.Group)):
        name = f"{obj.file.filename}:{obj.name}"
    lmdb = sys.modules.get("lmdb")
    if lmdb is not None and isinstance(obj, lmdb.Environment):
        name = obj.path()
    return f"{type(obj).__module__}.{type(obj).__qualname__} {name!r}"


# -- files ---------------------------------------------------------------------------

def _reduce_file(f: Any) -> tuple:
    kind = type(f).__name__
    name = getattr(f, "name", None)
    if not isinstance(name, str):
        raise HandleRefused(f"a {kind} on descriptor {name!r} (a pipe, a socket or a "
                            "descriptor of this process) cannot be opened again in a worker")
    if f.closed:
        return _closed_file, (name,)
    if f.writable():
        raise HandleRefused(f"a {kind} open for writing ({name!r}, mode {f.mode!r}) "
                            "cannot travel: every worker would write to it")
    path = os.path.abspath(name)
    if not os.path.isfile(path):
        raise HandleRefused(f"a {kind} on {name!r}, which is not a regular file, cannot "
                            "be opened again in a worker")
    try:
        position = f.tell()
    except OSError as exc:  # (a text file being read with next(): no position)
        raise HandleRefused(f"the position of a {kind} on {name!r} cannot be read "
                            f"({exc}), so it cannot be opened again where it stands") from None
    if isinstance(f, io.TextIOWrapper):
        return _open_file, (path, "r", position, -1, f.encoding, f.errors)
    buffering = 0 if isinstance(f, io.FileIO) else -1
    return _open_file, (path, "rb", position, buffering, None, None)


def _open_file(path: str, mode: str, position: int, buffering: int, encoding: str | None,
               errors: str | None) -> Any:
    """In a worker: the file opened again, at the trainer's position (a text file's
    position is a cookie of the same encoding, which ``seek`` takes back)."""
    f = open(path, mode, buffering=buffering, encoding=encoding, errors=errors)  # noqa: SIM115
    if position:
        f.seek(position)
    return f


def _closed_file(name: str) -> Any:
    f = io.BytesIO()
    f.close()
    f.name = name  # type: ignore[attr-defined]
    return f


# -- sqlite3 -------------------------------------------------------------------------

def _sqlite_file(conn: sqlite3.Connection) -> str:
    try:
        rows = conn.execute("PRAGMA database_list").fetchall()
    except sqlite3.Error as exc:
        raise HandleRefused(f"an sqlite3 connection whose database cannot be named "
                            f"({exc}) cannot be opened again in a worker") from None
    return next((row[2] for row in rows if row[1] == "main"), "")


def _sqlite_read_only(conn: sqlite3.Connection) -> bool:
    """Whether ``conn`` was opened read-only (``?mode=ro``, or a read-only file):
    ``sqlite3_db_readonly``, which Python's module does not expose, called through
    ctypes on the SQLite library the module itself loaded (found in this process's
    mappings; never another copy) with the connection's ``sqlite3*`` (the first field of
    CPython's connection object). False (a worker reopens it read-write, as a fork
    inherits it) where any of that cannot be done."""
    if sys.implementation.name != "cpython":
        return False
    try:
        import ctypes

        with open("/proc/self/maps", encoding="utf-8", errors="replace") as maps:
            mapped = {line.split()[-1] for line in maps if "libsqlite3" in line}
        if len(mapped) != 1:
            return False
        library = ctypes.CDLL(mapped.pop())
        db = ctypes.c_void_p.from_address(id(conn) + object.__basicsize__).value
        filename = library.sqlite3_db_filename
        filename.argtypes, filename.restype = (ctypes.c_void_p, ctypes.c_char_p), ctypes.c_char_p
        if not db or (filename(db, b"main") or b"").decode() != _sqlite_file(conn):
            return False  # (not the layout this reads: do not guess)
        readonly = library.sqlite3_db_readonly
        readonly.argtypes = (ctypes.c_void_p, ctypes.c_char_p)
        return readonly(db, b"main") == 1
    except (OSError, AttributeError, ValueError, UnicodeDecodeError):
        return False


def _reduce_sqlite(conn: sqlite3.Connection) -> tuple:
    path = _sqlite_file(conn)
    if not path:
        raise HandleRefused("an sqlite3 connection to an in-memory (or temporary) "
                            "database cannot travel: each worker would open an empty one")
    return _open_sqlite, (path, _sqlite_read_only(conn), conn.isolation_level,
                          conn.row_factory, conn.text_factory)


def _open_sqlite(path: str, read_only: bool, isolation_level: str | None, row_factory: Any,
                 text_factory: Any) -> sqlite3.Connection:
    """In a worker: its own connection to the trainer's database file."""
    if read_only:
        from urllib.parse import quote

        conn = sqlite3.connect(f"file:{quote(path)}?mode=ro", uri=True,
                               isolation_level=isolation_level, check_same_thread=False)
    else:
        conn = sqlite3.connect(path, isolation_level=isolation_level,
                               check_same_thread=False)
    conn.row_factory = row_factory
    conn.text_factory = text_factory
    return conn


# -- h5py ----------------------------------------------------------------------------

def _reduce_h5(h5py: Any, obj: Any) -> tuple:
    f = obj.file
    if not f.id.valid:
        raise HandleRefused(f"a closed {type(obj).__name__} cannot be opened again")
    if f.mode != "r":
        raise HandleRefused(f"an h5py file open for writing ({f.filename!r}, mode "
                            f"{f.mode!r}) cannot travel: every worker would write to it")
    where = None if isinstance(obj, h5py.File) else obj.name
    return _open_h5, (os.path.abspath(f.filename), f.driver, where)


# A worker's reopened files, one per file while something holds it. By process: a
# fork base's trial unpickling must not hand its file to the workers forked from it.
_H5_OPEN: weakref.WeakValueDictionary = weakref.WeakValueDictionary()


def _open_h5(path: str, driver: str, where: str | None) -> Any:
    """In a worker: the file opened again (once per file and process while it is held),
    and the dataset or group at ``where`` in it."""
    import h5py

    key = (os.getpid(), path, driver)
    f = _H5_OPEN.get(key)
    if f is None or not f.id.valid:
        f = h5py.File(path, "r", driver=driver)
        _H5_OPEN[key] = f
    return f if where is None else f[where]


# -- lmdb ----------------------------------------------------------------------------

def _reduce_lmdb(env: Any) -> tuple:
    flags = env.flags()
    if not flags.get("readonly"):
        raise HandleRefused(f"an LMDB environment open for writing ({env.path()!r}) "
                            "cannot travel: every worker would write to it")
    options = {key: flags[key] for key in ("subdir", "metasync", "sync", "map_async",
                                           "readahead", "meminit", "lock")
               if key in flags}
    return _open_lmdb, (os.path.abspath(env.path()), options, env.info()["map_size"],
                        env.max_readers())


def _open_lmdb(path: str, options: dict, map_size: int, max_readers: int) -> Any:
    """In a worker: its own read-only environment on the trainer's database."""
    import lmdb

    return lmdb.open(path, readonly=True, map_size=map_size, max_readers=max_readers,
                     **options)
