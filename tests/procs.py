"""Real processes on 127.0.0.1 for tests: start a command, wait until it is ready, stop it."""

from __future__ import annotations

import os
import signal
import subprocess
import sys
import time
from collections.abc import Callable
from pathlib import Path

from tinkerrpc_server.stack import free_port

__all__ = ["Proc", "free_port", "tinkerrpc_cmd"]


def tinkerrpc_cmd(*args: str) -> list[str]:
    """The `tinkerrpc` console script, run with this interpreter."""
    return [sys.executable, "-m", "tinkerrpc_server.cli", *args]


class Proc:
    """A child process whose output goes to a log file, stopped at the end of the test."""

    def __init__(self, cmd: list[str], log_path: Path, env: dict[str, str] | None = None) -> None:
        self.cmd = cmd
        self.log_path = log_path
        full_env = {**os.environ, "TINKER_TELEMETRY": "0", **(env or {})}
        self._log = open(log_path, "ab")  # noqa: SIM115 - closed in stop()
        self.popen = subprocess.Popen(cmd, stdout=self._log, stderr=subprocess.STDOUT, env=full_env)

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def wait_ready(self, is_ready: Callable[[], bool], timeout: float = 90.0) -> None:
        """Poll is_ready() until it returns True; fail with the log if the process dies or time runs out."""
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            if self.popen.poll() is not None:
                raise RuntimeError(f"{self.cmd} exited with {self.popen.returncode}:\n{self.log()[-4000:]}")
            try:
                if is_ready():
                    return
            except Exception:
                pass
            time.sleep(0.1)
        raise TimeoutError(f"{self.cmd} not ready after {timeout}s:\n{self.log()[-4000:]}")

    def stop(self, sig: int = signal.SIGTERM, timeout: float = 30.0) -> int:
        """Send sig and wait; SIGKILL if it does not exit in time. Returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(sig)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(10)
        self._log.close()
        return int(self.popen.returncode)
