"""What OpenAI-speaking RL and agent code sends, through the official `openai` client (sync, async
and streamed) against the real sidecar: chat and legacy completions, the Responses API, vLLM's RL
request extras, echoed assistant messages, and rollouts from streams and Responses that train."""

from __future__ import annotations

from typing import Any

import httpx
import openai
import pytest
from sidecar_support import API_KEY, Stack

import tinkerrpc

pytestmark = pytest.mark.process

USER = [{"role": "user", "content": "Is the sky blue?"}]
WEATHER = {
    "name": "get_weather",
    "description": "Current weather in a city",
    "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
}
CHAT_TOOL = {"type": "function", "function": WEATHER}
RESPONSES_TOOL = {"type": "function", **WEATHER}
LOGPROBS = ["message.output_text.logprobs"]


@pytest.fixture(scope="module")
def compat_model(stack: Stack) -> str:
    """Never trained: its version stays 0 throughout this module."""
    stack.client.create_model("compat", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    return "compat"


@pytest.fixture(scope="module")
def api(stack: Stack) -> openai.OpenAI:
    return stack.openai()


def extra(response: Any, name: str) -> Any:
    return (response.model_extra or {}).get(name)


def test_returned_assistant_messages_can_be_sent_back_verbatim(api: openai.OpenAI, compat_model: str) -> None:
    first = api.chat.completions.create(model=compat_model, messages=USER, max_tokens=4, seed=1)
    echoed = first.choices[0].message.model_dump()
    assert {"annotations", "audio", "refusal", "function_call"} <= set(echoed)
    # vLLM's reasoning parsers return the thinking text under this name; clients echo it back too.
    echoed["reasoning_content"] = "The user asks about colour."
    history = [*USER, echoed, {"role": "user", "content": "Sure?"}]
    second = api.chat.completions.create(model=compat_model, messages=history, max_tokens=4, seed=1)
    # None of the echoed fields reaches the prompt: it equals the one of the plain message.
    plain = [*USER, {"role": "assistant", "content": echoed["content"]}, history[-1]]
    third = api.chat.completions.create(model=compat_model, messages=plain, max_tokens=4, seed=1)
    assert extra(second, "prompt_token_ids") == extra(third, "prompt_token_ids")
    with pytest.raises(openai.BadRequestError) as caught:
        api.chat.completions.create(
            model=compat_model,
            messages=[*USER, {**echoed, "function_call": {"name": "f", "arguments": "{}"}}],
            max_tokens=1,
        )
    assert caught.value.body["param"] == "messages[1].function_call"  # type: ignore[index]


def test_vllm_rl_extras(api: openai.OpenAI, compat_model: str) -> None:
    request: dict[str, Any] = {"model": compat_model, "messages": USER, "max_tokens": 4, "seed": 2}
    neutral = {"repetition_penalty": 1.0, "return_token_ids": True}
    with_ids = api.chat.completions.create(
        **request, frequency_penalty=0.0, presence_penalty=0.0, extra_body=neutral
    )
    assert extra(with_ids.choices[0], "token_ids") and extra(with_ids, "prompt_token_ids")
    without = api.chat.completions.create(**request, extra_body={"return_token_ids": False})
    assert without.choices[0].message.content == with_ids.choices[0].message.content
    assert extra(without, "prompt_token_ids") is None and extra(without, "policy_version") is None
    assert (
        extra(without.choices[0], "token_ids") is None and extra(without.choices[0], "policy_version") is None
    )
    legacy = api.completions.create(
        model=compat_model, prompt="The sky", max_tokens=3, extra_body={"return_token_ids": False}
    )
    assert extra(legacy, "prompt_token_ids") is None and extra(legacy.choices[0], "token_ids") is None
    for param, value in (("repetition_penalty", 1.2), ("frequency_penalty", 0.5), ("presence_penalty", -1.0)):
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(**request, extra_body={param: value})
        body = caught.value.body
        assert body["param"] == param and "Tinker's sampler has no" in body["message"]  # type: ignore[index]


def test_models_name_their_base_model_and_unknown_paths_name_the_endpoints(
    stack: Stack, api: openai.OpenAI, compat_model: str
) -> None:
    cards = {card.id: card for card in api.models.list().data}
    assert extra(cards[compat_model], "root") == "tinkerrpc/tiny-chat"
    assert extra(cards[f"{compat_model}@0"], "root") == "tinkerrpc/tiny-chat"
    unknown = httpx.post(
        f"{stack.sidecar.openai_base_url}/embeddings",
        json={},
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=10,
    )
    error = unknown.json()["error"]
    assert unknown.status_code == 404 and error["code"] == "not_found"
    assert "POST /v1/embeddings" in error["message"] and "POST /v1/responses" in error["message"]


async def test_chat_sync_async_and_stream_agree(stack: Stack, api: openai.OpenAI, compat_model: str) -> None:
    request: dict[str, Any] = {"model": compat_model, "messages": USER, "max_tokens": 6, "seed": 3}
    plain = api.chat.completions.create(**request)
    client = stack.async_openai()
    awaited = await client.chat.completions.create(**request)
    async_chunks = [chunk async for chunk in await client.chat.completions.create(**request, stream=True)]
    await client.close()
    chunks = list(api.chat.completions.create(**request, stream=True))
    content = plain.choices[0].message.content
    assert awaited.choices[0].message.content == content
    for streamed in (chunks, async_chunks):
        assert "".join(c.choices[0].delta.content or "" for c in streamed if c.choices) == content
    # Without logprobs or return_token_ids a stream is OpenAI-shaped: no RL fields.
    assert all(not c.model_extra and not any(ch.model_extra for ch in c.choices) for c in chunks)


def test_completions_stream_carries_the_rl_fields_when_asked(api: openai.OpenAI, compat_model: str) -> None:
    request: dict[str, Any] = {"model": compat_model, "prompt": "The sky is", "max_tokens": 5, "seed": 4}
    plain = api.completions.create(**request)
    chunks = list(api.completions.create(**request, stream=True, extra_body={"return_token_ids": True}))
    (first,) = chunks[0].choices
    # Each chunk carries its tokens' ids (vLLM's shape), the first the version and prompt, the last the key.
    streamed_ids = [t for c in chunks if c.choices for t in extra(c.choices[0], "token_ids") or []]
    assert streamed_ids == extra(plain.choices[0], "token_ids")
    assert extra(chunks[0], "prompt_token_ids") == extra(plain, "prompt_token_ids")
    assert extra(first, "policy_version") == extra(chunks[0], "policy_version") == 0
    assert extra(chunks[-1].choices[0], "sample_key")
    assert "".join(c.choices[0].text for c in chunks if c.choices) == plain.choices[0].text
    bare = list(api.completions.create(**request, stream=True))
    assert all(extra(c, "policy_version") is None and not c.choices[0].model_extra for c in bare)


async def test_responses_sync_async_and_input_forms(
    stack: Stack, api: openai.OpenAI, compat_model: str
) -> None:
    text = api.responses.create(
        model=compat_model, input="Is the sky blue?", max_output_tokens=5, extra_body={"seed": 5}
    )
    assert text.object == "response" and text.id.startswith("resp") and text.model == "compat@0"
    (message,) = text.output
    assert message.type == "message" and message.content[0].type == "output_text"
    assert text.output_text == message.content[0].text
    assert text.usage is not None and text.usage.output_tokens == len(extra(message, "token_ids"))
    if text.status == "incomplete":
        assert text.incomplete_details is not None and text.incomplete_details.reason == "max_output_tokens"
    # The same conversation as chat renders the same prompt: instructions are the system message,
    # a function_call item joins the assistant turn, a function_call_output is the tool message.
    chat_history = [
        {"role": "system", "content": "Be brief."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": "",
            "tool_calls": [
                {
                    "id": "call_1",
                    "type": "function",
                    "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
                }
            ],
        },
        {"role": "tool", "tool_call_id": "call_1", "content": "sunny"},
    ]
    items: list[Any] = [
        {"role": "user", "content": [{"type": "input_text", "text": "Weather in Paris?"}]},
        {
            "type": "function_call",
            "call_id": "call_1",
            "name": "get_weather",
            "arguments": '{"city": "Paris"}',
        },
        {"type": "function_call_output", "call_id": "call_1", "output": "sunny"},
    ]
    chat = api.chat.completions.create(
        model=compat_model, messages=chat_history, tools=[CHAT_TOOL], max_tokens=1
    )  # type: ignore[list-item]
    client = stack.async_openai()
    response = await client.responses.create(
        model=compat_model,
        instructions="Be brief.",
        input=items,
        tools=[RESPONSES_TOOL],  # type: ignore[list-item]
        tool_choice="auto",
        max_output_tokens=1,
        temperature=0.7,
        top_p=0.9,
        store=False,
    )
    assert extra(response.output[0], "prompt_token_ids") == extra(chat, "prompt_token_ids")
    no_tools = await client.responses.create(
        model=compat_model,
        instructions="Be brief.",
        input=items,
        tools=[RESPONSES_TOOL],
        tool_choice="none",
        max_output_tokens=1,  # type: ignore[list-item]
    )
    assert len(extra(no_tools.output[0], "prompt_token_ids")) < len(extra(chat, "prompt_token_ids"))
    # An earlier response's output, echoed back as input items, is accepted.
    followup = await client.responses.create(
        model=compat_model,
        input=[
            *items,
            *[item.model_dump() for item in response.output],
            {"role": "user", "content": "Thanks"},
        ],
        max_output_tokens=1,
    )
    assert followup.output
    await client.close()


def test_responses_refusals_name_the_parameter(api: openai.OpenAI, compat_model: str) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"previous_response_id": "resp_1"}, "previous_response_id"),
        ({"tool_choice": "required"}, "tool_choice"),
        ({"tools": [{"type": "web_search"}]}, "tools[0]"),
        ({"input": [{"type": "reasoning", "summary": []}]}, "input[0].type"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_image", "image_url": "x"}]}]},
            "input[0].content[0].type",
        ),
        ({"stream_options": {"mystery": 1}}, "stream_options.mystery"),
    ]
    for fields, param in cases:
        request: dict[str, Any] = {"model": compat_model, "input": "hi", **fields}
        with pytest.raises(openai.BadRequestError) as caught:
            api.responses.create(**request)
        assert caught.value.body["param"] == param, (fields, caught.value.body)  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        api.responses.create(model=compat_model, input="hi", previous_response_id="resp_1")
    assert "send the whole conversation as input" in caught.value.body["message"]  # type: ignore[index]


def test_responses_stream_follows_the_documented_event_sequence(
    api: openai.OpenAI, compat_model: str
) -> None:
    request: dict[str, Any] = {"model": compat_model, "input": "Is the sky blue?", "max_output_tokens": 6}
    plain = api.responses.create(**request, extra_body={"seed": 6})
    events = list(api.responses.create(**request, stream=True, include=LOGPROBS, extra_body={"seed": 6}))
    kinds = [e.type for e in events]
    ending = "response.completed" if plain.status == "completed" else "response.incomplete"
    deltas = kinds.count("response.output_text.delta")
    assert kinds == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.content_part.added",
        *["response.output_text.delta"] * deltas,
        "response.output_text.done",
        "response.content_part.done",
        "response.output_item.done",
        ending,
    ]
    assert [e.sequence_number for e in events] == list(range(len(events)))
    text = "".join(e.delta for e in events if e.type == "response.output_text.delta")
    assert text == plain.output_text
    final = events[-1].response  # type: ignore[union-attr]
    (item,) = final.output
    assert extra(item, "token_ids") == extra(plain.output[0], "token_ids")
    assert len(extra(item, "token_logprobs")) == len(extra(item, "token_ids"))
    # The helper stream parses the same events.
    with api.responses.stream(**request, extra_body={"seed": 6}) as stream:
        streamed = "".join(e.delta for e in stream if e.type == "response.output_text.delta")
    assert streamed == text


def test_responses_rollouts_train_token_exact(stack: Stack, api: openai.OpenAI) -> None:
    """(Streamed rollouts need an answer that ends by itself: see test_sidecar_tool_calls.py.)"""
    model = stack.client.create_model("compat-rl", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    chat_prompt = extra(
        api.chat.completions.create(model="compat-rl", messages=USER, max_tokens=1), "prompt_token_ids"
    )  # type: ignore[arg-type]
    trajectories = []
    for seed in (3, 4):
        response = api.responses.create(
            model="compat-rl", input=USER, max_output_tokens=5, include=LOGPROBS, extra_body={"seed": seed}
        )  # type: ignore[arg-type]
        trajectory = tinkerrpc.Trajectory.from_openai_response(USER, response, reward=float(seed))
        (turn,) = trajectory.turns
        assert list(turn.completion_token_ids) == extra(response.output[0], "token_ids")
        assert list(turn.prompt_token_ids) == chat_prompt and turn.policy_version == 0
        assert trajectory.messages[-1].content == response.output_text
        trajectories.append(trajectory)
    # Without logprobs asked, the turn names the server's copy of them by its sample key; a response
    # with neither is refused.
    unasked = api.responses.create(model="compat-rl", input=USER, max_output_tokens=2).model_dump()
    (keyed,) = tinkerrpc.Trajectory.from_openai_response(USER, unasked).turns
    assert keyed.logprobs == () and keyed.sample_key == unasked["output"][0]["sample_key"]
    for item in unasked["output"]:
        item["sample_key"] = None
    with pytest.raises(ValueError, match="include="):
        tinkerrpc.Trajectory.from_openai_response(USER, unasked)
    result = model.train([tinkerrpc.TrajectoryGroup(trajectories)], learning_rate=1e-3)
    assert result.policy_version == 1 and result.metrics.trajectories_used == 2
    after = api.responses.create(model="compat-rl", input="hi", max_output_tokens=2)
    assert after.model == "compat-rl@1" and extra(after.output[0], "policy_version") == 1
