"""Sample's per-request rendering and decoding options, checked on the codec without a server: the
thinking variants, the forced tool-call opening, single_tool_call, and special-token decoding."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
from svc import TINY, user

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service import errors
from tinkerrpc_server.service.rendering import ChatCodec, ChatCodecs, RendererVariantError, thinking_variant
from tinkerrpc_server.service.sampling import Drawn, _forced_opening, _request_codec, _sampled_sequence

pytestmark = pytest.mark.unit

TOOL = types_pb2.Tool(name="get_weather", parameters_json=json.dumps({"type": "object"}))


@pytest.fixture(scope="module")
def codec(service_model_dir: Path) -> ChatCodec:
    return ChatCodecs(service_model_dir, allow_remote_tokenizers=False).get(TINY)


def _chat(**fields: object) -> pb.SampleRequest:
    return pb.SampleRequest(model="m", chat=pb.ChatPrompt(messages=[user("hi")], tools=[TOOL], **fields))  # type: ignore[arg-type]


def test_thinking_variants_pair_up() -> None:
    assert thinking_variant("qwen3", False) == "qwen3_disable_thinking"
    assert thinking_variant("qwen3_disable_thinking", True) == "qwen3"
    assert thinking_variant("qwen3_8_low_reasoning", False) == "qwen3_8_disable_thinking"
    assert thinking_variant("deepseekv3", True) == "deepseekv3_thinking"
    assert thinking_variant("llama3", False) == "llama3"
    with pytest.raises(RendererVariantError, match="no variant with thinking enabled"):
        thinking_variant("llama3", True)


def test_enable_thinking_switches_the_codec(codec: ChatCodec) -> None:
    assert _request_codec(_chat(), codec) is codec
    assert _request_codec(_chat(enable_thinking=False), codec).renderer_name == "qwen3_disable_thinking"
    role_colon = codec.with_renderer("role_colon")
    with pytest.raises(errors.ServiceError, match=r"chat\.enable_thinking"):
        _request_codec(_chat(enable_thinking=True), role_colon)
    # role_colon renders no tool calls as text: a call cannot be forced.
    with pytest.raises(
        errors.ServiceError, match=r"chat\.forced_tool_call: renderer .role_colon. has no tool-call"
    ):
        _forced_opening(_chat(forced_tool_call=pb.ForcedToolCall()), role_colon)


def test_forced_openings_are_the_renderers_tokens(codec: ChatCodec) -> None:
    any_call = _forced_opening(_chat(forced_tool_call=pb.ForcedToolCall()), codec)
    named = _forced_opening(_chat(forced_tool_call=pb.ForcedToolCall(function_name="get_weather")), codec)
    # Qwen3's thinking renderer: the reply the model is trained to write starts with an empty think
    # block, and the call follows it (issue 40: an opening before it made the model fail).
    assert codec.decode(any_call, skip_special_tokens=False, spaces_between_special_tokens=False) == (
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "'
    )
    assert named[: len(any_call)] == any_call
    assert codec.decode(named, skip_special_tokens=False, spaces_between_special_tokens=False) == (
        '<think>\n\n</think>\n\n<tool_call>\n{"name": "get_weather", "arguments":'
    )
    # Without thinking the prompt already ends with the empty think block: the opening is the call's.
    plain = codec.with_renderer("qwen3_disable_thinking")
    plain_call = _forced_opening(_chat(forced_tool_call=pb.ForcedToolCall()), plain)
    assert plain.decode(plain_call, skip_special_tokens=False, spaces_between_special_tokens=False) == (
        '<tool_call>\n{"name": "'
    )
    assert _forced_opening(_chat(), codec) == []


def test_a_forced_reply_parses_with_its_opening_and_single_tool_call_keeps_one(codec: ChatCodec) -> None:
    request = _chat(forced_tool_call=pb.ForcedToolCall(function_name="get_weather"))
    opening = _forced_opening(request, codec)
    call = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
    rest = codec.tokenizer.encode(
        ' {"city": "Paris"}}\n</tool_call>\n' + call + "<|im_end|>", add_special_tokens=False
    )
    sampled = Drawn(list(rest), [-0.5] * len(rest), stopped=True)
    both = _sampled_sequence(sampled, request, 4, codec, opening)
    assert [c.name for c in both.message.tool_calls] == ["get_weather", "get_weather"]
    assert list(both.token_ids) == list(rest)  # the opening is the prompt's, not the sequence's
    request.chat.single_tool_call = True
    (first,) = _sampled_sequence(sampled, request, 4, codec, opening).message.tool_calls
    assert json.loads(first.arguments_json) == {"city": "Paris"}


def test_special_tokens_decode_as_asked(codec: ChatCodec) -> None:
    tokens = codec.tokenizer.encode("yes<|im_end|>\nno", add_special_tokens=False)
    assert codec.decode(tokens) == "yes\nno"
    assert codec.decode(tokens, skip_special_tokens=False) == "yes <|im_end|> \nno"
    assert codec.decode(tokens, skip_special_tokens=False, spaces_between_special_tokens=False) == (
        "yes<|im_end|>\nno"
    )
