"""Replies at the edges (issue 40 items 1, 6 and 8), through a real `serve` and its hosted sidecar on a
tiny-chat model taught to write them (reply_lessons.py): several end-of-turn tokens under
ignore_eos, tool-call markup that does not parse, a call of a function not offered, a call followed by
chatter until max_tokens, a forced call with the thinking renderer, reasoning_effort, and streamed
text whose tokens hold parts of characters. Each case is checked plain and streamed."""

from __future__ import annotations

import codecs
import json
from typing import Any

import httpx
import pytest
from hardening_support import HostedServer
from reply_client import HEADERS, both_replies, chat, plain_replies, plain_reply, streamed_replies
from reply_lessons import (
    ARGUMENTS,
    BAD_JSON,
    CALL_MARKUP,
    CALL_THEN_CHATTER,
    EMPTY_THINK,
    UNOFFERED,
    WEATHER,
    WEATHER_TOOL,
    YES,
    Lesson,
    question,
    taught_model,
    written,
)
from service.svc import CALL_TIMEOUT, create_model, user

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2

pytestmark = pytest.mark.process

IM_END = 2  # tiny-chat's <|im_end|>, its renderer's end of turn and its EOS
SPECIAL_TOKENS = (0, 1, 2)  # tiny-chat's <|endoftext|>, <|im_start|>, <|im_end|>: not in `text`


@pytest.fixture(scope="module")
def actor(hosted_server: HostedServer) -> str:
    version = taught_model(hosted_server.server.proc.target)
    if version is None:
        pytest.fail("greedy decoding did not reproduce every reply lesson")
    return version


def _asking(model: str, lesson: Lesson, **options: Any) -> dict[str, Any]:
    return {
        "model": model,
        "messages": [question(lesson)],
        "tools": [WEATHER_TOOL],
        "temperature": 0,
        "max_tokens": 64,
        **options,
    }


def _past_the_turn(token_ids: list[int], token_bytes: list[bytes]) -> str | None:
    """The text after the first end of turn, as `text` decodes it (special tokens left out); None when
    the tokens hold fewer than two ends of turn (nothing to test)."""
    if token_ids.count(IM_END) < 2:
        return None
    after = token_ids.index(IM_END) + 1
    kept = [b for t, b in zip(token_ids[after:], token_bytes[after:], strict=True) if t not in SPECIAL_TOKENS]
    return b"".join(kept).decode(errors="replace")


def test_ignore_eos_chat_answers_with_the_text_past_the_turn(hosted_server: HostedServer, actor: str) -> None:
    """Item 1: a completion with several end tokens was a gRPC INTERNAL and an HTTP 500. What the model
    writes past its end of turn is not taught: 8 samples at temperature 1 hold several ends of turn."""
    name, version = actor.split("@")
    params = types_pb2.SamplingParams(
        n=8, max_tokens=64, temperature=1.0, seed=3, ignore_default_stops=True, return_token_texts=True
    )
    request = pb.SampleRequest(
        model=name,
        policy_version=int(version),
        chat=pb.ChatPrompt(messages=[user(YES.question)]),
        params=params,
    )
    function = WEATHER_TOOL["function"]
    request.chat.tools.add(
        name=function["name"],
        description=function["description"],
        parameters_json=json.dumps(function["parameters"]),
    )
    sequences = hosted_server.server.stub.Sample(request, timeout=CALL_TIMEOUT).sequences
    tested = 0
    for sequence in sequences:
        past = _past_the_turn(list(sequence.token_ids), list(sequence.token_bytes))
        if past is None or not sequence.text.startswith(written(YES)):
            continue
        # The turn is the lesson's "yes"; what the model wrote past its end is content, as `text` has it.
        assert sequence.message.content == "yes" + past and past == sequence.text[len(written(YES)) :]
        assert not sequence.message.tool_calls
        tested += 1
    assert tested, [s.text for s in sequences]

    body = {**_asking(actor, YES, ignore_eos=True), "n": 8, "temperature": 1.0, "seed": 3}
    # The same tools, prompt and seed as the Sample above: the same samples.
    expected = [(s.message.content, list(s.token_ids)) for s in sequences]
    for replies in (
        plain_replies(hosted_server.sidecar_url, body),
        streamed_replies(hosted_server.sidecar_url, body),
    ):
        assert [(r.content, r.token_ids) for r in replies] == expected
        assert all(r.finish_reason == "length" and not r.calls for r in replies)


def test_markup_that_does_not_parse_comes_back_as_content(hosted_server: HostedServer, actor: str) -> None:
    """Item 6: a closed call block with bad JSON was dropped, leaving an empty reply."""
    for reply in both_replies(hosted_server.sidecar_url, _asking(actor, BAD_JSON)):
        assert (reply.content, reply.calls, reply.finish_reason) == (written(BAD_JSON), [], "stop")


def test_a_call_of_a_function_not_offered_is_content(hosted_server: HostedServer, actor: str) -> None:
    """Item 6: launch_rockets is not among the tools; it came back as a tool call."""
    for reply in both_replies(hosted_server.sidecar_url, _asking(actor, UNOFFERED)):
        assert (reply.content, reply.calls, reply.finish_reason) == (written(UNOFFERED), [], "stop")


def test_a_call_then_chatter_until_max_tokens_keeps_the_call(hosted_server: HostedServer, actor: str) -> None:
    """Item 6: a complete call followed by text cut at max_tokens came back as plain content."""
    body = _asking(actor, CALL_THEN_CHATTER, max_tokens=40)
    for reply in both_replies(hosted_server.sidecar_url, body):
        assert reply.calls == [("get_weather", ARGUMENTS)] and reply.finish_reason == "length"
        assert reply.content and CALL_THEN_CHATTER.reply is not None
        assert CALL_THEN_CHATTER.reply.startswith(CALL_MARKUP + reply.content)


@pytest.mark.parametrize(
    "tool_choice", ["required", {"type": "function", "function": {"name": "get_weather"}}]
)
def test_a_forced_call_with_the_thinking_renderer_is_the_call(
    hosted_server: HostedServer, actor: str, tool_choice: str | dict[str, Any]
) -> None:
    """Item 6: the forced opening went before the empty think block the model writes first, and the
    model then failed (its reply was content)."""
    unforced = plain_reply(hosted_server.sidecar_url, _asking(actor, WEATHER))
    for reply in both_replies(hosted_server.sidecar_url, _asking(actor, WEATHER, tool_choice=tool_choice)):
        assert (reply.calls, reply.finish_reason) == ([("get_weather", ARGUMENTS)], "tool_calls")
        assert not reply.content
        # The opening (think block and the call's start) ends the prompt; the model wrote the rest.
        assert reply.prompt_token_ids[: len(unforced.prompt_token_ids)] == unforced.prompt_token_ids
        opening = reply.prompt_token_ids[len(unforced.prompt_token_ids) :]
        assert opening + reply.token_ids == unforced.token_ids


def test_reasoning_effort_picks_the_thinking_variant(hosted_server: HostedServer, actor: str) -> None:
    """Item 6: every reasoning_effort was refused although the README lists OpenAI's values as taken."""
    default = plain_reply(hosted_server.sidecar_url, _asking(actor, WEATHER))
    for effort in ("minimal", "low", "medium", "high"):
        thinking = plain_reply(hosted_server.sidecar_url, _asking(actor, WEATHER, reasoning_effort=effort))
        assert thinking == default, effort
    off = plain_reply(hosted_server.sidecar_url, _asking(actor, WEATHER, reasoning_effort="none"))
    # qwen3_disable_thinking: the prompt ends with the empty think block the model writes itself.
    assert off.prompt_token_ids[: len(default.prompt_token_ids)] == default.prompt_token_ids
    assert off.prompt_token_ids + off.token_ids == default.prompt_token_ids + default.token_ids
    assert off.calls == [("get_weather", ARGUMENTS)]
    disagreeing = _asking(
        actor, WEATHER, reasoning_effort="none", chat_template_kwargs={"enable_thinking": True}
    )
    refused = chat(hosted_server.sidecar_url, disagreeing)
    assert refused.status_code == 400 and refused.json()["error"]["param"] == "reasoning_effort"
    assert EMPTY_THINK in written(WEATHER)


def _character_pieces(token_ids: list[int], token_bytes: list[bytes]) -> list[str]:
    """What each token adds to the text: the characters its bytes complete."""
    decoder = codecs.getincrementaldecoder("utf-8")(errors="replace")
    return [
        "" if t in SPECIAL_TOKENS else decoder.decode(b) for t, b in zip(token_ids, token_bytes, strict=True)
    ]


def test_streamed_text_moves_with_its_tokens_through_partial_characters(hosted_server: HostedServer) -> None:
    """Item 8: a token holding part of a character put all the remaining text into one chunk."""
    create_model(hosted_server.server.stub, "partial-utf8")
    params = types_pb2.SamplingParams(max_tokens=60, temperature=1.0, seed=11, return_token_texts=True)
    request = pb.SampleRequest(model="partial-utf8", text="hi", params=params)
    (sequence,) = hosted_server.server.stub.Sample(request, timeout=CALL_TIMEOUT).sequences
    partial = [b for b in sequence.token_bytes if "\ufffd" in b.decode(errors="replace")]
    assert partial, "the sample holds no token with part of a character"
    expected = _character_pieces(list(sequence.token_ids), list(sequence.token_bytes))
    assert "".join(expected) == sequence.text

    body = {"model": "partial-utf8", "prompt": "hi", "max_tokens": 60, "temperature": 1.0, "seed": 11}
    response = httpx.post(
        f"{hosted_server.sidecar_url}/v1/completions",
        json={**body, "stream": True},
        headers=HEADERS,
        timeout=CALL_TIMEOUT,
    )
    lines = [line.removeprefix("data: ") for line in response.text.splitlines() if line.startswith("data: ")]
    texts = [json.loads(line)["choices"][0]["text"] for line in lines[:-1]]
    assert "".join(texts) == sequence.text
    # The text moves with its tokens, not the rest in one chunk. Not a chunk per token exactly: a broken
    # character, sent once the next text shows it stays broken, may join its neighbour's, and the engine's
    # stream hands over every token decoded since the last read together, so on a loaded machine a chunk
    # may hold a few (one CI run: 40 chunks for 56 pieces, 11 of them partial). The bug sent 1-2 chunks.
    assert len([t for t in texts if t]) >= (len([e for e in expected if e]) - len(partial)) // 2
