"""The `smollm2` renderer: found by name by the cookbook and the server, the default of the built-in
SmolLM2, and token for token SmolLM2's chat template (`apply_chat_template`), tool calls included in the
form it documents."""

from __future__ import annotations

import json
import pickle
from pathlib import Path
from typing import Any

import pytest
from smollm2_support import SMOLLM2, smollm2_model_dir
from tinker_cookbook import model_info, renderers
from tinker_cookbook.renderers import Message, TrainOnWhat
from tinker_cookbook.tokenizer_utils import get_tokenizer

from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service.rendering import (
    ChatCodec,
    ChatCodecs,
    RendererVariantError,
    default_renderer_name,
    thinking_variant,
)
from tinkerrpc_server.service.replies import tool_call_opening
from tinkerrpc_server.service.smollm2_renderer import DEFAULT_SYSTEM_PROMPT, SMOLLM2_RENDERER

pytestmark = pytest.mark.process

CONVERSATIONS: list[list[Message]] = [
    [{"role": "user", "content": "What is 7 + 5? Answer with a number."}],
    [{"role": "system", "content": "Be brief."}, {"role": "user", "content": "hi"}],
    [
        {"role": "user", "content": "Write code"},
        {"role": "assistant", "content": "def f(x):\n    return x * 2"},
        {"role": "user", "content": "中文 😀 and e\u0301, tabs\tand  spaces"},
    ],
    [
        {"role": "system", "content": "You call tools."},
        {"role": "user", "content": "Weather in Paris?"},
        {
            "role": "assistant",
            "content": 'I will look.\n<tool_call>\n{"name": "w", "arguments": {}}\n</tool_call>',
        },
        {"role": "tool", "content": '{"temperature": 21}'},
        {"role": "assistant", "content": "It is 21 degrees."},
        {"role": "user", "content": "Thanks!"},
    ],
]


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory: pytest.TempPathFactory) -> Path:
    return smollm2_model_dir(tmp_path_factory)


@pytest.fixture(scope="module")
def tokenizer(model_dir: Path) -> Any:
    return get_tokenizer(str(model_dir / SMOLLM2))


@pytest.fixture(scope="module")
def renderer(tokenizer: Any) -> renderers.Renderer:
    return renderers.get_renderer(SMOLLM2_RENDERER, tokenizer)


def _template_ids(tokenizer: Any, messages: list[Message], generation_prompt: bool) -> list[int]:
    text = tokenizer.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
    return list(tokenizer.encode(text, add_special_tokens=False))


def test_the_name_resolves_in_the_cookbook_and_the_server(renderer: renderers.Renderer) -> None:
    assert SMOLLM2_RENDERER in renderers.get_registered_renderer_names()
    assert model_info.get_recommended_renderer_name(SMOLLM2) == SMOLLM2_RENDERER
    assert model_info.get_recommended_renderer_name(f"{SMOLLM2}:checkpoint") == SMOLLM2_RENDERER
    assert default_renderer_name(SMOLLM2) == SMOLLM2_RENDERER
    assert model_info.get_recommended_renderer_name("Qwen/Qwen3-8B") == "qwen3"  # the cookbook's own, kept
    # Renderers travel to rollout workers pickled, by name.
    assert type(pickle.loads(pickle.dumps(renderer))) is type(renderer)
    # No thinking: the disabled variant is itself, an enabled one does not exist.
    assert thinking_variant(SMOLLM2_RENDERER, enable_thinking=False) == SMOLLM2_RENDERER
    with pytest.raises(RendererVariantError):
        thinking_variant(SMOLLM2_RENDERER, enable_thinking=True)


def test_generation_prompts_and_training_examples_are_the_chat_template_s(
    renderer: renderers.Renderer, tokenizer: Any
) -> None:
    for conversation in CONVERSATIONS:
        prompt = renderer.build_generation_prompt(conversation).to_ints()
        assert prompt == _template_ids(tokenizer, conversation, generation_prompt=True), conversation
        answered = [*conversation, Message(role="assistant", content="12")]
        model_input, weights = renderer.build_supervised_example(answered)
        # The template ends every message with "\n"; the renderer stops at the turn's <|im_end|>.
        template = _template_ids(tokenizer, answered, generation_prompt=False)
        assert model_input.to_ints() == template[:-1] and tokenizer.decode(template[-1:]) == "\n"
        trained = [t for t, w in zip(model_input.to_ints(), weights.tolist(), strict=True) if w > 0]
        assert tokenizer.decode(trained) == "12<|im_end|>"
    default = tokenizer.decode(renderer.build_generation_prompt(CONVERSATIONS[0]).to_ints())
    assert default.startswith(f"<|im_start|>system\n{DEFAULT_SYSTEM_PROMPT}<|im_end|>\n<|im_start|>user\n")
    examples = renderer.build_supervised_examples(
        [*CONVERSATIONS[3], Message(role="assistant", content="ok")], TrainOnWhat.ALL_ASSISTANT_MESSAGES
    )
    assert len(examples) == 1  # no thinking to strip: one sequence trains every turn


def test_tool_calls_render_as_documented_and_parse_back(renderer: renderers.Renderer, tokenizer: Any) -> None:
    call = renderers.ToolCall(
        id="call_1",
        function=renderers.ToolCall.FunctionBody(name="lookup", arguments=json.dumps({"q": "Paris"})),
    )
    asked: list[Message] = [{"role": "user", "content": "Weather?"}]
    with_call: list[Message] = [
        *asked,
        {"role": "assistant", "content": "Looking.", "tool_calls": [call]},
        {"role": "tool", "content": "21 C", "tool_call_id": "call_1"},
    ]
    as_text = '<tool_call>\n{"name": "lookup", "arguments": {"q": "Paris"}}\n</tool_call>'
    written: list[Message] = [*asked, {"role": "assistant", "content": f"Looking.\n{as_text}"}, with_call[2]]
    assert renderer.build_generation_prompt(with_call).to_ints() == _template_ids(tokenizer, written, True)
    assert "<|im_start|>tool\n21 C<|im_end|>" in tokenizer.decode(
        renderer.build_generation_prompt(with_call).to_ints()
    )

    sampled = tokenizer.encode(f"Looking.\n{as_text}<|im_end|>", add_special_tokens=False)
    message, termination = renderer.parse_response(sampled)
    assert termination.is_clean
    [parsed] = message["tool_calls"]
    assert parsed.function.name == "lookup" and json.loads(parsed.function.arguments) == {"q": "Paris"}

    tools: list[renderers.ToolSpec] = [{"name": "lookup", "description": "weather", "parameters": {}}]
    [declared] = renderer.create_conversation_prefix_with_tools(tools)
    assert declared["role"] == "system"
    content = renderers.get_text_content(declared)
    assert content.startswith(DEFAULT_SYSTEM_PROMPT + "\n\n# Tools") and '"name": "lookup"' in content


@pytest.fixture(scope="module")
def codec(model_dir: Path) -> ChatCodec:
    return ChatCodecs(model_dir, allow_remote_tokenizers=False).get(SMOLLM2)


def test_the_server_s_codec_of_the_built_in_uses_it(codec: ChatCodec) -> None:
    assert codec.renderer_name == SMOLLM2_RENDERER
    assert (codec.vocab_size, codec.max_context_length) == (49_152, 8192)
    assert codec.default_stop_tokens() == [2]
    question = [types_pb2.Message(role=types_pb2.ROLE_USER, content="What is 7 + 5?")]
    expected = _template_ids(codec.tokenizer, [{"role": "user", "content": "What is 7 + 5?"}], True)
    assert codec.generation_prompt(question, []) == expected
    # What a forced tool call starts the reply with (up to the token before the arguments, " {").
    assert codec.decode(tool_call_opening(codec, "lookup")) == '<tool_call>\n{"name": "lookup", "arguments":'
