"""The engine's token stream (routes/streaming.py, an extension beside Tinker's API) on a real engine:
tokens arrive as they are sampled, join to the result asample would give, need the engine's key, and a
reader that leaves frees its rows at once."""

from __future__ import annotations

import json
import time
from typing import Any

import httpx
import pytest
from engine_proc import TINY
from tinker import types

from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.token_stream_wire import SAMPLE_STREAM_PATH

pytestmark = pytest.mark.process


def _request(max_tokens: int, **extra: Any) -> dict[str, Any]:
    request = types.SampleRequest(
        num_samples=extra.pop("num_samples", 1),
        prompt=types.ModelInput.from_ints([1, 2, 3, 4, 5]),
        sampling_params=types.SamplingParams(max_tokens=max_tokens, stop=[], seed=7),
        base_model=TINY,
        **extra,
    )
    return request.model_dump(mode="json")


def _stats(engine: LocalEngine) -> dict[str, Any]:
    answer = httpx.get(f"{engine.base_url}/api/v1/debug/stats", headers=engine.auth_headers, timeout=30)
    answer.raise_for_status()
    stats: dict[str, int] = answer.json()
    return stats


def test_tokens_stream_as_sampled_and_join_to_the_result(engine: LocalEngine) -> None:
    lines: list[tuple[float, dict[str, Any]]] = []
    with httpx.stream(
        "POST",
        engine.base_url + SAMPLE_STREAM_PATH,
        json=_request(48, num_samples=2, topk_sample_logprobs=3),
        headers=engine.auth_headers,
        timeout=120,
    ) as answer:
        assert answer.status_code == 200
        assert answer.headers["content-type"].startswith("application/x-ndjson")
        for line in answer.iter_lines():
            lines.append((time.perf_counter(), json.loads(line)))
    *token_lines, (_, last) = lines
    assert len(token_lines) > 4, "the tokens came in one piece"
    done = last["done"]
    streamed: dict[int, list[dict[str, Any]]] = {0: [], 1: []}
    for _, line in token_lines:
        for event in line["tokens"]:
            streamed[event["sample"]].append(event)
    for index, sequence in enumerate(done["sequences"]):
        events = streamed[index]
        assert [e["token"] for e in events] == sequence["tokens"]
        assert [e["logprob"] for e in events] == pytest.approx(sequence["logprobs"])
        assert all(len(e["top"][0]) == 3 == len(e["top"][1]) for e in events)
        assert [e["stop_reason"] for e in events] == [None] * 47 + ["length"]
        assert sequence["stop_reason"] == "length"


def test_the_stream_needs_the_engine_key(engine: LocalEngine) -> None:
    answer = httpx.post(engine.base_url + SAMPLE_STREAM_PATH, json=_request(4), timeout=30)
    assert answer.status_code == 401


def test_a_bad_request_is_refused_before_the_stream(engine: LocalEngine) -> None:
    answer = httpx.post(
        engine.base_url + SAMPLE_STREAM_PATH,
        json=_request(4, topk_sample_logprobs=10**6),
        headers=engine.auth_headers,
        timeout=30,
    )
    assert answer.status_code == 400
    assert "topk_sample_logprobs" in answer.json()["detail"]


def test_a_reader_that_leaves_frees_its_rows(engine: LocalEngine) -> None:
    before = _stats(engine)
    with httpx.stream(
        "POST",
        engine.base_url + SAMPLE_STREAM_PATH,
        json=_request(1500),
        headers=engine.auth_headers,
        timeout=120,
    ) as answer:
        lines = answer.iter_lines()
        next(lines)
        next(lines)
        assert _stats(engine)["decoding_rows"] == {TINY: 1}
    deadline = time.monotonic() + 10
    while (stats := _stats(engine))["decoding_rows"] and time.monotonic() < deadline:
        time.sleep(0.05)
    assert stats["decoding_rows"] == {}
    assert stats["abandoned_sample_requests"] == before["abandoned_sample_requests"] + 1
    # Nothing decodes for it any more: far fewer steps than its 1500 tokens.
    time.sleep(0.5)
    assert _stats(engine)["decode_steps"] - before["decode_steps"] < 750
