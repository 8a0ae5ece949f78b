"""The built-in SmolLM2 behind the sidecar: a model made with the `smollm2` renderer by name answers the
official openai client, tool calls and results in its history included. Few, short completions: the
engine samples a Llama model on its transformers fallback."""

from __future__ import annotations

import json
from collections.abc import Iterator

import pytest
from sidecar_support import Stack
from smollm2_support import SMOLLM2, gguf_tokenizer

pytestmark = pytest.mark.process

# The first use converts the GGUF file and loads a 135 M model in the engine, on a busy 2-core machine.
FIRST_USE_TIMEOUT = 600.0


@pytest.fixture
def smollm2_chat(stack: Stack) -> Iterator[str]:
    stack.client.create_model(
        "smollm2-chat", base_model=SMOLLM2, lora_rank=4, renderer="smollm2", timeout=FIRST_USE_TIMEOUT
    )
    yield "smollm2-chat"
    stack.client.delete_model("smollm2-chat")  # its base model is the biggest one the stack loads


def test_the_openai_client_chats_with_smollm2_through_its_renderer(stack: Stack, smollm2_chat: str) -> None:
    client = stack.openai(timeout=FIRST_USE_TIMEOUT)
    completion = client.chat.completions.create(
        model=smollm2_chat,
        messages=[{"role": "user", "content": "What is 7 + 5? Answer with a number."}],
        max_tokens=16,
        temperature=0,
    )
    assert "12" in (completion.choices[0].message.content or "")

    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "add", "arguments": json.dumps({"a": 7, "b": 5})},
    }
    tool_completion = client.chat.completions.create(
        model=smollm2_chat,
        messages=[
            {"role": "user", "content": "Add 7 and 5."},
            {"role": "assistant", "content": "", "tool_calls": [call]},
            {"role": "tool", "tool_call_id": "call_1", "content": "12"},
        ],
        max_tokens=4,
        temperature=0,
    )
    prompt = gguf_tokenizer().decode(tool_completion.model_extra["prompt_token_ids"])
    # As the renderer documents: the call a block after the (empty) text, the result a `tool` turn.
    assert prompt.endswith(
        '<|im_start|>assistant\n<tool_call>\n{"name": "add", "arguments": {"a": 7, "b": 5}}\n</tool_call><|im_end|>\n'
        "<|im_start|>tool\n12<|im_end|>\n<|im_start|>assistant\n"
    )
    assert prompt.startswith("<|im_start|>system\nYou are a helpful AI assistant named SmolLM")
