"""The official `openai` client against the real sidecar in front of the real `tinkerrpc serve`."""

from __future__ import annotations

import asyncio
import json
from typing import Any

import httpx
import openai
import pytest
from openai.types.chat import ChatCompletion
from sidecar_support import Stack

import tinkerrpc

pytestmark = pytest.mark.process

USER = [{"role": "user", "content": "Is the sky blue?"}]
WEATHER_TOOL = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}


@pytest.fixture(scope="module")
def chat_model(stack: Stack) -> str:
    """A model that is never trained, so its version stays 0 throughout this module."""
    stack.client.create_model("chat", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    return "chat"


def extra(response: Any, name: str) -> Any:
    """An RL extension field the openai client keeps on its response objects."""
    return response.model_extra[name]


def test_health_is_ok_while_the_server_serves(stack: Stack) -> None:
    response = httpx.get(f"{stack.sidecar.base_url}/health", timeout=30)
    assert (response.status_code, response.json()) == (200, {"status": "ok"})


def test_chat_completion_carries_tokens_logprobs_and_version(stack: Stack, chat_model: str) -> None:
    completion = stack.openai().chat.completions.create(
        model=chat_model, messages=USER, max_tokens=6, logprobs=True, top_logprobs=3, seed=1
    )
    assert completion.id.startswith("chatcmpl-") and completion.object == "chat.completion"
    assert completion.model == "chat@0" and extra(completion, "policy_version") == 0
    (choice,) = completion.choices
    token_ids = extra(choice, "token_ids")
    assert choice.finish_reason in ("stop", "length") and len(token_ids) >= 1
    assert completion.usage is not None
    assert completion.usage.completion_tokens == len(token_ids)
    assert completion.usage.prompt_tokens == len(extra(completion, "prompt_token_ids"))
    assert choice.logprobs is not None and choice.logprobs.content is not None
    entries = choice.logprobs.content
    assert len(entries) == len(token_ids)
    for entry in entries:
        assert len(entry.top_logprobs) == 3
        alternatives = [alt.logprob for alt in entry.top_logprobs]
        assert alternatives == sorted(alternatives, reverse=True)
        # The most likely token is at least as likely as the one sampled.
        assert entry.logprob <= alternatives[0] + 1e-5
        assert entry.bytes == list(entry.token.encode())
    # The message text is what the sampled tokens spell (the tiny model rarely stops early).
    if choice.finish_reason == "length":
        assert choice.message.content == "".join(e.token for e in entries)


def test_logprob_tokens_as_token_ids(stack: Stack, chat_model: str) -> None:
    completion = stack.openai().chat.completions.create(
        model=chat_model,
        messages=USER,
        max_tokens=4,
        logprobs=True,
        top_logprobs=1,
        extra_body={"return_tokens_as_token_ids": True},
    )
    choice = completion.choices[0]
    assert choice.logprobs is not None and choice.logprobs.content is not None
    assert [e.token for e in choice.logprobs.content] == [f"token_id:{t}" for t in extra(choice, "token_ids")]


def test_seed_reproduces_and_n_gives_distinct_indexed_choices(stack: Stack, chat_model: str) -> None:
    api = stack.openai()

    def sample(seed: int) -> list[list[int]]:
        completion = api.chat.completions.create(
            model=chat_model, messages=USER, max_tokens=8, n=3, seed=seed
        )
        assert [c.index for c in completion.choices] == [0, 1, 2]
        return [extra(c, "token_ids") for c in completion.choices]

    first = sample(7)
    assert sample(7) == first
    assert sample(8) != first
    assert len({tuple(ids) for ids in first}) > 1


async def test_async_client_concurrent_requests(stack: Stack, chat_model: str) -> None:
    api = stack.async_openai()
    completions = await asyncio.gather(
        *(
            api.chat.completions.create(model=chat_model, messages=USER, max_tokens=5, n=2, seed=s)
            for s in range(4)
        )
    )
    await api.close()
    assert all(c.model == "chat@0" and len(c.choices) == 2 for c in completions)
    assert len({c.id for c in completions}) == 4


def test_stream_reassembles_to_the_same_completion(stack: Stack, chat_model: str) -> None:
    api = stack.openai()
    request: dict[str, Any] = {"model": chat_model, "messages": USER, "max_tokens": 8, "n": 2, "seed": 21}
    plain = api.chat.completions.create(**request, logprobs=True)
    stream = api.chat.completions.create(
        **request, logprobs=True, stream=True, stream_options={"include_usage": True}
    )
    content = {0: "", 1: ""}
    token_ids: dict[int, list[int]] = {0: [], 1: []}
    logprobs: dict[int, list[float]] = {0: [], 1: []}
    finish: dict[int, str | None] = {}
    usage = None
    order: list[int] = []
    for chunk in stream:
        assert chunk.model == "chat@0"
        if not chunk.choices:
            usage = chunk.usage
            continue
        for choice in chunk.choices:
            order.append(choice.index)
            content[choice.index] += choice.delta.content or ""
            # With logprobs asked, each delta carries the token ids it was made of.
            token_ids[choice.index] += (choice.delta.model_extra or {}).get("token_ids", [])
            if choice.logprobs and choice.logprobs.content:
                logprobs[choice.index] += [e.logprob for e in choice.logprobs.content]
            if choice.finish_reason:
                finish[choice.index] = choice.finish_reason
    assert order[:4] == [0, 1, 0, 1]  # interleaved by index
    for choice in plain.choices:
        assert content[choice.index] == (choice.message.content or "")
        assert token_ids[choice.index] == extra(choice, "token_ids")
        assert choice.logprobs is not None and choice.logprobs.content is not None
        assert logprobs[choice.index] == [e.logprob for e in choice.logprobs.content]
        assert finish[choice.index] == choice.finish_reason
    assert usage == plain.usage


def test_stop_string_ends_the_completion_before_it(stack: Stack, chat_model: str) -> None:
    api = stack.openai()
    request: dict[str, Any] = {
        "model": chat_model,
        "messages": USER,
        "max_tokens": 12,
        "seed": 5,
        "temperature": 1.0,
    }
    free = api.chat.completions.create(**request)
    free_ids = extra(free.choices[0], "token_ids")
    text = free.choices[0].message.content or ""
    # A stop string taken from the middle of the free completion.
    stop = next(
        text[i : i + 2] for i in range(len(text) // 2, len(text)) if text[i : i + 2].strip() and i > 0
    )
    stopped = api.chat.completions.create(**request, stop=[stop])
    choice = stopped.choices[0]
    assert choice.finish_reason == "stop"
    assert choice.message.content == text[: text.find(stop)]
    ids = extra(choice, "token_ids")
    assert ids == free_ids[: len(ids)] and len(ids) < len(free_ids)


def test_models_and_pinned_versions_after_training(stack: Stack) -> None:
    model = stack.client.create_model("pinned", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    api = stack.openai()
    request: dict[str, Any] = {"messages": USER, "max_tokens": 8, "seed": 3}
    before = extra(api.chat.completions.create(model="pinned", **request).choices[0], "token_ids")
    conversation = [*USER, {"role": "assistant", "content": "yes"}]
    assert model.train_supervised([conversation], learning_rate=5e-2).policy_version == 1

    cards = {m.id: m for m in api.models.list().data}
    assert {"pinned", "pinned@0", "pinned@1"} <= set(cards)
    latest, old = cards["pinned"], cards["pinned@0"]
    assert (latest.owned_by, extra(latest, "parent"), extra(latest, "policy_version")) == (
        "tinkerrpc",
        "tinkerrpc/tiny-chat",
        1,
    )
    assert (extra(old, "parent"), extra(old, "policy_version")) == ("pinned", 0)
    assert latest.created == int(model.info().create_time.timestamp())  # type: ignore[union-attr]
    assert api.models.retrieve("pinned@1").id == "pinned@1"

    latest_completion = api.chat.completions.create(model="pinned", **request)
    assert latest_completion.model == "pinned@1" and extra(latest_completion, "policy_version") == 1
    pinned = api.chat.completions.create(model="pinned@0", **request)
    assert pinned.model == "pinned@0" and extra(pinned.choices[0], "policy_version") == 0
    # The pinned version still samples exactly what it sampled before training.
    assert extra(pinned.choices[0], "token_ids") == before
    assert extra(latest_completion.choices[0], "token_ids") != before

    for missing in ("pinned@9", "no-such-model"):
        with pytest.raises(openai.NotFoundError) as caught:
            api.chat.completions.create(model=missing, **request)
        assert caught.value.body["code"] == "model_not_found"  # type: ignore[index]
        assert caught.value.response.headers["x-should-retry"] == "false"
    with pytest.raises(openai.NotFoundError):
        api.models.retrieve("pinned@9")


def test_legacy_completions_with_text_and_token_prompts(stack: Stack, chat_model: str) -> None:
    api = stack.openai()
    text = api.completions.create(model=chat_model, prompt="The sky is", max_tokens=5, logprobs=2, seed=4)
    assert text.object == "text_completion" and text.model == "chat@0"
    prompt_ids = extra(text, "prompt_token_ids")
    choice = text.choices[0]
    assert choice.logprobs is not None
    tokens = choice.logprobs.tokens or []
    assert len(tokens) == len(extra(choice, "token_ids")) == len(choice.logprobs.token_logprobs or [])
    assert all(len(top) <= 2 for top in choice.logprobs.top_logprobs or [])
    if choice.finish_reason == "length":
        assert choice.text == "".join(tokens)
    # The same prompt as token ids samples the same tokens with the same seed.
    by_ids = api.completions.create(model=chat_model, prompt=prompt_ids, max_tokens=5, seed=4)
    assert extra(by_ids, "prompt_token_ids") == prompt_ids
    assert extra(by_ids.choices[0], "token_ids") == extra(choice, "token_ids")
    streamed = api.completions.create(
        model=chat_model,
        prompt=prompt_ids,
        max_tokens=5,
        seed=4,
        stream=True,
        stream_options={"include_usage": True},
    )
    chunks = list(streamed)
    assert "".join(c.choices[0].text for c in chunks if c.choices) == by_ids.choices[0].text
    assert chunks[-1].usage is not None and chunks[-1].usage.completion_tokens == len(
        extra(choice, "token_ids")
    )


def test_server_side_rejections_become_400_naming_the_parameter(stack: Stack, chat_model: str) -> None:
    with pytest.raises(openai.BadRequestError) as caught:
        stack.openai().completions.create(model=chat_model, prompt=[10**6], max_tokens=2)
    assert caught.value.body["param"] == "prompt"  # type: ignore[index]
    assert caught.value.response.headers["x-should-retry"] == "false"


def test_tool_messages_and_tools_reach_the_renderer(stack: Stack, chat_model: str) -> None:
    messages = [
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": None,
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": json.dumps({"city": "Paris"})},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny, 21 C"},
    ]
    api = stack.openai()
    with_tools = api.chat.completions.create(
        model=chat_model,
        messages=messages,
        tools=[WEATHER_TOOL],
        tool_choice="auto",
        max_tokens=3,
        logprobs=True,
    )
    prompt_ids = extra(with_tools, "prompt_token_ids")
    # The sidecar's prompt is exactly what the SDK's own Sample renders for the same conversation.
    direct = stack.client.model(chat_model).sample(messages, tools=[WEATHER_TOOL], max_tokens=1)
    assert list(direct[0].prompt_token_ids) == prompt_ids
    # Withholding the tools, or dropping the tool call, renders a different (shorter) prompt.
    no_tools = api.chat.completions.create(
        model=chat_model, messages=messages, tool_choice="none", max_tokens=1
    )
    assert len(extra(no_tools, "prompt_token_ids")) < len(prompt_ids)
    no_call = [messages[0], {"role": "assistant", "content": ""}, {"role": "user", "content": "sunny, 21 C"}]
    without_call = api.chat.completions.create(
        model=chat_model, messages=no_call, tools=[WEATHER_TOOL], max_tokens=1
    )
    assert len(extra(without_call, "prompt_token_ids")) < len(prompt_ids)
    # The response is an assistant turn that the SDK turns into a trainable trajectory.
    trajectory = tinkerrpc.Trajectory.from_openai(messages, with_tools.model_dump(), tools=[WEATHER_TOOL])
    assert trajectory.messages[1].tool_calls[0].name == "get_weather"
    assert trajectory.turns[0].prompt_token_ids == tuple(prompt_ids)


async def test_rollouts_through_the_sidecar_train_the_next_version(stack: Stack) -> None:
    model = stack.client.create_model("rl", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    api = stack.async_openai()

    async def rollout(seed: int) -> ChatCompletion:
        return await api.chat.completions.create(
            model="rl", messages=USER, max_tokens=4, n=4, logprobs=True, seed=seed
        )

    completions = await asyncio.gather(rollout(1), rollout(2))
    groups = []
    for completion in completions:
        assert completion.model == "rl@0"
        trajectories = [
            # Reward: the number of distinct tokens, so every group has signal.
            tinkerrpc.Trajectory.from_openai(
                USER, completion, reward=float(len(set(extra(choice, "token_ids")))) + i, choice_index=i
            )
            for i, choice in enumerate(completion.choices)
        ]
        assert all(t.turns[0].policy_version == 0 for t in trajectories)
        groups.append(tinkerrpc.TrajectoryGroup(trajectories))
    result = await asyncio.to_thread(model.train, groups, learning_rate=1e-3)
    assert result.policy_version == 1 and result.metrics.trajectories_used == 8
    after = await rollout(3)
    await api.close()
    assert after.model == "rl@1" and extra(after, "policy_version") == 1
    assert all(extra(c, "policy_version") == 1 for c in after.choices)
    metrics = stack.sidecar.metrics()
    assert 'tinkerrpc_sidecar_requests_total{route="/v1/chat/completions",status="200"}' in metrics
    generated = float(
        metrics.split('tinkerrpc_sidecar_generated_tokens_total{route="/v1/chat/completions"} ')[1].split()[0]
    )
    assert generated >= 12


def test_choices_sampled_without_logprobs_train_with_no_scoring(stack: Stack) -> None:
    """The sidecar's every choice carries the sample key of the sampler's logprobs: a rollout that did
    not ask for logprobs (the same seed with logprobs=True draws the same tokens) trains on the
    server's copy of them, and Train scores nothing."""
    model = stack.client.create_model("keyed", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    api = stack.openai()
    request: dict[str, Any] = {"model": "keyed", "messages": USER, "max_tokens": 6, "n": 2, "seed": 7}
    plain = api.chat.completions.create(**request)
    shown = api.chat.completions.create(**request, logprobs=True)
    trajectories = [
        tinkerrpc.Trajectory.from_openai(USER, plain, reward=float(i), choice_index=i) for i in range(2)
    ]
    for i, trajectory in enumerate(trajectories):
        (turn,) = trajectory.turns
        assert plain.choices[i].logprobs is None and turn.logprobs == () and turn.sample_key
        assert turn.completion_token_ids == tuple(extra(shown.choices[i], "token_ids"))
        assert extra(shown.choices[i], "sample_key") != turn.sample_key  # one key per sample drawn
    result = model.train([tinkerrpc.TrajectoryGroup(trajectories)], learning_rate=1e-3)
    assert result.policy_version == 1 and result.metrics.scored_tokens == 0
