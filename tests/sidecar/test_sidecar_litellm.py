"""`litellm` with the `openai/` and `hosted_vllm/` prefixes against the real sidecar: the call shape is
accepted, the response parses in litellm, and a rollout from it trains token-exact.

Where litellm leaves each choice's unknown fields (`token_ids`, `policy_version`) depends on its version
and prefix: on the choice itself (recent versions, `openai/`) or in `choice.provider_specific_fields`
(`hosted_vllm/`, and `openai/` up to at least 1.82). The response's `prompt_token_ids` stays in place. `Trajectory.from_openai` reads litellm's responses as
they are, wherever the fields landed.
litellm's streams keep none of the RL fields, whatever the prefix.
"""

from __future__ import annotations

import json
import os
from typing import Any

import httpx
import pytest
from sidecar_support import ANSWER, API_KEY, QUESTION, TOOL_RESULT, WEATHER_TOOL, Stack

import tinkerrpc

# litellm downloads its model price list at import unless told to use the bundled copy.
os.environ.setdefault("LITELLM_LOCAL_MODEL_COST_MAP", "True")
import litellm

pytestmark = pytest.mark.ecosystem

USER = [{"role": "user", "content": "Is the sky blue?"}]


def test_litellm_openai_prefix_rollout_trains_token_exact(stack: Stack) -> None:
    model = stack.client.create_model("litellm", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    options: dict[str, Any] = {"api_base": stack.sidecar.openai_base_url, "api_key": API_KEY}
    request: dict[str, Any] = {"model": "openai/litellm", "messages": USER, "max_tokens": 5, **options}
    plain = stack.openai().chat.completions.create(
        model="litellm",
        messages=USER,  # type: ignore[arg-type]
        max_tokens=5,
        seed=1,
        logprobs=True,
    )
    response = litellm.completion(**request, logprobs=True, seed=1)
    (choice,) = response.choices
    assert choice.message.content == plain.choices[0].message.content
    trajectory = tinkerrpc.Trajectory.from_openai(USER, response, reward=1.0)
    (turn,) = trajectory.turns
    assert list(turn.completion_token_ids) == (plain.choices[0].model_extra or {})["token_ids"]
    assert list(turn.prompt_token_ids) == (plain.model_extra or {})["prompt_token_ids"]
    streamed = "".join(
        chunk.choices[0].delta.content or "" for chunk in litellm.completion(**request, seed=1, stream=True)
    )
    assert streamed == choice.message.content
    other = tinkerrpc.Trajectory.from_openai(USER, litellm.completion(**request, logprobs=True, seed=2))
    result = model.train([tinkerrpc.TrajectoryGroup([trajectory, other])], learning_rate=1e-3)
    assert result.policy_version == 1 and result.metrics.trajectories_used == 2


def test_litellm_hosted_vllm_prefix_rollout_trains_token_exact(stack: Stack) -> None:
    model = stack.client.create_model("litellm-vllm", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    request: dict[str, Any] = {
        "model": "hosted_vllm/litellm-vllm",
        "messages": USER,
        "max_tokens": 5,
        "api_base": stack.sidecar.openai_base_url,
        "api_key": API_KEY,
        "logprobs": True,
        # vLLM's own flag reaches the sidecar through extra_body.
        "extra_body": {"return_token_ids": True},
    }
    trajectories = []
    for seed in (1, 2):
        plain = stack.openai().chat.completions.create(
            model="litellm-vllm",
            messages=USER,  # type: ignore[arg-type]
            max_tokens=5,
            seed=seed,
            logprobs=True,
        )
        response = litellm.completion(**request, seed=seed)
        (choice,) = response.choices
        assert choice.message.content == plain.choices[0].message.content
        fields = choice.provider_specific_fields
        assert fields["token_ids"] == (plain.choices[0].model_extra or {})["token_ids"]
        assert fields["policy_version"] == 0
        trajectory = tinkerrpc.Trajectory.from_openai(USER, response, reward=float(seed))
        (turn,) = trajectory.turns
        assert list(turn.completion_token_ids) == fields["token_ids"]
        assert list(turn.prompt_token_ids) == (plain.model_extra or {})["prompt_token_ids"]
        trajectories.append(trajectory)
    streamed = "".join(
        chunk.choices[0].delta.content or "" for chunk in litellm.completion(**request, seed=2, stream=True)
    )
    assert streamed == trajectories[1].messages[-1].content
    result = model.train([tinkerrpc.TrajectoryGroup(trajectories)], learning_rate=1e-3)
    assert result.policy_version == 1 and result.metrics.trajectories_used == 2


def test_assistant_messages_echoed_as_litellm_returns_them_are_accepted(stack: Stack) -> None:
    """litellm's Message adds `provider_specific_fields` (where it keeps the RL fields), and on other
    providers `thinking_blocks`, `images` and tool calls' own `provider_specific_fields`; echoed back,
    they are accepted and leave the prompt as the plain message renders it."""
    stack.client.create_model("litellm-echo", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    options: dict[str, Any] = {"api_base": stack.sidecar.openai_base_url, "api_key": API_KEY}
    request: dict[str, Any] = {"model": "hosted_vllm/litellm-echo", "max_tokens": 3, "seed": 1, **options}
    first = litellm.completion(**request, messages=USER, extra_body={"return_token_ids": True})
    echoed = first.choices[0].message
    assert echoed.provider_specific_fields, echoed
    follow_up = {"role": "user", "content": "Why?"}
    # The client path: litellm sends its own Message back.
    again = litellm.completion(**request, messages=[*USER, echoed, follow_up])
    assert again.choices[0].message.content is not None

    call = {"id": "call_0", "type": "function", "function": {"name": "get_weather", "arguments": "{}"}}
    plain_turn = {"role": "assistant", "content": echoed.content, "tool_calls": [call]}
    litellm_turn = {
        **echoed.model_dump(),
        "tool_calls": [{**call, "provider_specific_fields": {"thought_signature": "c2ln"}}],
        "thinking_blocks": None,
        "images": [],
    }
    tool_result = {"role": "tool", "tool_call_id": "call_0", "content": "sunny"}

    def prompt_token_ids(assistant_turn: dict[str, Any]) -> list[int]:
        body = {
            "model": "litellm-echo",
            "messages": [*USER, assistant_turn, tool_result],
            "tools": [WEATHER_TOOL],
            "max_tokens": 1,
        }
        answer = httpx.post(
            f"{stack.sidecar.openai_base_url}/chat/completions",
            content=json.dumps(body).encode(),
            headers={"authorization": f"Bearer {API_KEY}", "content-type": "application/json"},
            timeout=60,
        )
        assert answer.status_code == 200, answer.text
        ids: list[int] = answer.json()["prompt_token_ids"]
        return ids

    assert "provider_specific_fields" in litellm_turn
    assert prompt_token_ids(litellm_turn) == prompt_token_ids(plain_turn)


@pytest.mark.parametrize("prefix", ["openai", "hosted_vllm"])
def test_litellm_tool_round_trip_trains_token_exact(stack: Stack, tool_agent: str, prefix: str) -> None:
    """The model is asked with a tool through litellm, its call and the tool's result go back as litellm
    returns them, and Trajectory.from_openai reads litellm's own responses (RL fields wherever litellm put
    them) into a rollout whose turns hold exactly the sidecar's tokens and logprobs, and that trains."""
    name, version = tool_agent.split("@")
    request: dict[str, Any] = {
        "model": f"{prefix}/{tool_agent}",
        "tools": [WEATHER_TOOL],
        "temperature": 0,
        "max_tokens": 40,
        "logprobs": True,
        "api_base": stack.sidecar.openai_base_url,
        "api_key": API_KEY,
        "extra_body": {"return_token_ids": True},
    }
    first = litellm.completion(**request, messages=[QUESTION])
    (call,) = first.choices[0].message.tool_calls or []
    tool_message = {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT}
    history = [QUESTION, first.choices[0].message, tool_message]
    second = litellm.completion(**request, messages=history)
    rollout = (
        tinkerrpc.Trajectory.from_openai([QUESTION], first, reward=1.0, tools=[WEATHER_TOOL])
        .add_messages(tool_message)
        .add_openai(second)
    )
    assert rollout.messages[-1].content == ANSWER

    # The same two calls through the plain openai client: the sidecar's own RL fields.
    api = stack.openai()
    plain_history = [QUESTION, first.choices[0].message.model_dump(exclude_none=True), tool_message]
    for turn, messages in zip(rollout.turns, ([QUESTION], plain_history), strict=True):
        plain = api.chat.completions.create(
            model=tool_agent,
            messages=messages,
            tools=[WEATHER_TOOL],  # type: ignore[list-item]
            temperature=0,
            max_tokens=40,
            logprobs=True,
        )
        (plain_choice,) = plain.choices
        assert plain_choice.logprobs is not None
        assert list(turn.completion_token_ids) == (plain_choice.model_extra or {})["token_ids"]
        assert list(turn.prompt_token_ids) == (plain.model_extra or {})["prompt_token_ids"]
        assert list(turn.logprobs) == [entry.logprob for entry in plain_choice.logprobs.content or []]
        assert turn.policy_version == int(version)

    other = tinkerrpc.Trajectory.from_openai(
        [QUESTION], litellm.completion(**request, messages=[QUESTION], tool_choice="none"), reward=0.0
    )
    result = stack.client.model(name).train([tinkerrpc.TrajectoryGroup([rollout, other])], learning_rate=1e-4)
    assert result.metrics.trajectories_used == 2 and result.policy_version > int(version)
    # Every token trained is one of the sampled sequences': one datum per turn, nothing re-scored.
    sequence_lengths = [
        len(t.prompt_token_ids) + len(t.completion_token_ids) for t in (*rollout.turns, *other.turns)
    ]
    assert result.metrics.total_tokens == sum(sequence_lengths)
    assert result.metrics.scored_tokens == 0
