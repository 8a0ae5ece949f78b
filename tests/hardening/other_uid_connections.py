"""A local user of another uid holding half-sent HTTP connections: run as root, it drops to `--uid`
before connecting, opens `--count` connections to each URL, sends the start of a request on each, and
after `--settle` seconds prints one JSON line: per URL, how many the server closed and the status lines
it closed them with. It holds the rest open until its stdin closes."""

from __future__ import annotations

import argparse

# Loaded before the uid drop: the interpreter's own files are root's alone, and connecting to a host name
# loads this codec lazily.
import encodings.idna  # noqa: F401
import json
import os
import socket
import sys
import time

HALF_REQUEST = b"POST /v1/chat/completions HTTP/1.1\r\nHost: 127.0.0.1\r\nContent-Type: appl"


def closed_by_server(sock: socket.socket, deadline: float) -> bytes | None:
    """What the server sent before closing the connection, or None if it is still open at `deadline`
    (past it, whether it is closed already)."""
    received = b""
    while True:
        sock.settimeout(max(deadline - time.monotonic(), 0.0))
        try:
            chunk = sock.recv(4096)
        except (TimeoutError, BlockingIOError):
            return None
        except ConnectionResetError:
            return received
        if not chunk:
            return received
        received += chunk


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("--uid", type=int, required=True)
    parser.add_argument("--count", type=int, required=True)
    parser.add_argument("--settle", type=float, default=3.0)
    parser.add_argument("urls", nargs="+")
    args = parser.parse_args()
    os.setgroups([])
    os.setgid(args.uid)
    os.setuid(args.uid)
    held: dict[str, list[socket.socket]] = {}
    for url in args.urls:
        host, port = url.removeprefix("http://").split(":")
        held[url] = []
        for _ in range(args.count):
            sock = socket.create_connection((host, int(port)), timeout=10)
            sock.sendall(HALF_REQUEST)
            held[url].append(sock)
    time.sleep(args.settle)
    report = {}
    for url, sockets in held.items():
        now = time.monotonic()
        replies = [reply for sock in sockets if (reply := closed_by_server(sock, now)) is not None]
        report[url] = {
            "closed": len(replies),
            "status_lines": sorted({reply.split(b"\r\n", 1)[0].decode() for reply in replies}),
        }
    print(json.dumps(report), flush=True)
    sys.stdin.read()


if __name__ == "__main__":
    main()
