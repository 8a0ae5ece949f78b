"""The rules of parsing a sampled reply (service/replies.py) on tiny-chat's real codec, reply by reply:
several end-of-turn tokens (ignore_default_stops), a turn cut at max_tokens, tool-call markup that
does not parse or calls a function the request did not offer. Parsing never fails a request."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from svc import TINY

from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service.rendering import ChatCodec, ChatCodecs
from tinkerrpc_server.service.replies import parse_reply, tool_call_opening

pytestmark = pytest.mark.unit

CALL = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
OFFERED = {"get_weather"}


@pytest.fixture(scope="module")
def codec(service_model_dir: Path) -> ChatCodec:
    return ChatCodecs(service_model_dir, allow_remote_tokenizers=False).get(TINY)


def parsed(codec: ChatCodec, text: str, tools: set[str] = OFFERED, forced: str = "") -> types_pb2.Message:
    encode = codec.tokenizer.encode
    opening = list(encode(forced, add_special_tokens=False)) if forced else []
    return parse_reply(codec, list(encode(text, add_special_tokens=False)), opening, tools, False)


def calls(message: types_pb2.Message) -> list[tuple[str, object]]:
    return [(call.name, json.loads(call.arguments_json)) for call in message.tool_calls]


def test_text_past_the_first_end_of_turn_is_content(codec: ChatCodec) -> None:
    # Today's failure: "expected to split into 1 or 2 pieces using stop tokens, but got 3".
    message = parsed(
        codec, "<think>\n\n</think>\n\nyes<|im_end|>\n<|im_start|>user\nno<|im_end|>yes<|im_end|>"
    )
    assert message.content == "yes\nuser\nnoyes"
    assert not message.tool_calls


def test_markup_past_the_first_end_of_turn_is_not_parsed(codec: ChatCodec) -> None:
    message = parsed(codec, f"{CALL}<|im_end|>{CALL}<|im_end|>")
    assert calls(message) == [("get_weather", {"city": "Paris"})]
    assert message.content == CALL  # past the end: text, decoded without special tokens


def test_a_call_complete_before_the_cut_is_a_call(codec: ChatCodec) -> None:
    message = parsed(codec, CALL + "\nIt is usually mild")
    assert calls(message) == [("get_weather", {"city": "Paris"})]
    assert message.content == "\nIt is usually mild"


def test_a_call_open_at_the_cut_is_content(codec: ChatCodec) -> None:
    message = parsed(codec, CALL[:-5])
    assert message.content == CALL[:-5] and not message.tool_calls


def test_markup_that_does_not_parse_comes_back_as_content(codec: ChatCodec) -> None:
    bad = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
    message = parsed(codec, f"<think>\n\n</think>\n\n{bad}<|im_end|>")
    assert message.content == f"<think>\n\n</think>\n\n{bad}" and not message.tool_calls
    # All or nothing: a good call beside a bad one is not returned alone.
    both = parsed(codec, f"{CALL}\n{bad}<|im_end|>")
    assert both.content == f"{CALL}\n{bad}" and not both.tool_calls


def test_a_call_of_a_function_not_offered_comes_back_as_content(codec: ChatCodec) -> None:
    rockets = '<tool_call>\n{"name": "launch_rockets", "arguments": {}}\n</tool_call>'
    assert parsed(codec, rockets + "<|im_end|>").content == rockets
    assert not parsed(codec, CALL + "<|im_end|>", tools=set()).tool_calls
    assert calls(parsed(codec, CALL + "<|im_end|>")) == [("get_weather", {"city": "Paris"})]


def test_a_forced_opening_before_the_think_block_is_what_the_model_writes(codec: ChatCodec) -> None:
    opening = tool_call_opening(codec, "get_weather")
    assert codec.decode(opening, skip_special_tokens=False, spaces_between_special_tokens=False) == (
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments":'
    )
    rest = list(
        codec.tokenizer.encode(' {"city": "Paris"}}\n</tool_call><|im_end|>', add_special_tokens=False)
    )
    message = parse_reply(codec, rest, opening, OFFERED, False)
    assert calls(message) == [("get_weather", {"city": "Paris"})] and message.content == ""


def test_any_token_sequence_parses(codec: ChatCodec) -> None:
    """Whatever the model writes, parsing answers: every token of the vocabulary, in runs."""
    vocabulary = list(range(codec.vocab_size))
    for start in range(0, len(vocabulary), 37):
        tokens = vocabulary[start : start + 37]
        assert isinstance(parse_reply(codec, tokens, [], OFFERED, False), types_pb2.Message)
