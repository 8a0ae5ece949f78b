"""Channel settings shared by both clients: message sizes, TLS, bearer-token metadata, health verdicts."""

from __future__ import annotations

import re
import socket
import time

import grpc
from grpc_health.v1 import health_pb2

from tinkerrpc._errors import UnavailableError

DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Generous: a Train step on a large batch can take minutes; pass timeout= per call to tighten it.
DEFAULT_TIMEOUT = 600.0
DEFAULT_CONNECT_TIMEOUT = 10.0
# The overall server health first; the service's own entry for servers that only register that.
HEALTH_SERVICE_NAMES = ("", "tinkerrpc.v1.TrainerService")
# How long first contact's TCP probe waits to connect, then for the peer's first bytes.
PROBE_SECONDS = 1.0
# What a gRPC client sends first: the HTTP/2 preface and an empty SETTINGS frame.
HTTP2_CLIENT_PREFACE = b"PRI * HTTP/2.0\r\n\r\nSM\r\n\r\n" + bytes([0, 0, 0, 4, 0, 0, 0, 0, 0])
HTTP2_SETTINGS_FRAME = 4
TLS_RECORD_TYPES = (0x15, 0x16)  # alert, handshake

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


def remaining(deadline: float) -> float:
    """Seconds left until `deadline` (a time.monotonic() value), never negative."""
    return max(deadline - time.monotonic(), 0.0)


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


def check_target(target: str) -> None:
    """A URL is not a gRPC target: say so before dialling it (grpc would try to resolve 'http' as a host)."""
    if re.match(r"(?i)https?://", target):
        raise ValueError(
            f"{target!r} is an HTTP URL, not a gRPC target: give the tinkerrpc server's gRPC HOST:PORT "
            "(e.g. 127.0.0.1:50051, `tinkerrpc serve --port`), not the OpenAI sidecar's URL"
        )


def host_and_port(target: str) -> tuple[str, int] | None:
    """(host, port) of a `HOST:PORT`, `[V6]:PORT` or `dns:///HOST:PORT` target; None for other schemes."""
    match = re.fullmatch(r"(?:dns:///)?(?:\[([^\]]+)\]|([^:/\[\]]+)):(\d{1,5})", target)
    if match is None:
        return None
    return match.group(1) or match.group(2), int(match.group(3))


def first_contact_problem(target: str, tls: bool) -> str | None:
    """Why `target` cannot answer as a tinkerrpc server, when a quick TCP probe can tell: nothing listens
    (refused, unknown host), an HTTP/1 server answers, or TLS and plaintext are mixed up. None when
    the probe cannot tell (then the health check waits, as for a server still starting)."""
    address = host_and_port(target)
    if address is None:
        return None
    host, port = address
    shown = f"[{host}]:{port}" if ":" in host else f"{host}:{port}"
    try:
        with socket.create_connection((host, port), timeout=PROBE_SECONDS) as probe:
            probe.sendall(HTTP2_CLIENT_PREFACE)
            reply = probe.recv(16)
    except socket.gaierror:
        return f"cannot connect to {shown} (unknown host {host!r})"
    except ConnectionRefusedError:
        return f"cannot connect to {shown} (connection refused)"
    except OSError:
        return None
    if reply.startswith(b"HTTP/"):
        return (
            f"{shown} is an HTTP server, not gRPC: give the tinkerrpc server's gRPC port "
            "(`tinkerrpc serve --port`, 50051 by default), not the OpenAI sidecar's"
        )
    if not tls and reply[:1] and reply[0] in TLS_RECORD_TYPES:
        return f"{shown} speaks TLS: connect with tls=True (and tls_server_name= for an IP address)"
    if tls and len(reply) >= 9 and reply[3] == HTTP2_SETTINGS_FRAME:
        return f"{shown} speaks plaintext gRPC, not TLS: connect with tls=False"
    return None
