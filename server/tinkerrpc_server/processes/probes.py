"""Loopback probes: whether an HTTP endpoint answers, and a port nothing listens on."""

from __future__ import annotations

import socket
import urllib.request

# Loopback probes must not go through an HTTP proxy from the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def http_ok(url: str, timeout: float = 2.0) -> bool:
    """Whether GET `url` answers 200 within `timeout` seconds."""
    try:
        with _DIRECT.open(url, timeout=timeout) as response:
            return int(response.status) == 200
    except OSError:  # refused, or an HTTP error status
        return False


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now: an address a client can be pointed at
    to find no server. Never one for a server to bind later (another process may take it in between):
    servers bind port 0 and report the port they got (see children)."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])
