"""What an RL framework's rollout worker sends to a vLLM server (verl, OpenRLHF, SkyRL: a plain HTTP
POST, vLLM's sampling extras beside OpenAI's), against the real sidecar: accepted, the answer parses
(as a dict, and as `openai`'s types), and its rollouts train token-exact."""

from __future__ import annotations

from typing import Any

import httpx
import pytest
from openai.types import Completion
from openai.types.chat import ChatCompletion
from sidecar_support import API_KEY, Stack

import tinkerrpc

pytestmark = pytest.mark.process

MESSAGES = [{"role": "system", "content": "Answer briefly."}, {"role": "user", "content": "Is the sky blue?"}]
# Every extra the sidecar takes with vLLM's meaning (penalties only at their neutral values).
VLLM_EXTRAS: dict[str, Any] = {
    "return_token_ids": True,
    "logprobs": True,
    "top_logprobs": 2,
    "n": 2,
    "seed": 7,
    "stop": ["\n\n"],
    "stop_token_ids": [],
    "top_k": -1,
    "ignore_eos": False,
    "repetition_penalty": 1.0,
    "presence_penalty": 0.0,
    "frequency_penalty": 0.0,
    "min_tokens": 2,
    "skip_special_tokens": True,
    "spaces_between_special_tokens": True,
    "include_stop_str_in_output": False,
    "chat_template_kwargs": {"enable_thinking": False},
}


def post(stack: Stack, path: str, body: dict[str, Any]) -> dict[str, Any]:
    response = httpx.post(
        f"{stack.sidecar.openai_base_url}/{path}",
        json=body,
        headers={"Authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert response.status_code == 200, response.text
    answer: dict[str, Any] = response.json()
    return answer


def test_vllm_style_rollout_request_trains_token_exact(stack: Stack) -> None:
    model = stack.client.create_model("vllm-client", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    request = {
        "model": "vllm-client",
        "messages": MESSAGES,
        "max_tokens": 8,
        "temperature": 1.0,
        "top_p": 1.0,
        **VLLM_EXTRAS,
    }
    body = post(stack, "chat/completions", request)
    ChatCompletion.model_validate(body)
    assert body["policy_version"] == 0 and body["prompt_token_ids"]
    assert len(body["choices"]) == 2
    for choice in body["choices"]:
        entries = choice["logprobs"]["content"]
        assert len(entries) == len(choice["token_ids"]) >= VLLM_EXTRAS["min_tokens"]
        assert choice["policy_version"] == 0
        assert all(len(entry["top_logprobs"]) == 2 for entry in entries)
        assert "\n\n" not in choice["message"]["content"] and choice["finish_reason"] in ("stop", "length")
    # The seed makes the rollout reproducible: the same request samples the same tokens.
    again = post(stack, "chat/completions", request)
    assert [c["token_ids"] for c in again["choices"]] == [c["token_ids"] for c in body["choices"]]

    trajectories = [
        tinkerrpc.Trajectory.from_openai(MESSAGES, body, reward=float(index), choice_index=index)
        for index in range(2)
    ]
    for trajectory, choice in zip(trajectories, body["choices"], strict=True):
        (turn,) = trajectory.turns
        assert list(turn.completion_token_ids) == choice["token_ids"]
        assert list(turn.prompt_token_ids) == body["prompt_token_ids"]
        assert list(turn.logprobs) == [entry["logprob"] for entry in choice["logprobs"]["content"]]

    # Workers that render prompts themselves send token ids to the completions endpoint.
    legacy = post(
        stack,
        "completions",
        {
            "model": "vllm-client",
            "prompt": body["prompt_token_ids"],
            "max_tokens": 4,
            "logprobs": 1,
            "return_token_ids": True,
            "seed": 7,
        },
    )
    Completion.model_validate(legacy)
    assert legacy["prompt_token_ids"] == body["prompt_token_ids"]
    (legacy_choice,) = legacy["choices"]
    assert len(legacy_choice["token_ids"]) == len(legacy_choice["logprobs"]["token_logprobs"])

    result = model.train([tinkerrpc.TrajectoryGroup(trajectories)], learning_rate=1e-3)
    assert result.policy_version == 1 and result.metrics.trajectories_used == 2
