"""Channel settings shared by both clients: message sizes, TLS, bearer-token metadata, health verdicts."""

from __future__ import annotations

import grpc
from grpc_health.v1 import health_pb2

from tinkerrpc._errors import UnavailableError

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Generous: a Train step on a large batch can take minutes; pass timeout= per call to tighten it.
DEFAULT_TIMEOUT = 600.0
DEFAULT_CONNECT_TIMEOUT = 10.0
# The overall server health first; the service's own entry for servers that only register that.
HEALTH_SERVICE_NAMES = ("", "tinkerrpc.v1.TrainerService")

Metadata = tuple[tuple[str, str], ...]
TlsOption = bool | grpc.ChannelCredentials


def channel_options(
    max_message_bytes: int, tls_server_name: str | None = None
) -> list[tuple[str, int | str]]:
    if max_message_bytes < 1:
        raise ValueError(f"max_message_bytes must be >= 1, got {max_message_bytes}")
    options: list[tuple[str, int | str]] = [
        ("grpc.max_send_message_length", max_message_bytes),
        ("grpc.max_receive_message_length", max_message_bytes),
    ]
    if tls_server_name is not None:
        # The name the server's certificate must carry, when the target's host is not it (an IP).
        options.append(("grpc.ssl_target_name_override", tls_server_name))
    return options


def channel_credentials(tls: TlsOption) -> grpc.ChannelCredentials | None:
    """None for plaintext; system roots for tls=True; the given credentials otherwise."""
    if tls is True:
        return grpc.ssl_channel_credentials()
    if tls is False:
        return None
    return tls


def auth_metadata(token: str | None) -> Metadata:
    """The bearer token as call metadata: grpc refuses call credentials on plaintext channels, metadata works on both."""
    if token is None:
        return ()
    if not token or any(c in token for c in "\r\n"):
        raise ValueError("token must be a non-empty single-line string")
    return (("authorization", f"Bearer {token}"),)


def check_serving(target: str, service: str, response: health_pb2.HealthCheckResponse) -> None:
    if response.status != health_pb2.HealthCheckResponse.SERVING:
        status_name = health_pb2.HealthCheckResponse.ServingStatus.Name(response.status)
        raise UnavailableError(
            grpc.StatusCode.UNAVAILABLE,
            f"tinkerrpc server at {target} is {status_name} (health service {service!r})",
        )


def unreachable(target: str, connect_timeout: float, cause: grpc.RpcError) -> UnavailableError:
    code: grpc.StatusCode = cause.code()
    return UnavailableError(
        grpc.StatusCode.UNAVAILABLE,
        f"no healthy tinkerrpc server at {target} within {connect_timeout}s "
        f"(health check: {code.name}: {cause.details()})",
    )
