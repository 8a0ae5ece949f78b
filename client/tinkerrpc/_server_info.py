"""What GetServerInfo says about a server, as plain dataclasses."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Literal
from urllib.parse import urlsplit, urlunsplit

from tinkerrpc._channel import host_and_port
from tinkerrpc.v1 import trainer_service_pb2 as service_pb

BackendKind = Literal["embedded_engine", "tinker", "unknown"]
_BACKENDS: dict[int, BackendKind] = {
    service_pb.BACKEND_KIND_EMBEDDED_ENGINE: "embedded_engine",
    service_pb.BACKEND_KIND_TINKER: "tinker",
}
# Hosts a server listens on to mean "every interface": no client dials them.
_WILDCARD_HOSTS = ("0.0.0.0", "::", "")


@dataclass(frozen=True)
class ServerLimits:
    """The limits a request must stay within (see ServerLimits in protos/tinkerrpc/v1/trainer_service.proto)."""

    max_sample_n: int
    max_sample_tokens: int
    max_train_trajectories: int
    max_train_tokens: int
    max_message_bytes: int
    max_top_logprobs: int
    max_stop_strings: int
    max_stop_string_bytes: int
    max_stop_token_ids: int
    backend_timeout_seconds: int


@dataclass(frozen=True)
class ServerInfo:
    """A tinkerrpc server: its version, where it trains, the OpenAI sidecar it hosts, its limits.

    `sidecar_url` is the hosted sidecar's base URL for an OpenAI client ("http://HOST:PORT/v1"), None
    when the server hosts none (a standalone `tinkerrpc sidecar` is not known to the server)."""

    server_version: str
    backend: BackendKind
    sidecar_url: str | None
    sidecar_requires_api_key: bool
    limits: ServerLimits


def server_info_from_proto(response: service_pb.GetServerInfoResponse, target: str) -> ServerInfo:
    limits = response.limits
    return ServerInfo(
        server_version=response.server_version,
        backend=_BACKENDS.get(response.backend, "unknown"),
        sidecar_url=_dialable(response.sidecar_url, target) if response.sidecar_url else None,
        sidecar_requires_api_key=response.sidecar_requires_api_key,
        limits=ServerLimits(
            max_sample_n=limits.max_sample_n,
            max_sample_tokens=limits.max_sample_tokens,
            max_train_trajectories=limits.max_train_trajectories,
            max_train_tokens=limits.max_train_tokens,
            max_message_bytes=limits.max_message_bytes,
            max_top_logprobs=limits.max_top_logprobs,
            max_stop_strings=limits.max_stop_strings,
            max_stop_string_bytes=limits.max_stop_string_bytes,
            max_stop_token_ids=limits.max_stop_token_ids,
            backend_timeout_seconds=limits.backend_timeout_seconds,
        ),
    )


def _dialable(url: str, target: str) -> str:
    """The sidecar's URL with a wildcard listening host replaced by the host this client reached the
    gRPC server at (they run in one process, so on one machine)."""
    parts = urlsplit(url)
    address = host_and_port(target)
    if parts.hostname not in _WILDCARD_HOSTS or address is None or parts.port is None:
        return url
    host = f"[{address[0]}]" if ":" in address[0] else address[0]
    return urlunsplit(parts._replace(netloc=f"{host}:{parts.port}"))
