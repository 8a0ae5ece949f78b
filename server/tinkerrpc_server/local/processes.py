"""What every local process needs, written once: a free loopback port, an HTTP readiness probe and a
SIGTERM-then-SIGKILL stop."""

from __future__ import annotations

import logging
import socket
import subprocess
import urllib.request

log = logging.getLogger("tinkerrpc.local")

# Loopback probes must not go through an HTTP proxy from the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on right now."""
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def http_ok(url: str) -> bool:
    """Whether GET `url` answers 200 within 2 s."""
    try:
        with _DIRECT.open(url, timeout=2) as response:
            return int(response.status) == 200
    except OSError:  # refused while it boots, or an HTTP error status
        return False


def stop_process(process: subprocess.Popen[bytes], grace: float) -> int:
    """SIGTERM `process`, SIGKILL it if it outlives `grace` seconds; its exit code."""
    if process.poll() is None:
        process.terminate()
        try:
            process.wait(grace)
        except subprocess.TimeoutExpired:
            log.warning("pid %d did not stop %.0f s after SIGTERM; killing it", process.pid, grace)
            process.kill()
            process.wait(10)
    return process.returncode
