"""The embedded engine (`tinkerrpc engine`) as a child process on a free 127.0.0.1 port."""

from __future__ import annotations

import json
import subprocess
import sys
import time
import urllib.request
from pathlib import Path
from types import TracebackType

import tinker

from tinkerrpc_server.stack import free_port

LOCAL_API_KEY = "tml-bench"


class EngineProcess:
    def __init__(
        self, data_dir: Path, model_dir: Path, log_path: Path, *, startup_timeout: float = 120.0
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self._cmd = [
            sys.executable, "-m", "tinkerrpc_server.cli", "engine",
            "--host", "127.0.0.1", "--port", str(self.port),
            "--data-dir", str(data_dir), "--model-dir", str(model_dir),
        ]  # fmt: skip
        self._proc: subprocess.Popen[bytes] | None = None

    @property
    def pid(self) -> int:
        assert self._proc is not None
        return self._proc.pid

    def service_client(self) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.base_url, api_key=LOCAL_API_KEY)

    def worker_stats(self) -> dict[str, int]:
        """The engine's scheduling counters (sample requests, the batches they ran in, training ops)."""
        with urllib.request.urlopen(f"{self.base_url}/api/v1/debug/stats", timeout=10) as response:
            return dict(json.loads(response.read()))

    def __enter__(self) -> EngineProcess:
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(self._cmd, stdout=log, stderr=subprocess.STDOUT)
        try:
            self._wait_healthy()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_healthy(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if self._proc.poll() is not None:
                raise RuntimeError(
                    f"engine exited with {self._proc.returncode}; log {self.log_path}:\n"
                    + self.log_path.read_text(errors="replace")[-3000:]
                )
            try:
                with urllib.request.urlopen(f"{self.base_url}/api/v1/healthz", timeout=2) as response:
                    if response.status == 200:
                        return
            except OSError:
                time.sleep(0.1)
        raise TimeoutError(f"engine not healthy after {self.startup_timeout} s; log {self.log_path}")

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.terminate()
        try:
            self._proc.wait(30)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
