"""vLLM's RL request extras with their vLLM meaning, through the official `openai` client against the real
sidecar and server: min_tokens, skip_special_tokens, spaces_between_special_tokens,
include_stop_str_in_output, chat_template_kwargs' enable_thinking, echo. Each is observable in what comes
back; the untrained model `extras` (version 0) serves them, the taught `tool_agent` where a model that ends
its turn on cue is needed."""

from __future__ import annotations

from typing import Any

import openai
import pytest
from sidecar_support import QUESTION, WEATHER_TOOL, Stack

import tinkerrpc

pytestmark = pytest.mark.process

USER = [{"role": "user", "content": "Tell me a story."}]
# Single characters the random model writes within a few tokens.
STOPS = ["e", "a", " ", "o"]


@pytest.fixture(scope="module")
def extras_model(stack: Stack) -> str:
    stack.client.create_model("extras", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    return "extras"


@pytest.fixture(scope="module")
def api(stack: Stack) -> openai.OpenAI:
    return stack.openai()


def extra(response: Any, name: str) -> Any:
    return (response.model_extra or {}).get(name)


def complete(api: openai.OpenAI, model: str, prompt: str | list[int], **options: Any) -> Any:
    body = {
        key: options.pop(key) for key in list(options) if key not in ("max_tokens", "stop", "seed", "echo")
    }
    return api.completions.create(model=model, prompt=prompt, extra_body=body, **options)


def test_min_tokens_keeps_stop_strings_and_stop_tokens_away(
    api: openai.OpenAI, extras_model: str, tool_agent: str
) -> None:
    early = complete(api, extras_model, "Once", max_tokens=40, stop=STOPS, seed=7)
    (choice,) = early.choices
    assert choice.finish_reason == "stop" and len(choice.token_ids) < 12, choice
    held = complete(api, extras_model, "Once", max_tokens=40, stop=STOPS, seed=7, min_tokens=20)
    (held_choice,) = held.choices
    # No stop before 20 tokens although the stop strings came earlier; then the first stop after them ends it.
    assert len(held_choice.token_ids) >= 20
    assert len(held_choice.text) > len(choice.text)
    assert held_choice.finish_reason == "stop" or len(held_choice.token_ids) == 40

    # The taught agent ends its tool call with <|im_end|>; greedy with min_tokens past that point takes the
    # best token that is not a stop instead, so no end of turn comes before min_tokens.
    plain = api.chat.completions.create(
        model=tool_agent, messages=[QUESTION], tools=[WEATHER_TOOL], temperature=0, max_tokens=60
    )  # type: ignore[list-item]
    ended_at = len(extra(plain.choices[0], "token_ids"))
    assert plain.choices[0].finish_reason == "tool_calls"
    longer = api.chat.completions.create(
        model=tool_agent,
        messages=[QUESTION],  # type: ignore[list-item]
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        temperature=0,
        max_tokens=ended_at + 5,
        logprobs=True,
        extra_body={"min_tokens": ended_at + 5, "return_token_ids": True},
    )
    tokens = extra(longer.choices[0], "token_ids")
    assert len(tokens) == ended_at + 5 and longer.choices[0].finish_reason == "length"
    assert tokens[: ended_at - 1] == extra(plain.choices[0], "token_ids")[: ended_at - 1]
    im_end = extra(plain.choices[0], "token_ids")[-1]
    assert im_end not in tokens
    # Every logprob is the policy's own (finite, <= 0), one per token: the rollout trains as drawn.
    assert len(longer.choices[0].logprobs.content or []) == len(tokens)
    assert all(entry.logprob <= 0 for entry in longer.choices[0].logprobs.content or [])


def test_include_stop_str_in_output_keeps_the_matched_stop(api: openai.OpenAI, extras_model: str) -> None:
    cut = complete(api, extras_model, "Once", max_tokens=40, stop=STOPS, seed=11)
    kept = complete(
        api, extras_model, "Once", max_tokens=40, stop=STOPS, seed=11, include_stop_str_in_output=True
    )
    assert cut.choices[0].finish_reason == kept.choices[0].finish_reason == "stop"
    assert cut.choices[0].token_ids == kept.choices[0].token_ids
    assert kept.choices[0].text[len(cut.choices[0].text) :] in STOPS
    assert kept.choices[0].text.startswith(cut.choices[0].text)


def test_special_tokens_in_text_follow_the_decoding_options(api: openai.OpenAI, extras_model: str) -> None:
    chat = api.chat.completions.create(model=extras_model, messages=USER, max_tokens=1)  # type: ignore[arg-type]
    prompt = extra(chat, "prompt_token_ids")
    plain = complete(api, extras_model, prompt, max_tokens=1, echo=True, seed=1)
    kept = complete(api, extras_model, prompt, max_tokens=1, echo=True, seed=1, skip_special_tokens=False)
    tight = complete(
        api,
        extras_model,
        prompt,
        max_tokens=1,
        echo=True,
        seed=1,
        skip_special_tokens=False,
        spaces_between_special_tokens=False,
    )
    assert "<|im_end|>" not in plain.choices[0].text and "story." in plain.choices[0].text
    assert "story.<|im_end|>\n<|im_start|>assistant" in tight.choices[0].text
    assert "story. <|im_end|> \n <|im_start|> assistant" in kept.choices[0].text


def test_sampled_special_tokens_stay_in_text_when_asked(api: openai.OpenAI, tool_agent: str) -> None:
    """The taught agent's reply ends with <|im_end|>: in the text only when asked."""
    reply = api.chat.completions.create(
        model=tool_agent, messages=[QUESTION], tools=[WEATHER_TOOL], temperature=0, max_tokens=60
    )  # type: ignore[list-item]
    prompt = extra(reply, "prompt_token_ids")
    decoded = complete(api, tool_agent, prompt, max_tokens=60, temperature=0)
    raw = complete(api, tool_agent, prompt, max_tokens=60, temperature=0, skip_special_tokens=False)
    assert decoded.choices[0].token_ids == raw.choices[0].token_ids == extra(reply.choices[0], "token_ids")
    assert (
        raw.choices[0].text.endswith("</tool_call> <|im_end|>")
        and "<|im_end|>" not in decoded.choices[0].text
    )


def test_enable_thinking_renders_with_the_thinking_variant(
    stack: Stack, api: openai.OpenAI, extras_model: str
) -> None:
    stack.client.create_model(
        "extras-no-thinking", base_model="tinkerrpc/tiny-chat", lora_rank=8, renderer="qwen3_disable_thinking"
    )

    def prompt_of(model: str, **kwargs: Any) -> list[int]:
        body = {"chat_template_kwargs": kwargs} if kwargs else {}
        response = api.chat.completions.create(model=model, messages=USER, max_tokens=1, extra_body=body)  # type: ignore[arg-type]
        return list(extra(response, "prompt_token_ids"))

    thinking = prompt_of(extras_model)
    not_thinking = prompt_of(extras_model, enable_thinking=False)
    assert not_thinking == prompt_of("extras-no-thinking") != thinking
    assert not_thinking[: len(thinking)] == thinking  # qwen3's variant closes an empty think block
    assert prompt_of(extras_model, enable_thinking=True) == thinking
    assert prompt_of("extras-no-thinking", enable_thinking=True) == thinking
    with pytest.raises(openai.BadRequestError) as caught:
        prompt_of(extras_model, enable_thinking=False, add_generation_prompt=False)
    assert caught.value.body["param"] == "chat_template_kwargs.add_generation_prompt"  # type: ignore[index]
    assert "add_generation_prompt" in caught.value.message


def test_echo_puts_the_prompt_before_the_text(api: openai.OpenAI, extras_model: str) -> None:
    echoed = complete(api, extras_model, "Once upon a time", max_tokens=4, seed=3, echo=True)
    plain = complete(api, extras_model, "Once upon a time", max_tokens=4, seed=3)
    assert echoed.choices[0].text == "Once upon a time" + plain.choices[0].text
    # A token prompt is echoed as its decoded text.
    echoed_ids = complete(api, extras_model, [9, 10, 11], max_tokens=2, seed=3, echo=True).choices[0].text
    plain_ids = complete(api, extras_model, [9, 10, 11], max_tokens=2, seed=3).choices[0].text
    assert echoed_ids.endswith(plain_ids) and len(echoed_ids) > len(plain_ids)
    streamed = "".join(
        chunk.choices[0].text
        for chunk in api.completions.create(
            model=extras_model, prompt="Once upon a time", max_tokens=4, seed=3, echo=True, stream=True
        )
        if chunk.choices
    )
    assert streamed == echoed.choices[0].text

    # Chat (vLLM): the reply continues a last assistant message, whose text comes first.
    history = [*USER, {"role": "assistant", "content": "Once upon"}]
    chat = api.chat.completions.create(
        model=extras_model, messages=history, max_tokens=3, seed=3, extra_body={"echo": True}
    )  # type: ignore[arg-type]
    bare = api.chat.completions.create(model=extras_model, messages=history, max_tokens=3, seed=3)  # type: ignore[arg-type]
    assert chat.choices[0].message.content == "Once upon" + (bare.choices[0].message.content or "")
    assert extra(chat.choices[0], "token_ids") == extra(bare.choices[0], "token_ids")


def test_an_rl_client_request_with_every_extra_trains_token_exact(
    stack: Stack, api: openai.OpenAI, extras_model: str
) -> None:
    response = api.chat.completions.create(
        model=extras_model,
        messages=USER,  # type: ignore[arg-type]
        max_tokens=12,
        logprobs=True,
        seed=5,
        stop=["e"],
        extra_body={
            "return_token_ids": True,
            "skip_special_tokens": False,
            "spaces_between_special_tokens": False,
            "include_stop_str_in_output": True,
            "min_tokens": 6,
            "chat_template_kwargs": {"enable_thinking": False},
            "repetition_penalty": 1.0,
            "top_k": -1,
        },
    )
    (choice,) = response.choices
    assert len(extra(choice, "token_ids")) >= 6
    trajectory = tinkerrpc.Trajectory.from_openai(USER, response, reward=1.0)
    assert list(trajectory.turns[0].completion_token_ids) == extra(choice, "token_ids")
    assert list(trajectory.turns[0].prompt_token_ids) == extra(response, "prompt_token_ids")
    other = tinkerrpc.Trajectory.from_openai(
        USER,
        api.chat.completions.create(model=extras_model, messages=USER, max_tokens=4, logprobs=True),
        reward=0.0,  # type: ignore[arg-type]
    )
    result = stack.client.model(extras_model).train([tinkerrpc.TrajectoryGroup([trajectory, other])])
    assert result.policy_version == 1
