"""Strangers on a trainer's ports, for the security tests: a raw ZMTP client that
needs no ZeroMQ, and the process's resident memory to see what they cost."""

from __future__ import annotations

import socket
import struct


def rss_bytes() -> int:
    """This process's resident set size."""
    with open("/proc/self/status") as f:
        for line in f:
            if line.startswith("VmRSS:"):
                return int(line.split()[1]) * 1024
    raise RuntimeError("no VmRSS in /proc/self/status")


def _greeting(mechanism: bytes) -> bytes:
    """A ZMTP 3.0 greeting (64 bytes): signature, version, mechanism, as-server=0."""
    return (b"\xff" + bytes(8) + b"\x7f" + b"\x03\x00" + mechanism.ljust(20, b"\x00")
            + b"\x00" + bytes(31))


def _command(name: bytes, body: bytes) -> bytes:
    payload = bytes([len(name)]) + name + body
    return bytes([0x04, len(payload)]) + payload


def _property(name: bytes, value: bytes) -> bytes:
    return bytes([len(name)]) + name + struct.pack(">I", len(value)) + value


def zmtp_flood(address: str, frames: int, frame_bytes: int, socket_type: bytes = b"PUSH",
               identity: bytes = b"") -> int:
    """Speak ZMTP 3.0 with the NULL mechanism to ``address`` (``tcp://host:port``), then
    send ``frames`` frames of ``frame_bytes`` each, all flagged MORE: one multipart
    message that never ends, which libzmq keeps in memory until its last frame comes.
    Returns the bytes the peer took before it closed the connection (or all of them)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    sent = 0
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            sock.sendall(_greeting(b"NULL"))
            props = _property(b"Socket-Type", socket_type)
            if identity:
                props += _property(b"Identity", identity)
            sock.sendall(_command(b"READY", props))
            chunk = bytes(frame_bytes)
            header = b"\x03" + struct.pack(">Q", frame_bytes)  # MORE | LONG
            for _ in range(frames):
                sock.sendall(header)
                sock.sendall(chunk)
                sent += len(header) + len(chunk)
        except OSError:  # the peer closed the connection: it refused us
            pass
    return sent
