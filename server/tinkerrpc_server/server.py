"""The gRPC server process: TrainerService plus health checking and reflection, with graceful shutdown."""

from __future__ import annotations

import asyncio
import logging
import signal
from dataclasses import dataclass, field
from pathlib import Path

import grpc
from grpc_health.v1 import health, health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha import reflection

from tinkerrpc.v1 import trainer_service_pb2, trainer_service_pb2_grpc

log = logging.getLogger("tinkerrpc.server")

SERVICE_NAME = trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerService"].full_name
DEFAULT_MAX_MESSAGE_BYTES = 256 * 1024 * 1024


@dataclass
class ServerConfig:
    host: str = "127.0.0.1"
    port: int = 50051
    data_dir: Path = field(default_factory=lambda: Path("tinkerrpc-data"))
    max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES
    # Seconds in-flight calls get to finish after SIGTERM/SIGINT before they are cancelled.
    shutdown_grace_seconds: float = 30.0


def _unimplemented(method_name: str):  # type: ignore[no-untyped-def]
    async def handler(self, request, context):  # type: ignore[no-untyped-def]
        await context.abort(grpc.StatusCode.UNIMPLEMENTED, f"TrainerService.{method_name} is not implemented")

    return handler


# Every RPC answers UNIMPLEMENTED naming itself until the service layer provides it.
UnimplementedTrainerService = type(
    "UnimplementedTrainerService",
    (trainer_service_pb2_grpc.TrainerServiceServicer,),
    {
        method.name: _unimplemented(method.name)
        for method in trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerService"].methods
    },
)


async def serve(config: ServerConfig) -> int:
    """Run until SIGTERM/SIGINT; returns the process exit code."""
    config.data_dir.mkdir(parents=True, exist_ok=True)
    options = [
        ("grpc.max_send_message_length", config.max_message_bytes),
        ("grpc.max_receive_message_length", config.max_message_bytes),
    ]
    server = grpc.aio.server(options=options)
    trainer_service_pb2_grpc.add_TrainerServiceServicer_to_server(UnimplementedTrainerService(), server)
    health_servicer = health.aio.HealthServicer()
    health_pb2_grpc.add_HealthServicer_to_server(health_servicer, server)
    reflection.enable_server_reflection(
        (SERVICE_NAME, health_pb2.DESCRIPTOR.services_by_name["Health"].full_name, reflection.SERVICE_NAME),
        server,
    )
    address = f"{config.host}:{config.port}"
    server.add_insecure_port(address)
    await server.start()
    for name in ("", SERVICE_NAME):
        await health_servicer.set(name, health_pb2.HealthCheckResponse.SERVING)
    log.info("tinkerrpc serving on %s (data dir %s)", address, config.data_dir)

    stop_requested = asyncio.Event()
    loop = asyncio.get_running_loop()
    for sig in (signal.SIGTERM, signal.SIGINT):
        loop.add_signal_handler(sig, stop_requested.set)
    await stop_requested.wait()

    log.info("shutting down: refusing new calls, letting in-flight calls finish")
    await health_servicer.enter_graceful_shutdown()
    await server.stop(config.shutdown_grace_seconds)
    log.info("stopped")
    return 0
