"""Versions a trainer and its workers compare at handshake."""

from __future__ import annotations

import platform

from dpex._protocol import PROTOCOL_VERSION

__version__ = "0.1.0"


def local_versions() -> dict:
    return {
        "dpex": __version__,
        "protocol": PROTOCOL_VERSION,
        "python": platform.python_version(),
    }
