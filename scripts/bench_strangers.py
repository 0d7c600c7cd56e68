"""What strangers on a trainer's ports cost it: memory under a raw-ZMTP flood and
under many idle unauthenticated connections (no Ray: one trainer session).

    python scripts/bench_strangers.py [--frames 200] [--connections 1000]

Prints a markdown table: the trainer's RSS growth, what each attack sent, and what
the trainer counted as refused handshakes.
"""

from __future__ import annotations

import argparse
import os
import queue
import socket
import sys
import threading
import time

sys.path.insert(0, os.path.join(os.path.dirname(os.path.abspath(__file__)), "..", "tests"))
from attackers import rss_bytes, zmtp_flood  # noqa: E402

from dpex._event_loop import LoopThread  # noqa: E402
from dpex._protocol import Wire  # noqa: E402
from dpex.client._session import TrainerSession  # noqa: E402

MiB = 1 << 20


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--frames", type=int, default=200, help="1 MiB MORE-frames per port")
    p.add_argument("--connections", type=int, default=1000, help="idle strangers")
    args = p.parse_args()
    loop = LoopThread("bench-strangers")
    session = TrainerSession(Wire.new(64 * MiB), "127.0.0.1", queue.SimpleQueue())
    loop.start()
    loop.run(session.open(), 10)
    rows = []
    try:
        base = rss_bytes()
        sent: list[int] = []
        threads = [threading.Thread(target=lambda a=a: sent.append(
            zmtp_flood(a, args.frames, MiB))) for a in (session.data_address,
                                                        session.control_address)]
        for t in threads:
            t.start()
        for t in threads:
            t.join(120)
        time.sleep(0.5)
        rows.append((f"raw ZMTP flood: 2 ports x {args.frames} frames of 1 MiB flagged MORE",
                     f"{args.frames * 2} MiB offered, {sum(sent) / MiB:.1f} MiB taken",
                     (rss_bytes() - base) / MiB))
        print(f"flood done: {sum(sent) / MiB:.1f} MiB taken", flush=True)
        base = rss_bytes()
        conns = []
        host, port = session.data_address.removeprefix("tcp://").rsplit(":", 1)
        for i in range(args.connections):
            c = socket.create_connection((host, int(port)), timeout=10)
            c.sendall(b"\xff" + bytes(8) + b"\x7f\x03\x00" + b"NULL".ljust(20, b"\0")
                      + bytes(32))
            conns.append(c)
            if (i + 1) % 250 == 0:
                print(f"{i + 1} idle connections open", flush=True)
        time.sleep(1.0)
        held = (rss_bytes() - base) / MiB
        for c in conns:
            c.close()
        rows.append((f"{args.connections} connections: a NULL greeting, then idle",
                     f"{args.connections} x 64 B", held))
        refused = loop.run(session.snapshot(), 10)["rejected"].get("handshake", 0)
    finally:
        loop.stop(cleanup=session.close)
    print("\n| attack | sent | trainer RSS growth (MiB) |\n|---|---|---:|")
    for what, sent_, grown in rows:
        print(f"| {what} | {sent_} | {grown:.1f} |")
    print(f"\nhandshakes refused and counted: {refused}")


if __name__ == "__main__":
    main()
