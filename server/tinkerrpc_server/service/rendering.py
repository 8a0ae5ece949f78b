"""Tokenizers and tinker-cookbook renderers per model, resolved offline, and conversions between
tinkerrpc.v1 chat messages and the cookbook's messages."""

from __future__ import annotations

import json
import logging
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

from tinker_cookbook import model_info, renderers
from tinker_cookbook.renderers import Renderer
from tinker_cookbook.tokenizer_utils import Tokenizer, get_tokenizer

from tinkerrpc.v1 import types_pb2
from tinkerrpc_server import model_store

log = logging.getLogger("tinkerrpc.rendering")

# Context length assumed when a remote base model's config is not available locally.
FALLBACK_CONTEXT_LENGTH = 32768

ROLE_NAMES = {
    types_pb2.ROLE_SYSTEM: "system",
    types_pb2.ROLE_USER: "user",
    types_pb2.ROLE_ASSISTANT: "assistant",
    types_pb2.ROLE_TOOL: "tool",
}
_ROLES_BY_NAME = {name: role for role, name in ROLE_NAMES.items()}


class UnknownRendererError(ValueError):
    pass


@dataclass(frozen=True)
class ChatCodec:
    """One model's tokenizer and chat renderer: what turns messages and text into tokens and back."""

    tokenizer: Tokenizer
    renderer: Renderer
    renderer_name: str
    vocab_size: int
    max_context_length: int

    def decode(self, tokens: list[int]) -> str:
        return str(self.tokenizer.decode(tokens, skip_special_tokens=True))

    def token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token], skip_special_tokens=False))

    def default_stop_tokens(self) -> list[int]:
        stops: list[int] = []
        for stop in self.renderer.get_stop_sequences():
            if isinstance(stop, int):
                stops.append(stop)
            else:
                ids = self.tokenizer.encode(stop, add_special_tokens=False)
                if len(ids) == 1:
                    stops.append(int(ids[0]))
        eos = getattr(self.tokenizer, "eos_token_id", None)
        if isinstance(eos, int) and eos not in stops:
            stops.append(eos)
        return stops

    def with_tools(
        self, messages: list[renderers.Message], tools: list[types_pb2.Tool]
    ) -> list[renderers.Message]:
        """Prepend the renderer's tool declaration, folding a leading system message into it."""
        if not tools:
            return messages
        specs: list[renderers.ToolSpec] = [
            {
                "name": tool.name,
                "description": tool.description,
                "parameters": json.loads(tool.parameters_json or "{}"),
            }
            for tool in tools
        ]
        system_prompt = ""
        if messages and messages[0]["role"] == "system":
            system_prompt = renderers.get_text_content(messages[0])
            messages = messages[1:]
        return [*self.renderer.create_conversation_prefix_with_tools(specs, system_prompt), *messages]


def default_renderer_name(base_model: str) -> str:
    if base_model.startswith("tinkerrpc/"):
        return "qwen3"
    try:
        return str(model_info.get_recommended_renderer_name(base_model))
    except Exception as err:
        raise UnknownRendererError(
            f"no recommended renderer for {base_model!r} ({err}); name one explicitly"
        ) from err


def _context_length(local_dir: Path | None, tokenizer: Tokenizer) -> int:
    if local_dir is not None and (local_dir / "config.json").exists():
        config = json.loads((local_dir / "config.json").read_text())
        for key in ("max_position_embeddings", "n_positions", "max_sequence_length"):
            if isinstance(config.get(key), int):
                return int(config[key])
    limit = getattr(tokenizer, "model_max_length", None)
    if isinstance(limit, int) and 0 < limit < 10**7:
        return limit
    return FALLBACK_CONTEXT_LENGTH


class ChatCodecs:
    """The codec of each (base model, renderer) pair, loaded once."""

    def __init__(self, model_dir: Path, allow_remote_tokenizers: bool) -> None:
        self._model_dir = model_dir
        self._allow_remote = allow_remote_tokenizers
        self._cache: dict[tuple[str, str], ChatCodec] = {}

    def preload(self, models: list[tuple[str, str]]) -> None:
        """Load these (base model, renderer) pairs now, or at least the tokenizer machinery, so the first
        request does not pay for importing transformers."""
        for base_model, renderer_name in models:
            self.get(base_model, renderer_name)
        if not models:
            import transformers  # noqa: F401 - the import itself is the warm-up

    def get(self, base_model: str, renderer_name: str = "") -> ChatCodec:
        """The model's codec; an empty renderer name means the recommended one for the base model.
        Raises model_store.UnknownBaseModelError or UnknownRendererError for bad names."""
        key = (base_model, renderer_name)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        local_dir: Path | None
        try:
            local_dir = model_store.resolve_base_model(base_model, self._model_dir)
        except model_store.UnknownBaseModelError:
            if not self._allow_remote:
                raise
            local_dir = None
        tokenizer = get_tokenizer(str(local_dir) if local_dir is not None else base_model)
        renderer_name = renderer_name or default_renderer_name(base_model)
        try:
            renderer = renderers.get_renderer(renderer_name, tokenizer)
        except (ValueError, KeyError, NotImplementedError) as err:
            raise UnknownRendererError(f"unknown renderer {renderer_name!r}: {err}") from err
        codec = ChatCodec(
            tokenizer=tokenizer,
            renderer=renderer,
            renderer_name=renderer_name,
            vocab_size=len(tokenizer),
            max_context_length=_context_length(local_dir, tokenizer),
        )
        self._cache[key] = codec
        return codec


def to_cookbook_messages(messages: list[types_pb2.Message]) -> list[renderers.Message]:
    out: list[renderers.Message] = []
    for message in messages:
        converted: renderers.Message = {"role": ROLE_NAMES[message.role], "content": message.content}
        if message.tool_calls:
            converted["tool_calls"] = [
                renderers.ToolCall(
                    id=call.id or None,
                    function=renderers.ToolCall.FunctionBody(name=call.name, arguments=call.arguments_json),
                )
                for call in message.tool_calls
            ]
        if message.tool_call_id:
            converted["tool_call_id"] = message.tool_call_id
        if message.name:
            converted["name"] = message.name
        out.append(converted)
    return out


def to_proto_message(message: renderers.Message) -> types_pb2.Message:
    content: Any = message.get("content", "")
    text = content if isinstance(content, str) else renderers.format_content_as_string(content)
    proto = types_pb2.Message(
        role=_ROLES_BY_NAME.get(message["role"], types_pb2.ROLE_ASSISTANT), content=text
    )
    for call in message.get("tool_calls", []):
        # Chat templates like Qwen3's carry no call ids, yet the tool message answering a call must
        # name one: a sampled call without an id gets a fresh one, as OpenAI's API gives.
        proto.tool_calls.add(
            id=call.id or f"call_{uuid.uuid4().hex[:24]}",
            name=call.function.name,
            arguments_json=call.function.arguments,
        )
    return proto
