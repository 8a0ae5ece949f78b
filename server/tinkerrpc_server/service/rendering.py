"""Tokenizers and tinker-cookbook renderers per model, resolved offline, and conversions between
tinkerrpc.v1 chat messages and the cookbook's messages.

Request text never becomes control tokens, whatever the renderer: several cookbook renderers tokenise
message text with the tokenizer's special-token matching on, so a user writing
`<|im_end|><|im_start|>assistant` would forge a turn. The codec marks every request string before
rendering and the renderer's tokenizer (PlainTextTokenizer) tokenises the marked parts as plain text,
while the renderer's own markers stay control tokens. Rendering is CPU work: callers run it `off_loop`.
In `tinkerrpc serve` it runs without torch (service/torchless.py)."""

from __future__ import annotations

import asyncio
import functools
import json
import logging
import re
import secrets
from collections.abc import Callable
from concurrent.futures import ThreadPoolExecutor
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, TypeVar

from tinker_cookbook import model_info, renderers
from tinker_cookbook.renderers import Renderer, TrainOnWhat
from tinker_cookbook.tokenizer_utils import Tokenizer, get_tokenizer

from tinkerrpc.v1 import types_pb2
from tinkerrpc_server import model_store
from tinkerrpc_server.bounded_json import parse_json_object
from tinkerrpc_server.service import smollm2_renderer
from tinkerrpc_server.service.torchless import renderer_imports, resolve_base_model

log = logging.getLogger("tinkerrpc.rendering")

# Renderer names resolve through the cookbook's registry: ours join it before any is resolved.
smollm2_renderer.register()

# Context length assumed when a remote base model's config is not available locally.
FALLBACK_CONTEXT_LENGTH = 32768

ROLE_NAMES = {
    types_pb2.ROLE_SYSTEM: "system",
    types_pb2.ROLE_USER: "user",
    types_pb2.ROLE_ASSISTANT: "assistant",
    types_pb2.ROLE_TOOL: "tool",
}
ROLES_BY_NAME = {name: role for role, name in ROLE_NAMES.items()}


# Every use of a tokenizer (loading codecs, rendering, tokenising, decoding) runs on this one thread, off
# the event loop, so a huge request cannot freeze health checks and other calls, and concurrent huge
# requests queue instead of adding threads. One thread, because a Hugging Face tokenizer is shared by
# the codecs of a base model and keeps per-call settings (split_special_tokens) in shared state:
# concurrent calls fail ("Already borrowed") or, worse, tokenise with another call's setting.
_render_pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="tinkerrpc-render")

Result = TypeVar("Result")


async def off_loop(work: Callable[[], Result]) -> Result:
    """`work()` on the rendering thread."""
    return await asyncio.get_running_loop().run_in_executor(_render_pool, work)


class UnknownRendererError(ValueError):
    pass


class RendererVariantError(ValueError):
    """A per-request rendering option the model's renderer cannot give (a thinking variant, a
    forced tool call); the message says why."""


# Renderers with a thinking and a thinking-disabled variant, as (thinking, not thinking) pairs, so
# that chat_template_kwargs' enable_thinking picks one. A name in several pairs maps by its first.
_THINKING_PAIRS = (
    ("qwen3", "qwen3_disable_thinking"),
    ("qwen3_5", "qwen3_5_disable_thinking"),
    ("qwen3_5_preserve_thinking", "qwen3_5_disable_thinking"),
    ("qwen3_8_xhigh_reasoning", "qwen3_8_disable_thinking"),
    ("qwen3_8_medium_reasoning", "qwen3_8_disable_thinking"),
    ("qwen3_8_low_reasoning", "qwen3_8_disable_thinking"),
    ("deepseekv3_thinking", "deepseekv3"),
    ("deepseekv3_thinking", "deepseekv3_disable_thinking"),
    ("deepseekv4_1", "deepseekv4_1_disable_thinking"),
    ("deepseekv4_1_low_reasoning", "deepseekv4_1_disable_thinking"),
    ("deepseekv4_1_max_reasoning", "deepseekv4_1_disable_thinking"),
    ("deepseekv4_1_preserve_thinking", "deepseekv4_1_disable_thinking"),
    ("kimi_k25", "kimi_k25_disable_thinking"),
    ("kimi_k26", "kimi_k26_disable_thinking"),
    ("kimi_k26_preserve_thinking", "kimi_k26_disable_thinking"),
    ("nemotron3", "nemotron3_disable_thinking"),
    ("nemotron3_low_thinking", "nemotron3_disable_thinking"),
    ("nemotron3_preserve_thinking", "nemotron3_disable_thinking"),
    ("nemotron3_ultra", "nemotron3_ultra_disable_thinking"),
    ("nemotron3_ultra_medium_thinking", "nemotron3_ultra_disable_thinking"),
    ("nemotron3_ultra_preserve_thinking", "nemotron3_ultra_disable_thinking"),
)
# Renderers of models that never think: thinking is already off.
_NON_THINKING = frozenset(
    {"role_colon", "llama3", "qwen3_instruct", "qwen3_vl_instruct", smollm2_renderer.SMOLLM2_RENDERER}
)


def thinking_variant(renderer_name: str, enable_thinking: bool) -> str:
    """The renderer to use for a request asking for thinking on or off."""
    for thinking, plain in _THINKING_PAIRS:
        if renderer_name in (thinking, plain):
            return thinking if enable_thinking else plain
    if renderer_name in _NON_THINKING and not enable_thinking:
        return renderer_name
    raise RendererVariantError(
        f"renderer {renderer_name!r} has no variant with thinking {'enabled' if enable_thinking else 'disabled'}"
    )


class PlainTextTokenizer:
    """The tokenizer a codec's renderer gets. `mark` replaces every special-token string (`<|im_end|>`)
    in request text with a marker holding a per-process secret; `encode` of a string with markers
    tokenises the marked strings as plain text (split_special_tokens) and the renderer's own special
    strings as control tokens. Strings without markers go to the tokenizer as they are. Everything else
    is the wrapped tokenizer's."""

    def __init__(self, tokenizer: Tokenizer) -> None:
        self._tokenizer = tokenizer
        added: dict[int, Any] = getattr(tokenizer, "added_tokens_decoder", {})
        self._special_ids = {
            token.content: i for i, token in added.items() if getattr(token, "special", False)
        }
        self._specials = sorted(self._special_ids, key=len, reverse=True)
        self._special_pattern = (
            re.compile("|".join(re.escape(text) for text in self._specials)) if self._specials else None
        )
        # Alphanumeric, so JSON encoding, stripping or splitting on markup leaves a marker whole.
        self._prefix = f"tkrpc{secrets.token_hex(16)}x"
        self._marker = re.compile(re.escape(self._prefix) + r"(\d+)x")
        self._framing: tuple[list[int], list[int]] | None = None

    def __getattr__(self, name: str) -> Any:
        return getattr(self._tokenizer, name)

    def mark(self, text: str) -> str:
        if self._special_pattern is None:
            return text
        return self._special_pattern.sub(
            lambda found: f"{self._prefix}{self._specials.index(found[0])}x", text
        )

    def encode(self, text: str, add_special_tokens: bool = True, **kwargs: Any) -> list[int]:
        if self._special_pattern is None or self._prefix not in text:
            return list(self._tokenizer.encode(text, add_special_tokens=add_special_tokens, **kwargs))
        ids: list[int] = []
        plain: list[str] = []  # the text since the last control token, marked strings restored
        position = 0
        for found in self._marker.finditer(text):
            self._add_renderer_text(text[position : found.start()], ids, plain)
            index = int(found[1])
            plain.append(self._specials[index] if index < len(self._specials) else found[0])
            position = found.end()
        self._add_renderer_text(text[position:], ids, plain)
        self._add_plain(ids, plain)
        if not add_special_tokens:
            return ids
        before, after = self._special_framing()
        return [*before, *ids, *after]

    def _add_renderer_text(self, text: str, ids: list[int], plain: list[str]) -> None:
        assert self._special_pattern is not None
        position = 0
        for found in self._special_pattern.finditer(text):
            plain.append(text[position : found.start()])
            self._add_plain(ids, plain)
            ids.append(self._special_ids[found[0]])
            position = found.end()
        plain.append(text[position:])

    def _add_plain(self, ids: list[int], plain: list[str]) -> None:
        text = "".join(plain)
        plain.clear()
        if text:
            ids.extend(self._tokenizer.encode(text, add_special_tokens=False, split_special_tokens=True))

    def _special_framing(self) -> tuple[list[int], list[int]]:
        """The tokens the tokenizer adds around a text with add_special_tokens (a BOS, say)."""
        if self._framing is None:
            bare = list(self._tokenizer.encode("a", add_special_tokens=False))
            framed = list(self._tokenizer.encode("a", add_special_tokens=True))
            start = next(i for i in range(len(framed)) if framed[i : i + len(bare)] == bare)
            self._framing = (framed[:start], framed[start + len(bare) :])
        return self._framing


_BYTE_FALLBACK_PIECE = re.compile(r"<0x[0-9A-F]{2}>")


@functools.cache
def _byte_level_alphabet() -> dict[str, int]:
    """GPT-2's byte-level BPE alphabet, character → byte: printable bytes stand for themselves, the
    others for the characters from U+0100 on, in byte order."""
    printable = [
        *range(ord("!"), ord("~") + 1),
        *range(ord("¡"), ord("¬") + 1),
        *range(ord("®"), ord("ÿ") + 1),
    ]
    others = [b for b in range(256) if b not in printable]
    return {
        **{chr(b): b for b in printable},
        **{chr(256 + i): b for i, b in enumerate(others)},
    }


@dataclass(frozen=True)
class ChatCodec:
    """One model's tokenizer and chat renderer: what turns messages and text into tokens and back."""

    tokenizer: Tokenizer
    renderer: Renderer
    renderer_name: str
    vocab_size: int
    max_context_length: int
    # The base model's width from its config (None for a remote model): it bounds the LoRA rank.
    hidden_size: int | None
    # The renderer's tokenizer: request text marked with it stays plain text.
    plain_text: PlainTextTokenizer
    base_model: str
    # Other renderers of this tokenizer (per-request variants), made on first use.
    _variants: dict[str, ChatCodec] = field(default_factory=dict, compare=False, repr=False)

    def with_renderer(self, renderer_name: str) -> ChatCodec:
        """This tokenizer with another renderer (RendererVariantError when it cannot render)."""
        if renderer_name == self.renderer_name:
            return self
        variant = self._variants.get(renderer_name)
        if variant is None:
            try:
                renderer = _load_renderer(renderer_name, self.plain_text, self.tokenizer, self.base_model)
            except UnknownRendererError as err:
                raise RendererVariantError(str(err)) from err
            variant = ChatCodec(
                tokenizer=self.tokenizer,
                renderer=renderer,
                renderer_name=renderer_name,
                vocab_size=self.vocab_size,
                max_context_length=self.max_context_length,
                hidden_size=self.hidden_size,
                plain_text=self.plain_text,
                base_model=self.base_model,
            )
            self._variants[renderer_name] = variant
        return variant

    def generation_prompt(self, messages: list[types_pb2.Message], tools: list[types_pb2.Tool]) -> list[int]:
        """The conversation (tools declared first) rendered with the generation prompt appended."""
        return list(self.renderer.build_generation_prompt(self._conversation(messages, tools)).to_ints())

    def supervised_examples(
        self, messages: list[types_pb2.Message], tools: list[types_pb2.Tool], train_on: TrainOnWhat
    ) -> list[tuple[list[int], list[float]]]:
        """(tokens, per-token weights) of each example the renderer makes of the conversation."""
        return [
            (model_input.to_ints(), [float(w) for w in weights.tolist()])
            for model_input, weights in self.renderer.build_supervised_examples(
                self._conversation(messages, tools), train_on
            )
        ]

    def decode(
        self, tokens: list[int], skip_special_tokens: bool = True, spaces_between_special_tokens: bool = True
    ) -> str:
        """The tokens as text; with special tokens kept, each added token is its own piece, joined to
        the decoded text around it with a space or not (Hugging Face's slow-tokenizer rule, which its
        fast tokenizers ignore)."""
        if skip_special_tokens:
            return str(self.tokenizer.decode(tokens, skip_special_tokens=True))
        added: dict[int, Any] = getattr(self.tokenizer, "added_tokens_decoder", {})
        pieces: list[str] = []
        run: list[int] = []
        for token in tokens:
            if token not in added:
                run.append(token)
                continue
            if run:
                pieces.append(str(self.tokenizer.decode(run, skip_special_tokens=False)))
                run = []
            pieces.append(str(added[token].content))
        if run:
            pieces.append(str(self.tokenizer.decode(run, skip_special_tokens=False)))
        return (" " if spaces_between_special_tokens else "").join(pieces)

    def token_text(self, token: int) -> str:
        return str(self.tokenizer.decode([token], skip_special_tokens=False))

    def token_bytes(self, token: int) -> bytes:
        """The token's own bytes, where its text alone has U+FFFD for part of a character: a byte-level
        BPE piece mapped back through the byte alphabet, a byte-fallback piece `<0xNN>` as its byte;
        an added token, or a piece of another tokenizer, as its text's UTF-8."""
        added: dict[int, Any] = getattr(self.tokenizer, "added_tokens_decoder", {})
        if token not in added:
            piece = str(self.tokenizer.convert_ids_to_tokens(token))
            if _BYTE_FALLBACK_PIECE.fullmatch(piece):
                return bytes([int(piece[3:5], 16)])
            decoder = getattr(getattr(self.tokenizer, "backend_tokenizer", None), "decoder", None)
            alphabet = _byte_level_alphabet()
            if type(decoder).__name__ == "ByteLevel" and all(c in alphabet for c in piece):
                return bytes(alphabet[c] for c in piece)
        return self.token_text(token).encode()

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

    def _conversation(
        self, messages: list[types_pb2.Message], tools: list[types_pb2.Tool]
    ) -> list[renderers.Message]:
        """The cookbook's messages, request text marked, after the renderer's tool declaration (a leading
        system message folded into it)."""
        mark = self.plain_text.mark
        conversation = _cookbook_messages(messages, mark)
        if not tools:
            return conversation
        specs: list[renderers.ToolSpec] = [
            {
                "name": mark(tool.name),
                "description": mark(tool.description),
                "parameters": parse_json_object(mark(tool.parameters_json)),
            }
            for tool in tools
        ]
        system_prompt = ""
        if conversation and conversation[0]["role"] == "system":
            system_prompt = renderers.get_text_content(conversation[0])
            conversation = conversation[1:]
        return [*self.renderer.create_conversation_prefix_with_tools(specs, system_prompt), *conversation]


def default_renderer_name(base_model: str) -> str:
    if base_model.startswith("tinkerrpc/"):
        return "qwen3"
    try:
        return str(model_info.get_recommended_renderer_name(base_model))
    except Exception as err:
        raise UnknownRendererError(
            f"no recommended renderer for {base_model!r} ({err}); name one explicitly"
        ) from err


def _model_config(local_dir: Path | None) -> dict[str, Any]:
    """The base model's config.json; empty for a remote model, known by its tokenizer only."""
    if local_dir is not None and (local_dir / "config.json").exists():
        return dict(json.loads((local_dir / "config.json").read_text()))
    return {}


def _hidden_size(config: dict[str, Any]) -> int | None:
    value = config.get("hidden_size")
    return value if isinstance(value, int) and value > 0 else None


def _context_length(config: dict[str, Any], tokenizer: Tokenizer) -> int:
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

    def loaded(self, base_model: str, renderer_name: str = "") -> ChatCodec | None:
        """The codec `get` would return, if it is loaded already (no tokenizer work: any thread)."""
        return self._cache.get((base_model, renderer_name))

    def get(self, base_model: str, renderer_name: str = "") -> ChatCodec:
        """The model's codec; an empty renderer name means the recommended one for the base model.
        Raises model_store.UnknownBaseModelError or UnknownRendererError for bad names."""
        key = (base_model, renderer_name)
        cached = self._cache.get(key)
        if cached is not None:
            return cached
        local_dir: Path | None
        try:
            local_dir = resolve_base_model(base_model, self._model_dir)
        except model_store.BuiltinModelUnavailableError:
            raise  # what to install (or a wrong file) is the answer, not a download from the hub
        except model_store.UnknownBaseModelError:
            # Only a model name goes to the hub: a path would load a tokenizer from any local folder.
            if not self._allow_remote or not model_store.is_model_name(base_model):
                raise
            local_dir = None
        tokenizer = get_tokenizer(str(local_dir) if local_dir is not None else base_model)
        renderer_name = renderer_name or default_renderer_name(base_model)
        plain_text = PlainTextTokenizer(tokenizer)
        config = _model_config(local_dir)
        codec = ChatCodec(
            tokenizer=tokenizer,
            renderer=_load_renderer(renderer_name, plain_text, tokenizer, base_model),
            renderer_name=renderer_name,
            vocab_size=len(tokenizer),
            max_context_length=_context_length(config, tokenizer),
            hidden_size=_hidden_size(config),
            plain_text=plain_text,
            base_model=base_model,
        )
        self._cache[key] = codec
        return codec


def _load_renderer(
    renderer_name: str, plain_text: PlainTextTokenizer, tokenizer: Tokenizer, base_model: str
) -> Renderer:
    """The named renderer over `plain_text`, once it has shown it can do what every Sample does."""
    try:
        with renderer_imports():
            renderer = renderers.get_renderer(renderer_name, plain_text)
    except (ValueError, KeyError, NotImplementedError) as err:
        raise UnknownRendererError(f"unknown renderer {renderer_name!r}: {err}") from err
    except Exception as err:  # the renderer's own checks of the tokenizer (asserts, type errors)
        raise UnknownRendererError(
            f"renderer {renderer_name!r} does not work with {base_model!r}'s tokenizer: {err}"
        ) from err
    try:
        # What every Sample does: render, stop at the end of a turn, parse the reply.
        renderer.build_generation_prompt([{"role": "user", "content": "hello"}])
        renderer.get_stop_sequences()
        renderer.parse_response(list(tokenizer.encode("hello", add_special_tokens=False)))
    except Exception as err:
        raise UnknownRendererError(
            f"renderer {renderer_name!r} cannot render a conversation with {base_model!r}'s tokenizer: {err}"
        ) from err
    return renderer


def _cookbook_messages(
    messages: list[types_pb2.Message], mark: Callable[[str], str]
) -> list[renderers.Message]:
    out: list[renderers.Message] = []
    for message in messages:
        converted: renderers.Message = {"role": ROLE_NAMES[message.role], "content": mark(message.content)}
        if message.tool_calls:
            converted["tool_calls"] = [
                renderers.ToolCall(
                    id=mark(call.id) or None,
                    function=renderers.ToolCall.FunctionBody(
                        name=mark(call.name), arguments=mark(call.arguments_json)
                    ),
                )
                for call in message.tool_calls
            ]
        if message.tool_call_id:
            converted["tool_call_id"] = mark(message.tool_call_id)
        if message.name:
            converted["name"] = mark(message.name)
        out.append(converted)
    return out
