"""The embedded engine as a child process of the server. Light imports only: the CLI starts the engine
before it imports the heavy service modules (tinker, torch), so both boot in parallel."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

log = logging.getLogger("tinkerrpc.backend")

_PR_SET_PDEATHSIG = 1


class BackendStartError(RuntimeError):
    """The backend could not be started or reached."""


def _die_with_parent() -> None:
    """Runs in the engine child before exec: the kernel SIGKILLs it when the server dies, even by SIGKILL."""
    libc = ctypes.CDLL(None, use_errno=True)
    libc.prctl(_PR_SET_PDEATHSIG, signal.SIGKILL)


def _free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


# Loopback health checks must not go through an HTTP proxy from the environment.
_DIRECT = urllib.request.build_opener(urllib.request.ProxyHandler({}))


def _healthy(url: str) -> bool:
    try:
        with _DIRECT.open(f"{url}/api/v1/healthz", timeout=2) as response:
            return int(response.status) == 200
    except OSError:
        return False


class EmbeddedEngine:
    """The `tinkerrpc engine` child process."""

    def __init__(self, data_dir: Path, model_dir: Path) -> None:
        self.port = _free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        cmd = [
            sys.executable,
            "-m",
            "tinkerrpc_server.cli",
            "engine",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(data_dir),
            "--model-dir",
            str(model_dir),
        ]
        # Started from the main thread on purpose: PDEATHSIG fires when the forking *thread* exits.
        self.process = subprocess.Popen(cmd, preexec_fn=_die_with_parent)
        log.info("embedded engine starting (pid %d) on %s", self.process.pid, self.url)

    async def wait_healthy(self, timeout: float) -> None:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BackendStartError(
                    f"embedded engine exited with code {self.process.returncode} before becoming healthy"
                )
            if await asyncio.to_thread(_healthy, self.url):
                log.info("embedded engine healthy on %s", self.url)
                return
            await asyncio.sleep(0.1)
        self.stop()
        raise BackendStartError(f"embedded engine not healthy on {self.url} after {timeout:.0f}s")

    def stop(self, grace: float = 5.0) -> None:
        if self.process.poll() is None:
            self.process.terminate()
            try:
                self.process.wait(grace)
            except subprocess.TimeoutExpired:
                log.warning("embedded engine did not stop after SIGTERM; killing it")
                self.process.kill()
                self.process.wait(5)
