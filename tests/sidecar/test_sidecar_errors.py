"""A real sidecar process with no gRPC server behind it: auth, validation, 503 and metrics, via `openai`."""

from __future__ import annotations

import asyncio
import re

import httpx
import openai
import pytest
from sidecar_support import API_KEY, Sidecar

from tinkerrpc_server.processes.http_serving import bound_port, listen
from tinkerrpc_server.processes.probes import free_port
from tinkerrpc_server.sidecar.app import GrpcUpstream, serve_sidecar

pytestmark = pytest.mark.process


def client(sidecar: Sidecar, *, key: str = API_KEY, max_retries: int = 0) -> openai.OpenAI:
    return openai.OpenAI(base_url=sidecar.openai_base_url, api_key=key, max_retries=max_retries, timeout=30)


def requests_counted(sidecar: Sidecar, route: str, status: int) -> float:
    pattern = rf'tinkerrpc_sidecar_requests_total{{route="{re.escape(route)}",status="{status}"}} (\S+)'
    match = re.search(pattern, sidecar.metrics())
    return float(match.group(1)) if match else 0.0


def test_missing_or_wrong_key_is_401_in_openai_shape(orphan_sidecar: Sidecar) -> None:
    with pytest.raises(openai.AuthenticationError) as caught:
        client(orphan_sidecar, key="sk-wrong").models.list()
    assert caught.value.status_code == 401
    assert caught.value.body["code"] == "invalid_api_key"  # type: ignore[index]
    assert caught.value.body["type"] == "authentication_error"  # type: ignore[index]
    bare = httpx.post(f"{orphan_sidecar.openai_base_url}/chat/completions", json={}, timeout=10)
    assert bare.status_code == 401
    assert set(bare.json()["error"]) == {"message", "type", "param", "code"}
    # The key is never echoed or logged.
    assert API_KEY not in bare.text and API_KEY not in orphan_sidecar.log()
    assert requests_counted(orphan_sidecar, "/v1/chat/completions", 401) >= 1
    # Every endpoint router's route is labelled by its template, refused before routing or not.
    refused = httpx.post(f"{orphan_sidecar.openai_base_url}/responses", json={}, timeout=10)
    assert refused.status_code == 401
    assert requests_counted(orphan_sidecar, "/v1/responses", 401) >= 1


def test_bad_parameters_are_400_naming_the_parameter(orphan_sidecar: Sidecar) -> None:
    api = client(orphan_sidecar)
    messages = [{"role": "user", "content": "hi"}]
    cases = [
        ({"n": 99}, "n"),
        ({"presence_penalty": 1.0}, "presence_penalty"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"stream_options": {"include_usage": True, "mystery_knob": 1}}, "stream_options.mystery_knob"),
        ({"top_logprobs": 3}, "top_logprobs"),
        ({"temperature": -1}, "temperature"),
    ]
    for fields, param in cases:
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(model="m", messages=messages, **fields)  # type: ignore[arg-type]
        assert caught.value.body["param"] == param, (fields, caught.value.body)  # type: ignore[index]
        assert caught.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model="m", prompt="x", echo=True, logprobs=1)
    assert caught.value.body["param"] == "echo"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model="m", prompt=["one", "two"])
    assert caught.value.body["param"] == "prompt"  # type: ignore[index]
    not_json = httpx.post(
        f"{orphan_sidecar.openai_base_url}/chat/completions",
        content=b"{nope",
        headers={"authorization": f"Bearer {API_KEY}", "content-type": "application/json"},
        timeout=10,
    )
    assert not_json.status_code == 400 and "error" in not_json.json()


def test_malformed_model_ids_are_404_model_not_found(orphan_sidecar: Sidecar) -> None:
    with pytest.raises(openai.NotFoundError) as caught:
        client(orphan_sidecar).chat.completions.create(
            model="run@latest", messages=[{"role": "user", "content": "x"}]
        )
    assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]


def test_unreachable_server_is_503_that_openai_retries(orphan_sidecar: Sidecar) -> None:
    with pytest.raises(openai.APIStatusError) as caught:
        client(orphan_sidecar).chat.completions.create(model="m", messages=[{"role": "user", "content": "x"}])
    assert caught.value.status_code == 503
    assert caught.value.response.headers["x-should-retry"] == "true"
    before = requests_counted(orphan_sidecar, "/v1/models", 503)
    with pytest.raises(openai.InternalServerError):
        client(orphan_sidecar, max_retries=1).models.list()
    # The openai client honoured x-should-retry: the sidecar saw the request and its retry.
    assert requests_counted(orphan_sidecar, "/v1/models", 503) == before + 2
    health = httpx.get(f"{orphan_sidecar.base_url}/health", timeout=30)
    assert health.status_code == 503 and health.json()["status"] == "unavailable"


def test_metrics_count_requests_errors_and_latency(orphan_sidecar: Sidecar) -> None:
    with pytest.raises(openai.BadRequestError):
        client(orphan_sidecar).chat.completions.create(model="m", messages=[], n=1)
    text = orphan_sidecar.metrics()
    assert requests_counted(orphan_sidecar, "/v1/chat/completions", 400) >= 1
    assert re.search(r'tinkerrpc_sidecar_errors_total\{status="400"\} [1-9]', text)
    assert re.search(
        r'tinkerrpc_sidecar_request_duration_seconds_count\{route="/v1/chat/completions"\} [1-9]', text
    )
    assert "# TYPE tinkerrpc_sidecar_generated_tokens_total counter" in text
    unknown = httpx.get(
        f"{orphan_sidecar.base_url}/v1/nowhere", headers={"authorization": f"Bearer {API_KEY}"}
    )
    assert unknown.status_code == 404 and unknown.json()["error"]["code"] == "not_found"


async def test_serve_sidecar_runs_on_a_host_loop_until_stopped() -> None:
    """The form `tinkerrpc serve --sidecar-port` uses: no signal handling of its own, stops on an event."""
    sock = listen("127.0.0.1", 0)
    port = bound_port(sock)
    stop = asyncio.Event()
    upstream = GrpcUpstream(f"127.0.0.1:{free_port()}")
    serving = asyncio.create_task(serve_sidecar(upstream, sock, None, stop))
    async with httpx.AsyncClient(base_url=f"http://127.0.0.1:{port}", timeout=5) as http:
        for _ in range(100):
            try:
                response = await http.get("/v1/models")
                break
            except httpx.TransportError:
                await asyncio.sleep(0.05)
        else:
            raise AssertionError("the hosted sidecar never answered")
    # No API key configured: the request is let through and fails only because no server is there.
    assert response.status_code == 503
    stop.set()
    await asyncio.wait_for(serving, timeout=30)
    with pytest.raises(httpx.TransportError):
        httpx.get(f"http://127.0.0.1:{port}/metrics", timeout=2)
