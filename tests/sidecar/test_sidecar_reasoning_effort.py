"""`reasoning_effort` through a real sidecar and the openai client (issue 40 item 6): OpenAI's efforts
pick the renderer's thinking variant or not, an effort OpenAI does not take is a 400, and a renderer
without a thinking variant refuses thinking with a 400 naming the field the caller sent (the server's
own field is chat.enable_thinking)."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import openai
import pytest
from sidecar_support import Stack

pytestmark = pytest.mark.process

TINY = "tinkerrpc/tiny-chat"
MESSAGES = [{"role": "user", "content": "hi"}]
THINKING_EFFORTS = ("minimal", "low", "medium", "high")


@pytest.fixture(scope="module")
def thinking_model(stack: Stack) -> Iterator[str]:
    """tiny-chat with its default renderer, qwen3 (thinking, with qwen3_disable_thinking beside it)."""
    stack.client.create_model("effort-qwen3", base_model=TINY, lora_rank=8)
    yield "effort-qwen3"
    stack.client.delete_model("effort-qwen3")


@pytest.fixture(scope="module")
def plain_model(stack: Stack) -> Iterator[str]:
    """tiny-chat rendered by role_colon, a renderer with no thinking variant."""
    stack.client.create_model("effort-plain", base_model=TINY, lora_rank=8, renderer="role_colon")
    yield "effort-plain"
    stack.client.delete_model("effort-plain")


def prompt_ids(client: openai.OpenAI, model: str, **fields: Any) -> list[int]:
    completion = client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, **fields)
    ids: list[int] = completion.model_extra["prompt_token_ids"]
    return ids


def refusal(client: openai.OpenAI, model: str, **fields: Any) -> openai.BadRequestError:
    with pytest.raises(openai.BadRequestError) as caught:
        client.chat.completions.create(model=model, messages=MESSAGES, max_tokens=1, **fields)
    assert caught.value.status_code == 400
    return caught.value


def test_each_openai_effort_picks_the_thinking_variant_or_not(stack: Stack, thinking_model: str) -> None:
    client = stack.openai()
    thinking_off = prompt_ids(
        client, thinking_model, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    thinking_on = prompt_ids(
        client, thinking_model, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    assert thinking_off != thinking_on  # qwen3_disable_thinking writes the empty think block into the prompt
    assert prompt_ids(client, thinking_model, reasoning_effort="none") == thinking_off
    for effort in THINKING_EFFORTS:
        assert prompt_ids(client, thinking_model, reasoning_effort=effort) == thinking_on, effort


def test_an_effort_openai_does_not_take_is_a_400_naming_reasoning_effort(
    stack: Stack, thinking_model: str
) -> None:
    error = refusal(stack.openai(), thinking_model, reasoning_effort="extreme")
    assert error.param == "reasoning_effort"


def test_disagreeing_effort_and_enable_thinking_are_a_400_naming_reasoning_effort(
    stack: Stack, thinking_model: str
) -> None:
    error = refusal(
        stack.openai(),
        thinking_model,
        reasoning_effort="none",
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert error.param == "reasoning_effort"


def test_a_renderer_without_thinking_takes_effort_none(stack: Stack, plain_model: str) -> None:
    client = stack.openai()
    assert prompt_ids(client, plain_model, reasoning_effort="none") == prompt_ids(client, plain_model)


@pytest.mark.parametrize("stream", [False, True])
def test_thinking_refused_by_the_renderer_names_the_field_the_caller_sent(
    stack: Stack, plain_model: str, stream: bool
) -> None:
    client = stack.openai()
    for effort in THINKING_EFFORTS:
        error = refusal(client, plain_model, reasoning_effort=effort, stream=stream)
        assert error.param == "reasoning_effort", effort
        assert "reasoning_effort: renderer 'role_colon' has no variant with thinking enabled" in error.message
    from_kwargs = refusal(
        client, plain_model, stream=stream, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    assert from_kwargs.param == "chat_template_kwargs.enable_thinking"
    assert "chat_template_kwargs.enable_thinking: renderer 'role_colon' has no variant" in from_kwargs.message
    # Both set and agreeing: chat_template_kwargs is the server's own field, named as the caller sent it.
    both = refusal(
        client,
        plain_model,
        reasoning_effort="high",
        stream=stream,
        extra_body={"chat_template_kwargs": {"enable_thinking": True}},
    )
    assert both.param == "chat_template_kwargs.enable_thinking"
