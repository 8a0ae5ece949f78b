"""The `tinkerrpc serve` process: health, reflection, unimplemented RPCs, clean shutdown."""

from __future__ import annotations

import signal
from collections.abc import Iterator
from pathlib import Path

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

from procs import Proc, free_port, tinkerrpc_cmd
from tinkerrpc.v1 import trainer_service_pb2

SERVICE = "tinkerrpc.v1.TrainerService"


def _health(channel: grpc.Channel, service: str = "") -> int:
    stub = health_pb2_grpc.HealthStub(channel)
    return int(stub.Check(health_pb2.HealthCheckRequest(service=service), timeout=2).status)


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[tuple[Proc, str]]:
    tmp = tmp_path_factory.mktemp("serve")
    port = free_port()
    proc = Proc(
        tinkerrpc_cmd("serve", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(tmp / "data")),
        tmp / "serve.log",
    )
    target = f"127.0.0.1:{port}"
    with grpc.insecure_channel(target) as channel:
        proc.wait_ready(lambda: _health(channel) == health_pb2.HealthCheckResponse.SERVING)
    yield proc, target
    proc.stop()


def test_health_is_serving_for_server_and_service(server: tuple[Proc, str]) -> None:
    _, target = server
    with grpc.insecure_channel(target) as channel:
        assert _health(channel) == health_pb2.HealthCheckResponse.SERVING
        assert _health(channel, SERVICE) == health_pb2.HealthCheckResponse.SERVING


def test_reflection_lists_trainer_service_and_its_methods(server: tuple[Proc, str]) -> None:
    _, target = server
    with grpc.insecure_channel(target) as channel:
        db = ProtoReflectionDescriptorDatabase(channel)
        assert SERVICE in db.get_services()
        from google.protobuf.descriptor_pool import DescriptorPool

        pool = DescriptorPool(db)
        service = pool.FindServiceByName(SERVICE)
        expected = {m.name for m in trainer_service_pb2.DESCRIPTOR.services_by_name["TrainerService"].methods}
        assert {m.name for m in service.methods} == expected
        assert {"Train", "Sample", "CreateModel", "RestoreCheckpoint"} <= expected


def test_unknown_method_answers_unimplemented(server: tuple[Proc, str]) -> None:
    _, target = server
    with grpc.insecure_channel(target) as channel:
        call = channel.unary_unary(f"/{SERVICE}/NoSuchMethod")
        with pytest.raises(grpc.RpcError) as err:
            call(b"", timeout=5)
        assert err.value.code() == grpc.StatusCode.UNIMPLEMENTED


def test_sigterm_exits_cleanly_and_refuses_new_calls(tmp_path: Path) -> None:
    port = free_port()
    proc = Proc(
        tinkerrpc_cmd("serve", "--port", str(port), "--data-dir", str(tmp_path / "data")),
        tmp_path / "serve.log",
    )
    target = f"127.0.0.1:{port}"
    with grpc.insecure_channel(target) as channel:
        proc.wait_ready(lambda: _health(channel) == health_pb2.HealthCheckResponse.SERVING)
    assert proc.stop(signal.SIGTERM) == 0
    assert "stopped" in proc.log()
    with grpc.insecure_channel(target) as channel, pytest.raises(grpc.RpcError) as err:
        _health(channel)
    assert err.value.code() == grpc.StatusCode.UNAVAILABLE
