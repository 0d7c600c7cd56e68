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


def _read_greeting_and_command(sock: socket.socket) -> bytes:
    """The server's 64-byte greeting and its first command (short form); its name."""
    got = b""
    while len(got) < 66:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionResetError("closed by the peer")
        got += chunk
    size = got[65]
    while len(got) < 66 + size:
        chunk = sock.recv(4096)
        if not chunk:
            raise ConnectionResetError("closed by the peer")
        got += chunk
    return got[67:67 + got[66]]


def zmtp_flood(address: str, frames: int, frame_bytes: int, socket_type: bytes = b"PUSH",
               identity: bytes = b"", password: bytes | None = None) -> int:
    """Speak ZMTP 3.0 to ``address`` (``tcp://host:port``) with the NULL mechanism, or
    PLAIN with ``password`` (sent without waiting for the server's verdict), then
    send ``frames`` frames of ``frame_bytes`` each, all flagged MORE: one multipart
    message that never ends, which libzmq keeps in memory until its last frame comes.
    Returns the bytes the peer took before it closed the connection (or all of them)."""
    host, port = address.removeprefix("tcp://").rsplit(":", 1)
    sent = 0
    with socket.create_connection((host, int(port)), timeout=10) as sock:
        try:
            props = _property(b"Socket-Type", socket_type)
            if identity:
                props += _property(b"Identity", identity)
            if password is None:
                sock.sendall(_greeting(b"NULL"))
                sock.sendall(_command(b"READY", props))
            else:
                user = b"dpex-worker"
                sock.sendall(_greeting(b"PLAIN"))
                sock.sendall(_command(b"HELLO", bytes([len(user)]) + user
                                      + bytes([len(password)]) + password))
                _read_greeting_and_command(sock)  # WELCOME, or ERROR (then flood anyway)
                sock.sendall(_command(b"INITIATE", props))
            chunk = bytes(frame_bytes)
            header = b"\x03" + struct.pack(">Q", frame_bytes)  # MORE | LONG
            for _ in range(frames):
                sock.sendall(header)
                sock.sendall(chunk)
                sent += len(header) + len(chunk)
        except OSError:  # the peer closed the connection: it refused us
            pass
    return sent
