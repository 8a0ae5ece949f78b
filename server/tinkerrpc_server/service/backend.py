"""Which Tinker the service talks to: Tinker itself (TINKER_API_KEY set) or the embedded engine, run as
a child process on a free loopback port. Either way the service only ever uses the tinker SDK."""

from __future__ import annotations

import asyncio
import ctypes
import logging
import os
import signal
import socket
import subprocess
import sys
import time
import urllib.request
from dataclasses import dataclass
from pathlib import Path

import tinker

log = logging.getLogger("tinkerrpc.backend")

LOCAL_API_KEY = "tml-local"
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


def _healthy(url: str) -> bool:
    try:
        with urllib.request.urlopen(f"{url}/api/v1/healthz", timeout=2) as response:
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


@dataclass
class Backend:
    service: tinker.ServiceClient
    rest: tinker.RestClient
    url: str
    engine: EmbeddedEngine | None

    @property
    def embedded(self) -> bool:
        return self.engine is not None

    def close(self) -> None:
        # Finishing the session closes the SDK's connections, so the engine's graceful stop need not wait.
        try:
            self.service.close("success").result(timeout=5)
        except Exception as err:
            log.warning("could not finish the Tinker session: %s", err)
        if self.engine is not None:
            self.engine.stop()


async def start_backend(
    data_dir: Path, model_dir: Path, tinker_url: str | None, startup_timeout: float = 120.0
) -> Backend:
    """Tinker itself when TINKER_API_KEY is set, else the embedded engine (started and health-checked)."""
    api_key = os.environ.get("TINKER_API_KEY")
    if api_key:
        url = tinker_url or os.environ.get("TINKER_BASE_URL") or ""
        log.info("using the Tinker service at %s", url or "the SDK's default URL")
        return Backend(
            service=tinker.ServiceClient(base_url=url or None, api_key=api_key),
            rest=tinker.RestClient(base_url=url or None, api_key=api_key),
            url=url,
            engine=None,
        )
    engine = EmbeddedEngine(data_dir / "engine", model_dir)
    try:
        await engine.wait_healthy(startup_timeout)
    except BaseException:
        engine.stop()
        raise
    return Backend(
        service=tinker.ServiceClient(base_url=engine.url, api_key=LOCAL_API_KEY),
        rest=tinker.RestClient(base_url=engine.url, api_key=LOCAL_API_KEY),
        url=engine.url,
        engine=engine,
    )
