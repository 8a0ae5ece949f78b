"""Local `tinkerrpc` processes on 127.0.0.1 (serve, engine, sidecar) for the demo, the examples, the
benchmarks and the tests: each starts when its context is entered, is ready once entered, and stops on exit."""

from __future__ import annotations

import json
import logging
import os
import subprocess
import sys
import time
import urllib.request
from collections.abc import Sequence
from pathlib import Path
from types import TracebackType
from typing import TYPE_CHECKING, TypeVar

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tinkerrpc_server.engine.auth import HEALTH_PATH, generate_api_key
from tinkerrpc_server.local.processes import free_port, http_ok, stop_process
from tinkerrpc_server.settings import ENGINE_API_KEY_ENV, SIDECAR_API_KEY_ENV

if TYPE_CHECKING:
    import tinker

ProcessT = TypeVar("ProcessT", bound="LocalProcess")

log = logging.getLogger("tinkerrpc.local")
# How long stopping an engine waits for each tinker session it handed out to finish.
CLIENT_CLOSE_SECONDS = 10.0


def tinkerrpc_command(*args: str) -> list[str]:
    """The `tinkerrpc` command line run with this interpreter (the console script may not be on PATH)."""
    return [sys.executable, "-m", "tinkerrpc_server.cli", *args]


class LocalProcess:
    """`tinkerrpc <args>` as a child process, its output appended to `log_path`.

    `start()` (or entering the context) waits until `is_ready()`, and raises with the log's tail when the
    process exits first or `startup_timeout` passes. `stop()` (or leaving) sends SIGTERM, then SIGKILL
    if the process outlives `stop_timeout`.
    """

    def __init__(
        self, args: Sequence[str], log_path: Path, startup_timeout: float, env: dict[str, str] | None = None
    ) -> None:
        self.env = {**os.environ, "TINKER_TELEMETRY": "0", **(env or {})}
        self.cmd = tinkerrpc_command(*args)
        self.log_path = log_path
        self.startup_timeout = startup_timeout
        self._proc: subprocess.Popen[bytes] | None = None

    def is_ready(self) -> bool:
        raise NotImplementedError

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")

    def start(self: ProcessT) -> ProcessT:
        if self._proc is not None:
            # A second process would replace the first, which then outlives every stop().
            raise RuntimeError(f"`tinkerrpc {self.cmd[3]}` was already started (enter the unstarted object)")
        self.log_path.parent.mkdir(parents=True, exist_ok=True)
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(self.cmd, stdout=log, stderr=subprocess.STDOUT, env=self.env)
        try:
            self._wait_ready(self._proc)
        except BaseException:
            self.stop()
            raise
        return self

    def _wait_ready(self, proc: subprocess.Popen[bytes]) -> None:
        what = f"tinkerrpc {self.cmd[3]}"
        deadline = time.monotonic() + self.startup_timeout
        while time.monotonic() < deadline:
            if proc.poll() is not None:
                raise RuntimeError(
                    f"`{what}` exited with {proc.returncode}; see {self.log_path}:\n{self.log()[-3000:]}"
                )
            if self.is_ready():
                return
            time.sleep(0.1)
        raise TimeoutError(f"`{what}` not ready after {self.startup_timeout} s; see {self.log_path}")

    def stop(self, stop_timeout: float = 60.0) -> int | None:
        """Stop the process; its exit code (None if it never started)."""
        if self._proc is None:
            return None
        return stop_process(self._proc, stop_timeout)

    def wait(self, timeout: float) -> int:
        """Wait for the process to exit by itself; its exit code."""
        if self._proc is None:
            raise RuntimeError("the process has not started")
        return self._proc.wait(timeout)

    def kill(self) -> int:
        """SIGKILL the process (a crash, for fault tests) and reap it; its exit code."""
        if self._proc is None:
            raise RuntimeError("the process has not started")
        self._proc.kill()
        return self._proc.wait(30)

    def __enter__(self: ProcessT) -> ProcessT:
        return self.start()

    def __exit__(
        self,
        exc_type: type[BaseException] | None,
        exc: BaseException | None,
        tb: TracebackType | None,
    ) -> None:
        self.stop()


class LocalStack(LocalProcess):
    """`tinkerrpc serve` (with its embedded engine) on a free port; ready when gRPC health says SERVING
    and, with `with_sidecar`, the sidecar it hosts answers /health at `sidecar_url`.

    With `--tls-cert`/`--tls-key` among `extra_args`, `tls_root_certificates` lets the health probe
    trust the server's certificate."""

    def __init__(
        self,
        data_dir: Path,
        log_path: Path,
        extra_args: tuple[str, ...] = (),
        startup_timeout: float = 120.0,
        env: dict[str, str] | None = None,
        tls_root_certificates: bytes | None = None,
        with_sidecar: bool = False,
    ) -> None:
        self.data_dir = data_dir
        self.port = free_port()
        self.target = f"127.0.0.1:{self.port}"
        self.tls_root_certificates = tls_root_certificates
        args = ["serve", "--host", "127.0.0.1", "--port", str(self.port), "--data-dir", str(data_dir)]
        self.sidecar_url: str | None = None
        if with_sidecar:
            sidecar_port = free_port()
            self.sidecar_url = f"http://127.0.0.1:{sidecar_port}"
            args += ["--sidecar-port", str(sidecar_port)]
        super().__init__([*args, *extra_args], log_path, startup_timeout, env)

    def _health_channel(self) -> grpc.Channel:
        if self.tls_root_certificates is None:
            return grpc.insecure_channel(self.target)
        credentials = grpc.ssl_channel_credentials(root_certificates=self.tls_root_certificates)
        return grpc.secure_channel(self.target, credentials)

    def is_ready(self) -> bool:
        with self._health_channel() as channel:
            try:
                response = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=1
                )
            except grpc.RpcError:
                return False
        if response.status != health_pb2.HealthCheckResponse.SERVING:
            return False
        # The hosted sidecar starts once the server serves; its /health needs no key.
        return self.sidecar_url is None or http_ok(f"{self.sidecar_url}/health")


class LocalEngine(LocalProcess):
    """`tinkerrpc engine` (Tinker's HTTP API) on a free port; ready when its health endpoint answers.

    It requires `api_key`, fresh for each LocalEngine (handed over in its environment): clients made by
    `service_client`/`rest_client` send it, raw HTTP requests send `auth_headers`."""

    def __init__(
        self,
        data_dir: Path,
        model_dir: Path,
        log_path: Path,
        startup_timeout: float = 120.0,
        session_timeout: float | None = None,
    ) -> None:
        self.data_dir = data_dir
        self.model_dir = model_dir
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.api_key = generate_api_key()
        self._service_clients: list[tinker.ServiceClient] = []
        args = ["engine", "--host", "127.0.0.1", "--port", str(self.port)]
        if session_timeout is not None:
            args += ["--session-timeout", str(session_timeout)]
        super().__init__(
            [*args, "--data-dir", str(data_dir), "--model-dir", str(model_dir)],
            log_path,
            startup_timeout,
            {ENGINE_API_KEY_ENV: self.api_key},
        )

    @property
    def auth_headers(self) -> dict[str, str]:
        return {"X-API-Key": self.api_key}

    def is_ready(self) -> bool:
        return http_ok(f"{self.base_url}{HEALTH_PATH}")

    def service_client(self) -> tinker.ServiceClient:
        """A client of this engine; `stop` finishes its session first (else its heartbeats outlive the
        engine and log connection errors)."""
        import tinker  # imported here: the other processes' users need no tinker SDK

        client = tinker.ServiceClient(base_url=self.base_url, api_key=self.api_key)
        self._service_clients.append(client)
        return client

    def stop(self, stop_timeout: float = 60.0) -> int | None:
        clients, self._service_clients = self._service_clients, []
        if self._proc is not None and self._proc.poll() is None:
            for client in clients:
                try:
                    client.close("success").result(timeout=CLIENT_CLOSE_SECONDS)
                except Exception as err:  # best effort: the engine stops next anyway
                    log.warning("could not finish a tinker session on %s: %s", self.base_url, err)
        return super().stop(stop_timeout)

    def rest_client(self) -> tinker.RestClient:
        import tinker

        return tinker.RestClient(base_url=self.base_url, api_key=self.api_key)

    def stats(self) -> dict[str, int]:
        """The engine's scheduling counters (sample requests, the batches they ran in, training ops)."""
        request = urllib.request.Request(f"{self.base_url}/api/v1/debug/stats", headers=self.auth_headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            return dict(json.loads(response.read()))


class LocalSidecar(LocalProcess):
    """`tinkerrpc sidecar` (OpenAI-compatible HTTP) for `grpc_target` on a free port; ready when it serves
    HTTP, whether or not the gRPC server is up (its /health says which)."""

    def __init__(
        self, grpc_target: str, log_path: Path, api_key: str | None = None, startup_timeout: float = 60.0
    ) -> None:
        self.port = free_port()
        self.base_url = f"http://127.0.0.1:{self.port}"
        self.openai_base_url = f"{self.base_url}/v1"
        args = ["sidecar", "--grpc-target", grpc_target, "--host", "127.0.0.1", "--port", str(self.port)]
        # The key travels in the environment: command lines are visible to every user of the machine.
        env = {SIDECAR_API_KEY_ENV: api_key} if api_key else {}
        super().__init__(args, log_path, startup_timeout, env)

    def is_ready(self) -> bool:
        return http_ok(f"{self.base_url}/metrics")
