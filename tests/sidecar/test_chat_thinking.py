"""What a chat request asks of the renderer's thinking (chat.thinking_asked): chat_template_kwargs'
enable_thinking and OpenAI's reasoning_effort (issue 40 item 6: every reasoning_effort was refused
although OpenAI's values are documented as taken)."""

from __future__ import annotations

from typing import Any

import pytest
from pydantic import ValidationError

from tinkerrpc_server.sidecar import chat
from tinkerrpc_server.sidecar.chat_protocol import ChatCompletionRequest
from tinkerrpc_server.sidecar.errors import OpenAIError

pytestmark = pytest.mark.unit


def request(**fields: Any) -> ChatCompletionRequest:
    return ChatCompletionRequest.model_validate(
        {"model": "m", "messages": [{"role": "user", "content": "hi"}], **fields}
    )


@pytest.mark.parametrize(
    ("fields", "thinking"),
    [
        ({}, None),
        ({"reasoning_effort": "none"}, False),
        ({"reasoning_effort": "minimal"}, True),
        ({"reasoning_effort": "low"}, True),
        ({"reasoning_effort": "medium"}, True),
        ({"reasoning_effort": "high"}, True),
        ({"chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"reasoning_effort": "none", "chat_template_kwargs": {"enable_thinking": False}}, False),
        ({"reasoning_effort": "high", "chat_template_kwargs": {"enable_thinking": True}}, True),
    ],
)
def test_reasoning_effort_asks_for_the_thinking_variant_or_not(
    fields: dict[str, Any], thinking: bool | None
) -> None:
    assert chat.thinking_asked(request(**fields)) is thinking


def test_disagreeing_fields_are_refused_naming_reasoning_effort() -> None:
    with pytest.raises(OpenAIError) as caught:
        chat.thinking_asked(request(reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}))
    assert (caught.value.status, caught.value.param) == (400, "reasoning_effort")
    assert (
        "asks for thinking off, chat_template_kwargs.enable_thinking for the opposite" in caught.value.message
    )


def test_an_effort_openai_does_not_take_is_refused() -> None:
    with pytest.raises(ValidationError):
        request(reasoning_effort="max")
