"""Run a whole local stack (`tinkerrpc serve` and its engine) as a child process, for the demo,
examples and benchmarks."""

from __future__ import annotations

import os
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path
from types import TracebackType

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


class LocalStack:
    """`tinkerrpc serve` on a free 127.0.0.1 port; `target` is ready once the context is entered."""

    def __init__(
        self,
        data_dir: Path,
        log_path: Path,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 120.0,
    ) -> None:
        self.data_dir = data_dir
        self.log_path = log_path
        self.extra_args = extra_args
        self.startup_timeout = startup_timeout
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self._proc: subprocess.Popen[bytes] | None = None

    def __enter__(self) -> LocalStack:
        cmd = [
            sys.executable,
            "-m",
            "tinkerrpc_server.cli",
            "serve",
            "--host",
            "127.0.0.1",
            "--port",
            str(self.port),
            "--data-dir",
            str(self.data_dir),
            *self.extra_args,
        ]
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                cmd, stdout=log, stderr=subprocess.STDOUT, env={**os.environ, "TINKER_TELEMETRY": "0"}
            )
        try:
            self._wait_serving()
        except BaseException:
            self.__exit__(None, None, None)
            raise
        return self

    def _wait_serving(self) -> None:
        assert self._proc is not None
        deadline = time.monotonic() + self.startup_timeout
        # Short reconnect backoff: gRPC's default would wait up to ~20 s after the server comes up.
        options = [("grpc.initial_reconnect_backoff_ms", 100), ("grpc.max_reconnect_backoff_ms", 250)]
        with grpc.insecure_channel(self.target, options=options) as channel:
            stub = health_pb2_grpc.HealthStub(channel)
            while time.monotonic() < deadline:
                if self._proc.poll() is not None:
                    raise RuntimeError(
                        f"tinkerrpc serve exited with {self._proc.returncode}; see {self.log_path}:\n"
                        + self.log_path.read_text(errors="replace")[-3000:]
                    )
                try:
                    status = stub.Check(health_pb2.HealthCheckRequest(), timeout=1).status
                    if status == health_pb2.HealthCheckResponse.SERVING:
                        return
                except grpc.RpcError:
                    pass
                time.sleep(0.2)
        raise TimeoutError(f"tinkerrpc serve not SERVING after {self.startup_timeout} s; see {self.log_path}")

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        if self._proc is None or self._proc.poll() is not None:
            return
        self._proc.send_signal(signal.SIGTERM)
        try:
            self._proc.wait(60)
        except subprocess.TimeoutExpired:
            self._proc.kill()
            self._proc.wait(10)
