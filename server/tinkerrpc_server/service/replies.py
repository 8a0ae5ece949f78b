"""An assistant reply's two ends: the tool-call opening that starts a forced call, and the message parsed
from the sampled tokens. Parsing a sampled reply never fails a request; its rules:

- The reply is the forced opening (prompt tokens) followed by the sampled tokens. Its turn ends at the
  first token that ends a turn by default (the renderer's end-of-turn tokens and the tokenizer's EOS).
- With `ignore_default_stops` the sampler goes on past that token: what follows is content, decoded
  without special tokens and appended to the message's text, never parsed for thinking or tool calls
  (it is not the assistant's turn any more; `text` and `token_ids` keep everything, as always).
- A turn cut at max_tokens is parsed as though it had ended there: a call complete before the cut is a
  call, text after it stays content, and a call still open at the cut is unparsed markup.
- Tool calls are all or nothing (vLLM's rule for markup that does not parse): when any call markup in
  the turn does not parse (its JSON, its name or arguments, a block never closed), holds arguments
  past the JSON bounds (NaN, a number too long, nesting too deep) or names a function that is not
  among the request's tools (OpenAI never returns one), the turn comes back as content, its text
  exactly as sampled, markup included, with no tool calls.
- A renderer that fails on the turn all the same gives the turn's text as content.

docs/sidecar-tool-calls.md tells the same rules from the OpenAI side."""

from __future__ import annotations

import json
import logging
import uuid
from collections.abc import Collection
from typing import Any

from tinker_cookbook import renderers

from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.bounded_json import BoundedJsonError, parse_json_object
from tinkerrpc_server.service.rendering import ROLES_BY_NAME, ChatCodec, RendererVariantError

log = logging.getLogger("tinkerrpc.replies")

# A tool call rendered with these is searched for the renderer's tool-call opening.
_SENTINEL_NAME = "tkrpcsentinelfunction"
_SENTINEL_ARGUMENT = "tkrpcsentinelargument"


def tool_call_opening(codec: ChatCodec, function_name: str) -> list[int]:
    """The tokens that open an assistant reply with a tool call: the renderer's own tokens of a reply
    that is only a call, up to the function's name (any function when empty) or, with a name, up to
    its arguments, rendered as the last turn of a conversation (what the model is trained on and
    writes: Qwen3's thinking renderers put the empty think block the model writes first before the
    call). The renderer's tokens, not a re-tokenised text: a prefix cut at a token boundary is what
    the model saw in training. RendererVariantError when the renderer renders no tool calls as text."""
    name = function_name or _SENTINEL_NAME
    call = renderers.ToolCall(
        id="call_0",
        function=renderers.ToolCall.FunctionBody(
            name=codec.plain_text.mark(name), arguments=json.dumps({_SENTINEL_ARGUMENT: 1})
        ),
    )
    asked: list[renderers.Message] = [{"role": "user", "content": "hello"}]
    answered: list[renderers.Message] = [*asked, {"role": "assistant", "content": "", "tool_calls": [call]}]
    prompt = codec.renderer.build_generation_prompt(asked).to_ints()
    rendered = codec.renderer.build_supervised_example(answered)[0].to_ints()
    # Where the rendering leaves the generation prompt: a prompt may end past it (the empty think block
    # of qwen3_disable_thinking), and the opening follows the whole prompt.
    shared = next((i for i, (a, b) in enumerate(zip(prompt, rendered, strict=False)) if a != b), len(prompt))
    reply = rendered[shared:]
    text = str(codec.tokenizer.decode(reply, skip_special_tokens=False))
    name_at = text.find(name)
    arguments_at = text.rfind("{", 0, text.find(_SENTINEL_ARGUMENT))
    if name_at < 0 or arguments_at < name_at + len(name):
        raise RendererVariantError(
            f"renderer {codec.renderer_name!r} has no tool-call format to force a call with"
        )
    end = arguments_at if function_name else name_at
    count = 0
    while (
        count < len(reply)
        and len(codec.tokenizer.decode(reply[: count + 1], skip_special_tokens=False)) <= end
    ):
        count += 1
    return reply[:count]


def parse_reply(
    codec: ChatCodec,
    tokens: list[int],
    forced: list[int],
    tool_names: Collection[str],
    single_tool_call: bool,
) -> types_pb2.Message:
    """The assistant message of a sampled reply (`forced`, the opening a forced call put in the prompt,
    then `tokens`), by the rules above; `tool_names` are the functions the request declared, and
    `single_tool_call` keeps a reply's first call only."""
    reply = [*forced, *tokens]
    ends = set(codec.default_stop_tokens())
    text_end = next((i for i, token in enumerate(reply) if token in ends), len(reply))
    own_ends = [stop for stop in codec.renderer.get_stop_sequences() if isinstance(stop, int)]
    if text_end < len(reply) and reply[text_end] in own_ends:
        turn = reply[: text_end + 1]
    else:
        # Cut at max_tokens, or ended by a token the renderer does not end turns with (the tokenizer's
        # EOS): parsed as though the renderer's own end of turn came there.
        turn = [*reply[:text_end], *own_ends[:1]]
    message = _parsed_turn(codec, turn, text_end, tool_names)
    after = reply[text_end + 1 :]
    calls = message.tool_calls
    if single_tool_call:
        del calls[1:]
    if after:
        message.content += str(codec.tokenizer.decode(after, skip_special_tokens=True))
    return message


def _parsed_turn(
    codec: ChatCodec, turn: list[int], text_end: int, tool_names: Collection[str]
) -> types_pb2.Message:
    """The turn parsed by the renderer, or its text as sampled (the first `text_end` tokens) when the
    renderer fails on it or its tool-call markup is not all calls of declared functions."""
    try:
        parsed, _termination = codec.renderer.parse_response(turn)
        unparsed = parsed.get("unparsed_tool_calls", [])
        undeclared = [
            call
            for call in parsed.get("tool_calls", [])
            if call.function.name not in tool_names or not _json_object(call)
        ]
        if not unparsed and not undeclared:
            return to_proto_message(parsed)
    except Exception as error:  # a renderer's own failure on odd output is the model's, not the request's
        log.debug("renderer %s could not parse a reply: %s", codec.renderer_name, error)
    text = str(codec.tokenizer.decode(turn[:text_end], skip_special_tokens=False))
    return types_pb2.Message(role=types_pb2.ROLE_ASSISTANT, content=text)


def _json_object(call: renderers.ToolCall) -> bool:
    """Whether the call's arguments are a JSON object within the bounds every request's JSON keeps
    (a renderer's own parse takes NaN, which no client can read back)."""
    try:
        parse_json_object(call.function.arguments)
    except BoundedJsonError:
        return False
    return True


def to_proto_message(message: renderers.Message) -> types_pb2.Message:
    content: Any = message.get("content", "")
    # The parts as the model wrote them, its calls taken out (the cookbook's default joins them with
    # newlines the model did not write).
    text = content if isinstance(content, str) else renderers.format_content_as_string(content, separator="")
    proto = types_pb2.Message(role=ROLES_BY_NAME.get(message["role"], types_pb2.ROLE_ASSISTANT), content=text)
    for call in message.get("tool_calls", []):
        # Chat templates like Qwen3's carry no call ids, yet the tool message answering a call must
        # name one: a sampled call without an id gets a fresh one, as OpenAI's API gives.
        proto.tool_calls.add(
            id=call.id or f"call_{uuid.uuid4().hex[:24]}",
            name=call.function.name,
            arguments_json=call.function.arguments,
        )
    return proto
