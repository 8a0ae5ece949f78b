"""Local `tinkerrpc` processes on 127.0.0.1 (serve, engine, sidecar) for the demo, the examples, the
benchmarks and the tests: each starts when its context is entered, is ready once entered, and stops on exit."""

from __future__ import annotations

import json
import logging
import urllib.request
from pathlib import Path
from typing import TYPE_CHECKING, Any

import grpc
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tinkerrpc_server.engine.auth import HEALTH_PATH
from tinkerrpc_server.local.launch import EngineProcess, LocalProcess, tinkerrpc_command
from tinkerrpc_server.processes.probes import http_ok
from tinkerrpc_server.settings import (
    SIDECAR_API_KEY_ENV,
    TINKER_API_KEY_ENV,
    TINKER_BASE_URL_ENV,
    child_environment,
)

if TYPE_CHECKING:
    import tinker

__all__ = ["LocalEngine", "LocalProcess", "LocalSidecar", "LocalStack", "tinkerrpc_command"]

log = logging.getLogger("tinkerrpc.local")
# How long stopping an engine waits for each tinker session it handed out to finish.
CLIENT_CLOSE_SECONDS = 10.0
# Seconds each health check that confirms a started server's report may take.
_CONFIRM_SECONDS = 30.0


class LocalStack(LocalProcess):
    """`tinkerrpc serve` (with its embedded engine) on a port it binds itself. Started once it reported
    serving (gRPC started, the hosted sidecar listening), then confirmed: gRPC health says SERVING and,
    with `with_sidecar`, the sidecar it hosts answers /health at `sidecar_url` (it reaches the server).

    With `--tls-cert`/`--tls-key` among `extra_args`, `tls_root_certificates` lets the health check
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
        self.tls_root_certificates = tls_root_certificates
        self.with_sidecar = with_sidecar
        args = ["serve", "--host", "127.0.0.1", "--port", "0", "--data-dir", str(data_dir)]
        if with_sidecar:
            args += ["--sidecar-port", "0"]
        super().__init__(
            tinkerrpc_command(*args, *extra_args), "tinkerrpc serve", log_path, startup_timeout, env
        )

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    @property
    def sidecar_url(self) -> str | None:
        """The hosted sidecar's URL (with `with_sidecar`, or a `--sidecar-port` among `extra_args`)."""
        if not self.with_sidecar and "sidecar_port" not in self._ports:
            return None
        return f"http://127.0.0.1:{self.reported('sidecar_port')}"

    def served(self, ports: dict[str, int]) -> None:
        super().served(ports)
        if not self.is_ready():
            raise RuntimeError(
                f"`{self.name}` reported serving, but its health checks fail; see {self.log_path}"
            )

    def _health_channel(self) -> grpc.Channel:
        if self.tls_root_certificates is None:
            return grpc.insecure_channel(self.target)
        credentials = grpc.ssl_channel_credentials(root_certificates=self.tls_root_certificates)
        return grpc.secure_channel(self.target, credentials)

    def is_ready(self) -> bool:
        with self._health_channel() as channel:
            try:
                response = health_pb2_grpc.HealthStub(channel).Check(
                    health_pb2.HealthCheckRequest(), timeout=_CONFIRM_SECONDS
                )
            except grpc.RpcError:
                return False
        if response.status != health_pb2.HealthCheckResponse.SERVING:
            return False
        # The hosted sidecar's /health needs no key.
        return self.sidecar_url is None or http_ok(f"{self.sidecar_url}/health", _CONFIRM_SECONDS)


class LocalEngine(EngineProcess):
    """`tinkerrpc engine` (Tinker's HTTP API) on a port it binds itself, started once it reported serving.

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
        self._service_clients: list[tinker.ServiceClient] = []
        self._made_clients = False  # of any kind, through service_client or rest_client
        args = ["engine", "--host", "127.0.0.1", "--port", "0"]
        if session_timeout is not None:
            args += ["--session-timeout", str(session_timeout)]
        args += ["--data-dir", str(data_dir), "--model-dir", str(model_dir)]
        super().__init__(tinkerrpc_command(*args), "tinkerrpc engine", log_path, startup_timeout)

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
        self._made_clients = True
        return client

    def stop(self, stop_timeout: float = 60.0) -> int | None:
        clients, self._service_clients = self._service_clients, []
        if self._child is not None and self._child.exit_code() is None:
            for client in clients:
                try:
                    client.close("success").result(timeout=CLIENT_CLOSE_SECONDS)
                except Exception as err:  # best effort: the engine stops next anyway
                    log.warning("could not finish a tinker session on %s: %s", self.base_url, err)
        if self._made_clients:
            import tinker

            # Every RestClient of one URL and key shares one holder, kept for the life of the process: its
            # JWT refresh would outlive the engine and warn.
            tinker.RestClient(base_url=self.base_url, api_key=self.api_key).holder.close()
        return super().stop(stop_timeout)

    def rest_client(self) -> tinker.RestClient:
        import tinker

        self._made_clients = True
        return tinker.RestClient(base_url=self.base_url, api_key=self.api_key)

    def sdk_user_env(self) -> dict[str, str]:
        """A child's environment (settings.child_environment: no tinkerrpc credential, telemetry off) plus
        what a tinker SDK user sets to reach this engine instead of Tinker (its URL and key), offline: the
        built-in models' tokenizers load from the hub cache the engine was started with, when it was given
        one."""
        handed = {TINKER_BASE_URL_ENV: self.base_url, TINKER_API_KEY_ENV: self.api_key, "HF_HUB_OFFLINE": "1"}
        if "HF_HUB_CACHE" in self.env:
            handed["HF_HUB_CACHE"] = self.env["HF_HUB_CACHE"]
        return child_environment(handed)

    def stats(self) -> dict[str, Any]:
        """The engine's scheduling counters (sample requests, the batches they ran in, training ops) and
        its gauges (live_models; decoding_rows, by base model)."""
        request = urllib.request.Request(f"{self.base_url}/api/v1/debug/stats", headers=self.auth_headers)
        with urllib.request.urlopen(request, timeout=10) as response:
            return dict(json.loads(response.read()))


class LocalSidecar(LocalProcess):
    """`tinkerrpc sidecar` (OpenAI-compatible HTTP) for `grpc_target` on a port it binds itself, started
    once it serves HTTP, whether or not the gRPC server is up (its /health says which)."""

    def __init__(
        self, grpc_target: str, log_path: Path, api_key: str | None = None, startup_timeout: float = 60.0
    ) -> None:
        args = ["sidecar", "--grpc-target", grpc_target, "--host", "127.0.0.1", "--port", "0"]
        # The key travels in the environment: command lines are visible to every user of the machine.
        env = {SIDECAR_API_KEY_ENV: api_key} if api_key else {}
        super().__init__(tinkerrpc_command(*args), "tinkerrpc sidecar", log_path, startup_timeout, env)

    @property
    def openai_base_url(self) -> str:
        return f"{self.base_url}/v1"
