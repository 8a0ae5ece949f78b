"""The `tinkerrpc serve` process: health, reflection, unimplemented RPCs, clean shutdown."""

from __future__ import annotations

import re
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from tinkerrpc.v1 import trainer_service_pb2
from tinkerrpc_server.local.stack import LocalStack
from tinkerrpc_server.settings import ENGINE_API_KEY_ENV, SIDECAR_API_KEY_ENV

pytestmark = pytest.mark.process

SERVICE = "tinkerrpc.v1.TrainerService"
# Credentials in the server's own environment, which its engine child must not inherit.
SERVER_CREDENTIALS = {SIDECAR_API_KEY_ENV: "sidecar-key-of-the-server", ENGINE_API_KEY_ENV: "tml-" + "k" * 32}


def _health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """Ready once gRPC health says SERVING (LocalStack's readiness probe)."""
    tmp = tmp_path_factory.mktemp("serve")
    with LocalStack(tmp / "data", tmp / "serve.log", env=SERVER_CREDENTIALS) as stack:
        yield stack


def _environ(pid: int) -> dict[str, str]:
    entries = Path(f"/proc/{pid}/environ").read_bytes().decode().split("\0")
    return dict(entry.split("=", 1) for entry in entries if "=" in entry)


def test_the_engine_child_inherits_only_its_own_key(server: LocalStack) -> None:
    [pid] = re.findall(r"embedded engine starting \(pid (\d+)\)", server.log())
    engine = _environ(int(pid))
    assert SIDECAR_API_KEY_ENV not in engine
    # A fresh key of its own, not the one in the server's environment (which the server never passes on).
    assert engine[ENGINE_API_KEY_ENV].startswith("tml-")
    assert engine[ENGINE_API_KEY_ENV] != SERVER_CREDENTIALS[ENGINE_API_KEY_ENV]
    assert engine["TINKER_TELEMETRY"] == "0"


def test_health_is_serving_for_server_and_service(server: LocalStack) -> None:
    with grpc.insecure_channel(server.target) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        assert _health(channel, SERVICE) == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_trainer_service_and_its_methods(server: LocalStack) -> None:
    with grpc.insecure_channel(server.target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert SERVICE in db.get_services()
        from google.protobuf.descriptor_pool import DescriptorPool

        pool = DescriptorPool(db)
        service = pool.FindServiceByName(SERVICE)
        expected = {m.name for m in trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerService"].methods}
        assert {m.name for m in service.methods} == expected
        assert {"Train", "Sample", "CreateModel", "RestoreCheckpoint"} <= expected


def test_unknown_method_answers_unimplemented(server: LocalStack) -> None:
    with grpc.insecure_channel(server.target) as channel:
        call = channel.unary_unary(f"/{SERVICE}/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as err:
            call(b"", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_sigterm_exits_cleanly_and_refuses_new_calls(tmp_path: Path) -> None:
    stack = LocalStack(tmp_path / "data", tmp_path / "serve.log").start()
    assert stack.stop() == 0  # stop() sends SIGTERM
    assert "stopped" in stack.log()
    with grpc.insecure_channel(stack.target) as channel, pytest.raises(grpc.RpcError) as err:
        _health(channel)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
