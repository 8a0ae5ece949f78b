"""Authentication and TLS of `tinkerrpc serve`, and the sidecar it hosts: real processes, real certificates."""

from __future__ import annotations

import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import grpc
import httpx
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc

import tinkerrpc
from tinkerrpc_server.local.stack import LocalStack

pytestmark = pytest.mark.process

TOKEN = "s3cret-token-for-tests"
SIDECAR_KEY = "sidecar-key-for-tests"


def _serving(channel: grpc.Channel) -> bool:
    stub = health_pb2_grpc.HealthStub(channel)
    return (
        stub.Check(health_pb2.HealthCheckRequest(), timeout=10).status
        == health_pb2.HealthCheckResponse.SERVING
    )


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return tmp_path_factory.mktemp("models")


@dataclass
class AuthedServer:
    """Plaintext server with a token from a file, hosting the sidecar with its own key."""

    stack: LocalStack
    sidecar_url: str


@pytest.fixture(scope="module")
def authed_server(tmp_path_factory: pytest.TempPathFactory, model_dir: Path) -> Iterator[AuthedServer]:
    tmp = tmp_path_factory.mktemp("auth")
    token_file = tmp / "token"
    token_file.write_text(TOKEN + "\n")
    args = ("--model-dir", str(model_dir), "--auth-token-file", str(token_file))
    sidecar_args = ("--sidecar-port", "0", "--sidecar-api-key", SIDECAR_KEY)
    # Health is exempt from auth, so the stack's readiness probe needs no token.
    stack = LocalStack(tmp / "data", tmp / "serve.log", (*args, *sidecar_args), startup_timeout=240).start()
    assert stack.sidecar_url is not None
    yield AuthedServer(stack, stack.sidecar_url)
    assert stack.stop() == 0


def test_health_needs_no_token_but_every_rpc_does(authed_server: AuthedServer) -> None:
    target = authed_server.stack.target
    with grpc.insecure_channel(target) as channel:
        assert _serving(channel)
    with tinkerrpc.Client(target) as anonymous, pytest.raises(tinkerrpc.UnauthenticatedError):
        anonymous.list_models()
    with (
        tinkerrpc.Client(target, token="wrong-" + TOKEN) as wrong,
        pytest.raises(tinkerrpc.UnauthenticatedError),
    ):
        wrong.list_models()
    with tinkerrpc.Client(target, token=TOKEN) as client:
        model = client.create_model("authed", base_model="tinkerrpc/tiny-chat", lora_rank=4)
        assert model.info().policy_version == 0
        assert "authed" in [m.name for m in client.list_models()]


def test_reflection_is_protected_too(authed_server: AuthedServer) -> None:
    from grpc_reflection.v1alpha.proto_reflection_descriptor_database import ProtoReflectionDescriptorDatabase

    with grpc.insecure_channel(authed_server.stack.target) as channel:
        with pytest.raises(grpc.RpcError) as err:
            ProtoReflectionDescriptorDatabase(channel).get_services()
        assert err.value.code() == grpc.StatusCode.UNAUTHENTICATED


def test_hosted_sidecar_checks_its_key_and_reaches_the_server(authed_server: AuthedServer) -> None:
    with tinkerrpc.Client(authed_server.stack.target, token=TOKEN) as client:
        client.create_model("hosted", base_model="tinkerrpc/tiny-chat", lora_rank=4)
    base = authed_server.sidecar_url
    refused = httpx.get(f"{base}/v1/models", timeout=30)
    assert refused.status_code == 401
    error = refused.json()["error"]  # OpenAI's error shape, with a message saying what is wrong
    assert error["message"] and error["type"]
    models = httpx.get(f"{base}/v1/models", headers={"Authorization": f"Bearer {SIDECAR_KEY}"}, timeout=30)
    assert models.status_code == 200, models.text
    assert "hosted" in {m["id"] for m in models.json()["data"]}


def test_secrets_never_reach_the_log(authed_server: AuthedServer) -> None:
    log = authed_server.stack.log()
    assert "tinkerrpc serving" in log
    assert TOKEN not in log and SIDECAR_KEY not in log


def test_tls_server_with_token(tmp_path: Path, model_dir: Path) -> None:
    cert, key = tmp_path / "cert.pem", tmp_path / "key.pem"
    subprocess.run(
        [
            "openssl", "req", "-x509", "-newkey", "rsa:2048", "-nodes", "-days", "1",
            "-subj", "/CN=localhost", "-addext", "subjectAltName=DNS:localhost,IP:127.0.0.1",
            "-keyout", str(key), "-out", str(cert),
        ],
        check=True,
        capture_output=True,
    )  # fmt: skip
    stack = LocalStack(
        tmp_path / "data",
        tmp_path / "serve.log",
        (
            "--model-dir",
            str(model_dir),
            "--auth-token",
            TOKEN,
            "--tls-cert",
            str(cert),
            "--tls-key",
            str(key),
        ),
        startup_timeout=240,
        tls_root_certificates=cert.read_bytes(),
    ).start()
    credentials = grpc.ssl_channel_credentials(root_certificates=cert.read_bytes())
    try:
        with tinkerrpc.Client(f"localhost:{stack.port}", token=TOKEN, tls=credentials) as client:
            assert client.list_models() == []
        with (
            tinkerrpc.Client(f"localhost:{stack.port}", tls=credentials) as anonymous,
            pytest.raises(tinkerrpc.UnauthenticatedError),
        ):
            anonymous.list_models()
        # A plaintext client cannot talk to the TLS port at all.
        with grpc.insecure_channel(stack.target) as plain, pytest.raises(grpc.RpcError):
            _serving(plain)
    finally:
        assert stack.stop() == 0
    assert TOKEN not in stack.log()
