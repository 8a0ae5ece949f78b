"""Vendor extensions through the official `openai` client's `extra_body`, as vLLM takes them: unknown
top-level fields and unknown chat_template_kwargs keys are ignored, named in the response header and
logged once; fields the sidecar knows but cannot honour keep their 400 (sidecar/extensions.py)."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from sidecar_support import Stack

from tinkerrpc_server.sidecar.extensions import IGNORED_FIELDS_HEADER

pytestmark = pytest.mark.process

USER = [{"role": "user", "content": "Is the sky blue?"}]
# What ART 0.5.20+ adds to every chat completion of a trainable model (art/model.py,
# Model._default_chat_completion_extra_body).
ART_EXTRAS: dict[str, Any] = {
    "return_token_ids": True,
    "return_tokens_as_token_ids": True,
    "nvext": {"extra_fields": ["engine_data"]},
    "chat_template_kwargs": {"preserve_thinking": True},
}


@pytest.fixture(scope="module")
def api(stack: Stack) -> openai.OpenAI:
    stack.client.create_model("extensions", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    return stack.openai()


def extra(response: Any, name: str) -> Any:
    return (response.model_extra or {}).get(name)


def test_unknown_chat_fields_are_ignored_and_named(api: openai.OpenAI, stack: Stack) -> None:
    request: dict[str, Any] = {"model": "extensions", "messages": USER, "max_tokens": 4, "seed": 3}
    raw = api.chat.completions.with_raw_response.create(**request, extra_body=ART_EXTRAS)
    assert raw.headers[IGNORED_FIELDS_HEADER] == "nvext, chat_template_kwargs.preserve_thinking"
    with_extras = raw.parse()
    plain_raw = api.chat.completions.with_raw_response.create(
        **request, extra_body={"return_token_ids": True}
    )
    assert IGNORED_FIELDS_HEADER not in plain_raw.headers
    plain = plain_raw.parse()
    # Ignored means ignored: the same prompt and the same seeded draw.
    assert extra(with_extras, "prompt_token_ids") == extra(plain, "prompt_token_ids")
    assert extra(with_extras.choices[0], "token_ids") == extra(plain.choices[0], "token_ids")
    # A stream names them too, on its response headers.
    streamed = api.chat.completions.with_raw_response.create(**request, stream=True, extra_body=ART_EXTRAS)
    assert streamed.headers[IGNORED_FIELDS_HEADER] == "nvext, chat_template_kwargs.preserve_thinking"
    text = "".join(c.choices[0].delta.content or "" for c in streamed.parse() if c.choices)
    assert text == with_extras.choices[0].message.content
    # vLLM's return_tokens_as_token_ids, which ART sends beside them, is honoured.
    logprobs = api.chat.completions.create(**request, logprobs=True, extra_body=ART_EXTRAS)
    assert logprobs.choices[0].logprobs is not None
    assert all(e.token.startswith("token_id:") for e in logprobs.choices[0].logprobs.content or ())
    # Warned once per name and process, however many requests send it.
    log = stack.sidecar.log()
    assert log.count("ignored unknown request field nvext") == 1, log[-2000:]
    assert log.count("ignored unknown request field chat_template_kwargs.preserve_thinking") == 1


def test_known_template_kwargs_still_apply_beside_unknown_ones(api: openai.OpenAI) -> None:
    request: dict[str, Any] = {"model": "extensions", "messages": USER, "max_tokens": 2, "seed": 1}
    both = api.chat.completions.with_raw_response.create(
        **request, extra_body={"chat_template_kwargs": {"enable_thinking": False, "preserve_thinking": True}}
    )
    assert both.headers[IGNORED_FIELDS_HEADER] == "chat_template_kwargs.preserve_thinking"
    alone = api.chat.completions.create(
        **request, extra_body={"chat_template_kwargs": {"enable_thinking": False}}
    )
    thinking = api.chat.completions.create(
        **request, extra_body={"chat_template_kwargs": {"enable_thinking": True}}
    )
    assert extra(both.parse(), "prompt_token_ids") == extra(alone, "prompt_token_ids")
    assert extra(alone, "prompt_token_ids") != extra(thinking, "prompt_token_ids")


def test_completions_and_responses_take_the_same_rule(api: openai.OpenAI) -> None:
    completion = api.completions.with_raw_response.create(
        model="extensions", prompt="The sky", max_tokens=2, extra_body={"nvext": {"x": 1}, "priority_hint": 2}
    )
    assert completion.headers[IGNORED_FIELDS_HEADER] == "nvext, priority_hint"
    assert completion.parse().choices[0].text is not None
    response = api.responses.with_raw_response.create(
        model="extensions", input="hi", max_output_tokens=2, extra_body={"nvext": {"x": 1}}
    )
    assert response.headers[IGNORED_FIELDS_HEADER] == "nvext"
    assert response.parse().output


def test_known_but_unsupported_fields_keep_their_400(api: openai.OpenAI) -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"logit_bias": {"1": 5.0}}, "logit_bias"),
        ({"extra_body": {"nvext": {}, "audio": {"voice": "x"}}}, "audio"),
        (
            {"extra_body": {"nvext": {}, "chat_template_kwargs": {"enable_thinking": "no"}}},
            "chat_template_kwargs.enable_thinking",
        ),
        # vLLM's own extensions that would change what is sampled or rendered are refused, not ignored.
        ({"extra_body": {"guided_json": {"type": "object"}}}, "guided_json"),
        ({"extra_body": {"min_p": 0.1}}, "min_p"),
        (
            {"extra_body": {"chat_template_kwargs": {"continue_final_message": True}}},
            "chat_template_kwargs.continue_final_message",
        ),
        # Nested objects stay strict: only the request's own top level takes extensions.
        ({"messages": [{"role": "user", "content": "hi", "nvext": {}}]}, "messages[0].nvext"),
    ]
    for fields, param in cases:
        request: dict[str, Any] = {"model": "extensions", "messages": USER, "max_tokens": 2, **fields}
        with pytest.raises(openai.BadRequestError) as caught:
            api.chat.completions.create(**request)
        assert caught.value.body["param"] == param, (fields, caught.value.body)  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        api.responses.create(model="extensions", input="hi", extra_body={"nvext": {}, "background": True})
    assert caught.value.body["param"] == "background"  # type: ignore[index]
    with pytest.raises(openai.BadRequestError) as caught:
        api.completions.create(model="extensions", prompt="x", extra_body={"use_beam_search": True})
    assert caught.value.body["param"] == "use_beam_search"  # type: ignore[index]
    # At their neutral values they change nothing, and are ignored like any extension.
    neutral = api.chat.completions.with_raw_response.create(
        model="extensions",
        messages=USER,
        max_tokens=1,
        extra_body={"min_p": 0.0, "add_generation_prompt": True},
    )
    assert neutral.headers[IGNORED_FIELDS_HEADER] == "min_p, add_generation_prompt"
