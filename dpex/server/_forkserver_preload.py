"""Imported by a warm worker's forkserver, last of its preloads: imports the library
modules the worker's first session imported, so that later sessions, forked from it,
find them imported (a dataset whose ``worker_init_fn`` comes from Lightning imports
Lightning, transformers and matplotlib: ~10 s of CPU per session here).

The list comes in a file named by ``DPEX_FORKSERVER_PRELOAD`` (a list of thousands of
module names may be longer than one environment variable may be). A module that fails
to import here is skipped: the session imports it itself, as it would have.
"""

import os

_PATH = os.environ.pop("DPEX_FORKSERVER_PRELOAD", None)
if _PATH:
    try:
        with open(_PATH, encoding="utf-8") as f:
            _NAMES = f.read().split()
    except OSError:
        _NAMES = []
    for _name in _NAMES:
        try:
            __import__(_name)
        except Exception:  # noqa: BLE001 - any failure: the session imports it itself
            pass
