"""First contact, GetServerInfo, get-or-create and `model.openai_client()` against ONE real
`tinkerrpc serve --auth-token T --sidecar-port P --sidecar-api-key K`, with the real openai client."""

from __future__ import annotations

import asyncio
import json
import subprocess
import time
import uuid
from collections.abc import Iterator
from pathlib import Path

import pytest

import tinkerrpc
from tinkerrpc_server.local.stack import LocalStack
from tinkerrpc_server.processes.probes import free_port

pytestmark = pytest.mark.process

TOKEN = "t0ken-first-contact"
SIDECAR_KEY = "sk-first-contact"
TINY = "tinkerrpc/tiny-chat"
BUF = Path(__file__).resolve().parents[2] / ".venv" / "bin" / "buf"
# A behavioural bound (fail fast instead of waiting out the 10 s connect timeout), kept generous.
FAST_FAILURE_SECONDS = 5.0


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    work = tmp_path_factory.mktemp("first-contact")
    args = ("--auth-token", TOKEN, "--sidecar-api-key", SIDECAR_KEY, "--model-dir", str(work / "models"))
    with LocalStack(work / "data", work / "serve.log", args, startup_timeout=240, with_sidecar=True) as stack:
        yield stack


@pytest.fixture(scope="module")
def client(stack: LocalStack) -> Iterator[tinkerrpc.Client]:
    with tinkerrpc.Client(stack.target, token=TOKEN) as sync_client:
        yield sync_client


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def fails_fast(target: str) -> str:
    """The message of connecting to `target`, sync and async alike, each within the bound."""
    messages = []
    started = time.monotonic()
    with pytest.raises((tinkerrpc.UnavailableError, ValueError)) as sync_error:
        tinkerrpc.Client(target, token=TOKEN)
    messages.append(str(sync_error.value))

    async def connect() -> None:
        async with tinkerrpc.AsyncClient(target, token=TOKEN):
            pass

    with pytest.raises((tinkerrpc.UnavailableError, ValueError)) as async_error:
        asyncio.run(connect())
    messages.append(str(async_error.value))
    assert time.monotonic() - started < 2 * FAST_FAILURE_SECONDS
    assert messages[0] == messages[1]
    return messages[0]


def test_a_closed_port_is_connection_refused_at_once() -> None:
    port = free_port()
    assert f"cannot connect to 127.0.0.1:{port} (connection refused)" in fails_fast(f"127.0.0.1:{port}")


def test_the_sidecars_port_is_named_an_http_server(stack: LocalStack) -> None:
    assert stack.sidecar_url is not None
    address = stack.sidecar_url.removeprefix("http://")
    assert f"{address} is an HTTP server, not gRPC" in fails_fast(address)


def test_an_http_url_is_not_a_grpc_target(stack: LocalStack) -> None:
    assert stack.sidecar_url is not None
    assert "is an HTTP URL, not a gRPC target" in fails_fast(f"{stack.sidecar_url}/v1")
    assert "is an HTTP URL, not a gRPC target" in fails_fast(f"http://{stack.target}")


def test_server_info(stack: LocalStack, client: tinkerrpc.Client) -> None:
    info = client.server_info()
    assert info.backend == "embedded_engine"
    assert info.server_version
    assert info.sidecar_url == f"{stack.sidecar_url}/v1"
    assert info.sidecar_requires_api_key
    assert info.limits == tinkerrpc.ServerLimits(
        max_sample_n=128,
        max_sample_tokens=16_384,
        max_train_trajectories=4096,
        max_train_tokens=1_048_576,
        max_message_bytes=256 * 1024 * 1024,
        max_top_logprobs=20,
        max_stop_strings=16,
        max_stop_string_bytes=256,
        max_stop_token_ids=128,
        backend_timeout_seconds=3600,
    )

    async def from_async() -> tinkerrpc.ServerInfo:
        async with tinkerrpc.AsyncClient(stack.target, token=TOKEN) as async_client:
            return await async_client.server_info()

    assert asyncio.run(from_async()) == info


def test_buf_curl_with_the_documented_reflection_header(stack: LocalStack) -> None:
    """The README's command: reflection needs the bearer token too (--reflect-header '*')."""
    command = [
        str(BUF), "curl", "--protocol", "grpc", "--http2-prior-knowledge",
        "-H", f"authorization: Bearer {TOKEN}", "--reflect-header", "*",
        "--data", "{}", f"http://{stack.target}/tinkerrpc.v1.TrainerService/GetServerInfo",
    ]  # fmt: skip
    done = subprocess.run(command, capture_output=True, text=True, timeout=60)
    assert done.returncode == 0, done.stderr
    assert json.loads(done.stdout)["backend"] == "BACKEND_KIND_EMBEDDED_ENGINE"


def test_exist_ok_returns_the_same_model_and_names_differences(client: tinkerrpc.Client) -> None:
    name = unique("get-or-create")
    first = client.create_model(name, TINY, lora_rank=4, exist_ok=True)
    assert first.info().policy_version == 0
    again = client.create_model(name, TINY, lora_rank=4, exist_ok=True, seed=7)  # the seed is not compared
    assert again.info() == first.info()
    with pytest.raises(tinkerrpc.AlreadyExistsError) as plain:
        client.create_model(name, TINY, lora_rank=4)
    assert "already exists" in plain.value.message
    with pytest.raises(tinkerrpc.AlreadyExistsError) as differs:
        client.create_model(name, TINY, lora_rank=8, train_attn=False, renderer="role_colon", exist_ok=True)
    message = differs.value.message
    assert "lora.rank is 4, not 8" in message
    assert "lora.train_attn is True, not False" in message
    assert "renderer is 'qwen3', not 'role_colon'" in message

    async def async_get_or_create() -> tinkerrpc.ModelInfo:
        async with tinkerrpc.AsyncClient(client.target, token=TOKEN) as async_client:
            model = await async_client.create_model(name, TINY, lora_rank=4, renderer="qwen3", exist_ok=True)
            return await model.info()

    assert asyncio.run(async_get_or_create()) == first.info()
    client.delete_model(name)


def test_openai_client_on_the_hosted_sidecar(
    client: tinkerrpc.Client, monkeypatch: pytest.MonkeyPatch
) -> None:
    import openai

    model = client.create_model(unique("openai-client"), TINY, lora_rank=4)
    openai_client = model.openai_client(api_key=SIDECAR_KEY)
    assert isinstance(openai_client, openai.OpenAI)
    completion = openai_client.chat.completions.create(
        model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4, logprobs=True
    )
    assert completion.choices[0].message.role == "assistant"
    turn = tinkerrpc.Trajectory.from_openai([{"role": "user", "content": "hi"}], completion, reward=1.0)
    assert list(turn.turns[0].completion_token_ids) == completion.choices[0].token_ids  # type: ignore[attr-defined]

    monkeypatch.setenv("TINKERRPC_SIDECAR_API_KEY", SIDECAR_KEY)
    assert [m.id for m in model.openai_client().models.list()].count(model.name) == 1

    async def through_async() -> str:
        async with tinkerrpc.AsyncClient(client.target, token=TOKEN) as async_client:
            async_openai = await async_client.model(model.name).async_openai_client()
            assert isinstance(async_openai, openai.AsyncOpenAI)
            chat = await async_openai.chat.completions.create(
                model=model.name, messages=[{"role": "user", "content": "hi"}], max_tokens=4
            )
            return chat.choices[0].message.role

    assert asyncio.run(through_async()) == "assistant"
    monkeypatch.delenv("TINKERRPC_SIDECAR_API_KEY")
    with pytest.raises(ValueError, match="requires an API key"):
        model.openai_client()
    wrong = model.openai_client(api_key="sk-wrong", max_retries=0)
    with pytest.raises(openai.AuthenticationError):
        wrong.models.list()
    client.delete_model(model.name)
