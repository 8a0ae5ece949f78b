"""Exact logprob bytes: every token's `bytes` are its own, partial characters included, so a completion
is rebuilt from them (a token holding part of a multi-byte character decodes alone to U+FFFD).

tiny-chat's byte-level vocabulary is small enough that most CJK, emoji and accented characters take
several tokens, so its (random) completions of multilingual prompts are full of partial characters.
"""

from __future__ import annotations

from typing import Any

import pytest
from sidecar_support import Stack

pytestmark = pytest.mark.process

MODEL = "logprob-bytes"
PROMPTS = (
    "東京の天気は晴れです。明日は",
    "😀🎉🚀 emoji story:",
    "Café, naïve, façade, crème brûlée, smørrebrød",
    "Привет, как дела? Ελληνικά",
    "مرحبا بالعالم — 한국어 문장 — हिन्दी",
)


@pytest.fixture(scope="module")
def bytes_model(stack: Stack) -> str:
    stack.client.create_model(MODEL, base_model="tinkerrpc/tiny-chat", lora_rank=8)
    return MODEL


def is_partial(token_bytes: bytes) -> bool:
    try:
        token_bytes.decode("utf-8")
    except UnicodeDecodeError:
        return True
    return False


def test_sampled_token_bytes_rebuild_the_completion_text(stack: Stack, bytes_model: str) -> None:
    partial = 0
    for seed, prompt in enumerate(PROMPTS):
        samples = stack.client.model(bytes_model).sample(
            prompt,
            n=4,
            max_tokens=24,
            seed=seed,
            top_logprobs=3,
            return_token_texts=True,
            skip_special_tokens=False,
            spaces_between_special_tokens=False,
        )
        for sample in samples:
            assert len(sample.token_bytes) == len(sample.tokens)
            # The text is the tokens decoded together, U+FFFD only where a character stays incomplete.
            assert b"".join(sample.token_bytes).decode("utf-8", "replace") == sample.text, prompt
            for token_bytes, text in zip(sample.token_bytes, sample.token_texts, strict=True):
                assert token_bytes.decode("utf-8", "replace") == text
                partial += is_partial(token_bytes)
            for alternatives in sample.top_logprobs:
                for alternative in alternatives:
                    assert alternative.bytes is not None
                    assert alternative.bytes.decode("utf-8", "replace") == alternative.text
    assert partial > 0, "no completion held a partial character: the sample proves nothing"


def chat_choices(stack: Stack, model: str, prompt: str, seed: int, **fields: Any) -> list[Any]:
    completion = stack.openai().chat.completions.create(
        model=model,
        messages=[{"role": "user", "content": prompt}],
        n=4,
        max_tokens=24,
        seed=seed,
        logprobs=True,
        top_logprobs=3,
        **fields,
    )
    return list(completion.choices)


def test_chat_logprob_bytes_are_each_tokens_own(stack: Stack, bytes_model: str) -> None:
    bytes_of_token: dict[str, bytes] = {}
    partial = 0
    for seed, prompt in enumerate(PROMPTS):
        as_text = chat_choices(stack, bytes_model, prompt, seed)
        as_ids = chat_choices(
            stack, bytes_model, prompt, seed, extra_body={"return_tokens_as_token_ids": True}
        )
        for text_choice, id_choice in zip(as_text, as_ids, strict=True):
            entries = text_choice.logprobs.content
            joined = b"".join(bytes(entry.bytes) for entry in entries)
            assert (text_choice.message.content or "") in joined.decode("utf-8", "replace")
            for entry, labelled in zip(entries, id_choice.logprobs.content, strict=True):
                assert bytes(entry.bytes) == bytes(labelled.bytes)
                assert bytes(entry.bytes).decode("utf-8", "replace") == entry.token
                partial += is_partial(bytes(entry.bytes))
                bytes_of_token[labelled.token] = bytes(labelled.bytes)
            for entry in entries:
                for alternative in entry.top_logprobs:
                    assert bytes(alternative.bytes).decode("utf-8", "replace") == alternative.token
    assert partial > 0, "no completion held a partial character: the sample proves nothing"
    # An alternative's bytes are exact too: the same token sampled anywhere has the same bytes.
    compared = 0
    for seed, prompt in enumerate(PROMPTS):
        for choice in chat_choices(
            stack, bytes_model, prompt, seed, extra_body={"return_tokens_as_token_ids": True}
        ):
            for entry in choice.logprobs.content:
                for alternative in entry.top_logprobs:
                    if alternative.token in bytes_of_token:
                        assert bytes(alternative.bytes) == bytes_of_token[alternative.token], alternative
                        compared += 1
    assert compared > 0
