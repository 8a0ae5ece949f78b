"""`POST /inference/v1/generate` (vLLM's tokens-in, tokens-out route) against the real sidecar: the shape
the `renderers` client reads, the same tokens and logprobs as the Sample RPC, a rollout that trains on
its sample keys alone, and errors in OpenAI's JSON under the sidecar's key. The bad-input rows are in
test_sidecar_bad_input.py; verifiers' own client drives it in test_sidecar_verifiers.py."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from sidecar_support import API_KEY, Stack

import tinkerrpc

pytestmark = pytest.mark.process

GENERATE = "/inference/v1/generate"
MESSAGES = [{"role": "user", "content": "Is the sky blue?"}]


def generate(stack: Stack, body: dict[str, Any], key: str | None = API_KEY) -> httpx.Response:
    headers = {"authorization": f"Bearer {key}"} if key is not None else {}
    return httpx.post(f"{stack.sidecar.base_url}{GENERATE}", json=body, headers=headers, timeout=60)


def test_generate_returns_the_samples_tokens_and_logprobs_and_trains_on_their_keys(stack: Stack) -> None:
    model = stack.client.create_model("generate", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    (rendered,) = model.sample(MESSAGES, max_tokens=1)
    prompt = list(rendered.prompt_token_ids)
    params = {"n": 2, "max_tokens": 6, "seed": 3, "temperature": 1.0, "logprobs": 1, "prompt_logprobs": 0}
    answer = generate(
        stack, {"model": "generate@0", "token_ids": prompt, "sampling_params": params, "request_id": "r-1"}
    )
    assert answer.status_code == 200, answer.text
    body = answer.json()
    assert body["request_id"] == "r-1" and body["model"] == "generate@0" and body["policy_version"] == 0
    assert body["prompt_token_ids"] == prompt
    # vLLM's prompt_logprobs: nothing at position 0, then each prompt token's own logprob under its id.
    assert body["prompt_logprobs"][0] is None
    assert [list(entry) for entry in body["prompt_logprobs"][1:]] == [[str(t)] for t in prompt[1:]]

    # The Sample RPC with the same seed draws the same tokens, with the same logprobs (to float32
    # rounding: the two calls need not batch alike).
    expected = model.sample(prompt, n=2, max_tokens=6, seed=3, top_logprobs=1, policy_version=0)
    assert len(body["choices"]) == 2
    for index, (choice, sample) in enumerate(zip(body["choices"], expected, strict=True)):
        assert choice["index"] == index and choice["policy_version"] == 0 and choice["sample_key"]
        assert choice["token_ids"] == list(sample.tokens)
        assert choice["finish_reason"] == ("length" if sample.stop_reason == "length" else "stop")
        entries = choice["logprobs"]["content"]
        # What the renderers client checks: one entry per token, labelled `token_id:N`, finite.
        assert [e["token"] for e in entries] == [f"token_id:{t}" for t in sample.tokens]
        assert [e["logprob"] for e in entries] == pytest.approx(sample.logprobs, abs=1e-5)
        assert all(len(e["top_logprobs"]) == 1 for e in entries)
        assert all(e["top_logprobs"][0]["token"].startswith("token_id:") for e in entries)
    usage = body["usage"]
    assert usage["prompt_tokens"] == len(prompt)
    assert usage["completion_tokens"] == sum(len(c["token_ids"]) for c in body["choices"])

    # A rollout that kept only the tokens and each choice's sample key trains on the sampler's own
    # logprobs, which the server kept: nothing is scored.
    turns = [
        tinkerrpc.SampledTurn(prompt, choice["token_ids"], (), 0, choice["sample_key"])
        for choice in body["choices"]
    ]
    group = tinkerrpc.TrajectoryGroup(
        [tinkerrpc.Trajectory(turns=[turn], reward=float(i)) for i, turn in enumerate(turns)]
    )
    result = model.train([group], learning_rate=1e-3)
    assert result.policy_version == 1 and result.metrics.trajectories_used == 2
    assert result.metrics.scored_tokens == 0
    assert result.metrics.total_tokens == sum(len(prompt) + len(t.completion_token_ids) for t in turns)

    # Without a version the latest samples; without logprobs asked none come back (the keys still do).
    latest = generate(stack, {"model": "generate", "token_ids": prompt, "sampling_params": {"max_tokens": 2}})
    assert latest.status_code == 200, latest.text
    latest_body = latest.json()
    assert latest_body["model"] == "generate@1" and latest_body["policy_version"] == 1
    (choice,) = latest_body["choices"]
    assert choice["logprobs"] is None and choice["sample_key"] and choice["policy_version"] == 1
    assert latest_body["prompt_logprobs"] is None and latest_body["request_id"].startswith("gen-")


def test_generate_needs_the_key_and_answers_errors_in_openai_json(stack: Stack) -> None:
    stack.client.create_model("generate-errors", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    good = {"model": "generate-errors", "token_ids": [1, 2, 3], "sampling_params": {"max_tokens": 1}}
    for key in (None, "sk-wrong"):
        refused = generate(stack, good, key=key)
        assert refused.status_code == 401, refused.text
        assert refused.json()["error"]["code"] == "invalid_api_key"
        assert refused.headers["www-authenticate"] == "Bearer"
    assert generate(stack, good).status_code == 200

    def refusal(body: dict[str, Any]) -> tuple[int, str | None, str]:
        answer = generate(stack, body)
        error = answer.json()["error"]
        assert set(error) == {"message", "type", "param", "code"}
        return answer.status_code, error["param"], error["message"]

    # Refused by the server (the sidecar knows no vocabulary or context): named as this route names them.
    status, param, message = refusal({**good, "token_ids": [1, 10**6]})
    assert (status, param) == (400, "token_ids") and "vocabulary" in message
    status, param, message = refusal({**good, "sampling_params": {"max_tokens": 10**6}})
    assert (status, param) == (400, "sampling_params.max_tokens"), message
    status, param, _ = refusal({**good, "model": "ghost"})
    assert (status, param) == (404, "model")
    # A path beside it names the served endpoints, this one among them.
    other = httpx.post(
        f"{stack.sidecar.base_url}/inference/v1/other",
        json=good,
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert other.status_code == 404 and "POST /inference/v1/generate" in other.json()["error"]["message"]
