"""The gRPC server process: TrainerService plus health checking and reflection, with graceful shutdown."""

from __future__ import annotations

import asyncio
import gc
import logging
import signal
import socket
import ssl
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, cast

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tinkerrpc.v1 import trainer_service_pb2, trainer_service_pb2_grpc
from tinkerrpc_server.processes.children import StartError, report_ready
from tinkerrpc_server.processes.http_serving import bound_port, listen
from tinkerrpc_server.processes.ownership import own_data_dir, probe_data_dir
from tinkerrpc_server.service.limits import Limits
from tinkerrpc_server.settings import DEFAULT_MODEL_DIR

# The service modules import tinker and the cookbook: imported when the server starts, after `tinkerrpc
# serve` has hidden torch from this process (service/torchless.py), not when this module is imported.
if TYPE_CHECKING:
    from tinkerrpc_server.service.backend import EngineHandle
    from tinkerrpc_server.service.servicer import TrainerService
    from tinkerrpc_server.service.training import StepHooks

log = logging.getLogger("tinkerrpc.server")

SERVICE_NAME = trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024
# Full-state checkpoint cadence when --checkpoint-every is not given: every step on the embedded
# engine (cheap, and every version is then a recovery point), every 10 steps on Tinker itself.
DEFAULT_CHECKPOINT_EVERY_EMBEDDED = 1
DEFAULT_CHECKPOINT_EVERY_TINKER = 10


def _no_step_hooks() -> StepHooks:
    from tinkerrpc_server.service.training import NoStepHooks

    return NoStepHooks()


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    # 0: one the kernel picks (reported on report_fd).
    port: int = 50051
    data_dir: Path = field(default_factory=lambda: Path("tinkerrpc-data"))
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    model_dir: Path = DEFAULT_MODEL_DIR
    # Tinker itself, when the server runs without an embedded engine: its key and URL (None: the SDK's).
    tinker_api_key: str | None = None
    tinker_url: str | None = None
    # Save full training state every K steps; None = the backend's default (see above).
    checkpoint_every: int | None = None
    # Seconds in-flight calls get to finish after SIGTERM/SIGINT before they are cancelled.
    shutdown_grace_seconds: float = 30.0
    # Every RPC but health checking then needs `authorization: Bearer <auth_token>`.
    auth_token: str | None = None
    # PEM files; with both set the server speaks TLS only.
    tls_cert: Path | None = None
    tls_key: Path | None = None
    # Serve the OpenAI-compatible sidecar in this process on this port (same host). Without
    # sidecar_api_key it answers anyone, and forwards with auth_token: the CLI allows that only when
    # told (--sidecar-no-auth), and it is logged as a warning.
    sidecar_port: int | None = None
    sidecar_api_key: str | None = None
    limits: Limits = field(default_factory=Limits)
    # Called at fixed points of every Train step; fault tests stop the process there.
    step_hooks: StepHooks = field(default_factory=_no_step_hooks)
    # An inherited descriptor on which the server reports its ports once it serves (processes.children).
    report_fd: int | None = None


async def serve(config: ServerConfig, engine: EngineHandle | None) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code. `engine` is the embedded engine child,
    already starting (None: use Tinker itself with `config.tinker_api_key`)."""
    from tinkerrpc_server.service.backend import connect_backend
    from tinkerrpc_server.service.rendering import ChatCodecs
    from tinkerrpc_server.service.servicer import Hosting, TrainerService
    from tinkerrpc_server.service.store import SchemaTooNewError, Store

    problem = probe_data_dir(config.data_dir) or own_data_dir(config.data_dir)
    if problem is not None:
        log.error("cannot start: %s", problem)
        return 1
    # Bound before the service is built: its ServerInfo names the sidecar's URL, port included.
    sidecar_socket = None
    if config.sidecar_port is not None:
        try:
            sidecar_socket = listen(config.host, config.sidecar_port)
        except OSError as err:
            log.error(
                "cannot start: cannot listen on %s:%d: %s", config.host, config.sidecar_port, err.strerror
            )
            return 1
    try:
        store = Store(config.data_dir / "tinkerrpc.sqlite3")
    except SchemaTooNewError as err:
        log.error("cannot start: %s", err)
        return 1
    codecs = ChatCodecs(config.model_dir, allow_remote_tokenizers=engine is None)
    # Tokenizers load while the engine boots.
    preload = asyncio.create_task(
        asyncio.to_thread(codecs.preload, [(m.base_model, m.renderer) for m in store.list_models()])
    )
    try:
        backend = await connect_backend(engine, config.tinker_api_key, config.tinker_url)
        await preload
    except StartError as err:
        log.error("cannot start: %s", err)
        store.close()
        if sidecar_socket is not None:
            sidecar_socket.close()
        return 1
    try:
        checkpoint_every = config.checkpoint_every or (
            DEFAULT_CHECKPOINT_EVERY_EMBEDDED if backend.embedded else DEFAULT_CHECKPOINT_EVERY_TINKER
        )
        hosting = Hosting(
            max_message_bytes=config.max_message_bytes,
            sidecar_url=sidecar_url(config.host, bound_port(sidecar_socket) if sidecar_socket else None),
            sidecar_requires_api_key=bool(config.sidecar_api_key),
        )
        service = TrainerService(
            store, backend, codecs, checkpoint_every, config.limits, config.step_hooks, hosting
        )
        return await _serve(config, service, sidecar_socket)
    finally:
        await backend.aclose()
        store.close()


async def _serve(config: ServerConfig, service: TrainerService, sidecar_socket: socket.socket | None) -> int:
    from tinkerrpc_server.interceptors import BearerTokenInterceptor, RequestDecodingInterceptor

    await service.recover()
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
        # gRPC's default would let a second server bind the same port and take half the calls.
        ("grpc.so_reuseport", 0),
    ]
    interceptors: list[grpc.aio.ServerInterceptor] = [RequestDecodingInterceptor()]  # type: ignore[type-arg]
    if config.auth_token:
        # First: a caller without the token learns nothing, not even whether its request decodes.
        interceptors.insert(0, BearerTokenInterceptor(config.auth_token))
    server = grpc.aio.server(options=options, interceptors=interceptors)
    trainer_service_pb2_grpc.add_TrainerServiceServicer_to_server(service, server)
    # grpc-stubs' grpc_health stubs lack grpcio-health-checking's `aio` (grpc_health.v1._async).
    health_servicer = health.aio.HealthServicer()  # type: ignore[attr-defined]
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = f"{config.host}:{config.port}"
    try:
        if config.tls_cert and config.tls_key:
            credentials = grpc.ssl_server_credentials(
                [(config.tls_key.read_bytes(), config.tls_cert.read_bytes())]
            )
            port = server.add_secure_port(address, credentials)
        else:
            port = server.add_insecure_port(address)
    except RuntimeError:  # grpc's only word on a failed bind: "Failed to bind to address ..."
        port = 0
    if port == 0:
        log.error("cannot start: cannot listen on %s (in use, or not an address of this machine)", address)
        return 1
    address = f"{config.host}:{port}"
    await server.start()

    async def report_serving(serving: bool) -> None:
        # The server and its one service are up or down together: the engine serves them both.
        status = (
            health_pb2.HealthCheckResponse.SERVING if serving else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        for name in ("", SERVICE_NAME):
            await health_servicer.set(name, status)

    await report_serving(True)
    log.info(
        "tinkerrpc serving gRPC on %s (%s, %s; data dir %s)",
        address,
        "TLS" if config.tls_cert else "plaintext",
        "bearer token required" if config.auth_token else "no token",
        config.data_dir,
    )
    # The tinker SDK, transformers and the cookbook make many long-lived objects: freeze them so garbage
    # collections, and the final one at exit (seconds otherwise), skip them.
    gc.freeze()

    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    exit_code = 0
    supervisor = None
    if service.supervises_engine:

        def engine_lost(task: asyncio.Task[None]) -> None:
            nonlocal exit_code
            if not task.cancelled():
                log.error("the embedded engine cannot be restarted; stopping", exc_info=task.exception())
                exit_code = 1
                stop_requested.set()

        supervisor = asyncio.create_task(service.supervise_engine(report_serving))
        supervisor.add_done_callback(engine_lost)
    # Opens a new Tinker session whenever the backend finishes this one (not serving until it is open).
    session_watch = asyncio.create_task(service.watch_session(report_serving))
    sidecar = None
    ports = {"port": port}
    if sidecar_socket is not None:
        from tinkerrpc_server.sidecar.app import GrpcUpstream, serve_sidecar

        if config.auth_token and not config.sidecar_api_key:
            log.warning(
                "the sidecar on port %d requires no API key: anyone who reaches it uses the server "
                "as if they held its token",
                bound_port(sidecar_socket),
            )
        # Over TLS when the server speaks it, trusting exactly the server's own certificate.
        upstream = GrpcUpstream(
            f"127.0.0.1:{port}",
            config.auth_token,
            tls_roots=config.tls_cert.read_bytes() if config.tls_cert else None,
            tls_server_name=certificate_name(config.tls_cert) if config.tls_cert else None,
        )
        sidecar = asyncio.create_task(
            serve_sidecar(upstream, sidecar_socket, config.sidecar_api_key, stop_requested)
        )
        ports["sidecar_port"] = bound_port(sidecar_socket)
    if config.report_fd is not None:
        report_ready(config.report_fd, ports)
    await stop_requested.wait()

    log.info("shutting down: refusing new calls, letting in-flight calls finish")
    if supervisor is not None:
        # The engine may stop first (Ctrl-C reaches the whole process group): not a crash to restart.
        supervisor.cancel()
    session_watch.cancel()
    if sidecar is not None:
        # HTTP requests in flight finish while the gRPC server still answers them.
        await sidecar
    await health_servicer.enter_graceful_shutdown()
    await server.stop(config.shutdown_grace_seconds)
    await service.finish_tidying()
    log.info("stopped")
    return exit_code


def sidecar_url(host: str, port: int | None) -> str | None:
    """The hosted sidecar's base URL for OpenAI clients, on the address it listens on."""
    if port is None:
        return None
    return f"http://{f'[{host}]' if ':' in host else host}:{port}/v1"


def certificate_name(cert_file: Path) -> str | None:
    """A host name `cert_file` (a self-signed PEM certificate) is valid for: its first DNS
    subjectAltName, else its common name; None when it names no host (then only an IP SAN can match).
    The hosted sidecar dials 127.0.0.1 and checks the server's certificate for this name."""
    context = ssl.SSLContext(ssl.PROTOCOL_TLS_CLIENT)
    context.load_verify_locations(cafile=cert_file)
    for cert in context.get_ca_certs():
        # typeshed types these dicts loosely; the ssl module documents their shape.
        alt_names = cast("tuple[tuple[str, str], ...]", cert.get("subjectAltName", ()))
        subject = cast("tuple[tuple[tuple[str, str], ...], ...]", cert.get("subject", ()))
        names = [value for kind, value in alt_names if kind == "DNS"]
        names += [value for rdn in subject for key, value in rdn if key == "commonName"]
        if names:
            # A wildcard certificate is checked for one of the names it covers.
            return f"sidecar{names[0][1:]}" if names[0].startswith("*.") else names[0]
    return None
