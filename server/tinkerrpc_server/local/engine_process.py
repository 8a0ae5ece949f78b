"""The embedded engine as a child process of the server. Light imports only: the CLI starts the engine
before it imports the heavy service modules (tinker, torch), so both boot in parallel."""

from __future__ import annotations

import asyncio
import contextlib
import logging
import os
import subprocess
import sys
import time
from pathlib import Path

from tinkerrpc_server.engine.auth import HEALTH_PATH, generate_api_key
from tinkerrpc_server.local.processes import free_port, http_ok, stop_process
from tinkerrpc_server.settings import ENGINE_API_KEY_ENV

log = logging.getLogger("tinkerrpc.backend")

# Bytes the data-dir probe writes: enough that a full file system fails the probe, not a later step.
_PROBE_BYTES = 64 * 1024


class BackendStartError(RuntimeError):
    """The backend could not be started or reached."""


def probe_data_dir(directory: Path) -> str | None:
    """Why `directory` cannot hold state, or None when it can: creates it, then writes, fsyncs and
    deletes a file there, so an unwritable or full disk is reported at start, not mid-step. A directory
    it creates is its owner's alone (0700)."""
    probe = directory / f".write-probe-{os.getpid()}"
    try:
        directory.mkdir(mode=0o700, parents=True, exist_ok=True)
        fd = os.open(probe, os.O_WRONLY | os.O_CREAT | os.O_EXCL, 0o600)
        try:
            written = os.write(fd, bytes(_PROBE_BYTES))
            os.fsync(fd)
        finally:
            os.close(fd)
            with contextlib.suppress(OSError):
                probe.unlink()
    except OSError as err:
        return f"data dir {directory} is not writable: {err.strerror or err}"
    if written < _PROBE_BYTES:
        return f"data dir {directory} is full: wrote {written} of {_PROBE_BYTES} probe bytes"
    return None


class EmbeddedEngine:
    """The `tinkerrpc engine` child process; `respawn` replaces a dead one on a new port, with a new
    `api_key` (the key its clients send; handed to the child in its environment, never in argv)."""

    def __init__(self, data_dir: Path, model_dir: Path) -> None:
        self.data_dir = data_dir
        self.model_dir = model_dir
        # A data dir the engine cannot write is reported by wait_healthy (the server probes its own
        # first and stops with one line); the child is not started then.
        self.start_error = probe_data_dir(data_dir)
        self.process: subprocess.Popen[bytes] | None = None
        self.port = 0
        self.url = ""
        self.api_key = ""
        if self.start_error is None:
            self.respawn()

    def respawn(self) -> None:
        """Start the child (again) on a fresh port; a still running previous child is stopped first."""
        self.stop()
        self.port = free_port()
        self.url = f"http://127.0.0.1:{self.port}"
        self.api_key = generate_api_key()
        cmd = [
            sys.executable,
            "-m",
            "tinkerrpc_server.local.engine_child",
            "--parent-pid",
            str(os.getpid()),
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            "--model-dir",
            str(self.model_dir),
        ]
        # Started from the main thread on purpose: the child's PDEATHSIG fires when the forking *thread* exits.
        self.process = subprocess.Popen(cmd, env={**os.environ, ENGINE_API_KEY_ENV: self.api_key})
        log.info("embedded engine starting (pid %d) on %s", self.process.pid, self.url)

    @property
    def pid(self) -> int | None:
        return self.process.pid if self.process is not None else None

    def exit_code(self) -> int | None:
        """The child's exit code once it has exited (negative: killed by that signal), else None."""
        return self.process.poll() if self.process is not None else None

    async def wait_healthy(self, timeout: float) -> None:
        if self.process is None:
            raise BackendStartError(self.start_error or "embedded engine not started")
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.process.poll() is not None:
                raise BackendStartError(
                    f"embedded engine exited with code {self.process.returncode} before becoming healthy"
                )
            if await asyncio.to_thread(http_ok, f"{self.url}{HEALTH_PATH}"):
                log.info("embedded engine healthy on %s", self.url)
                return
            await asyncio.sleep(0.1)
        self.stop()
        raise BackendStartError(f"embedded engine not healthy on {self.url} after {timeout:.0f}s")

    def stop(self, grace: float = 5.0) -> None:
        if self.process is not None:
            stop_process(self.process, grace)
