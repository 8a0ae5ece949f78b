"""Identical unseeded requests that arrive together are drawn in one Sample call (sidecar/coalescing.py),
through the real sidecar and server with the openai client. The gathering rules on their own, on a clock
the test moves: test_coalescing_rules.py."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import pytest
from sidecar_support import Stack

pytestmark = pytest.mark.process

USER = [{"role": "user", "content": "Is the sky blue?"}]


def coalesced(stack: Stack) -> float:
    found = re.search(r"^tinkerrpc_sidecar_coalesced_requests_total (\S+)$", stack.sidecar.metrics(), re.M)
    assert found is not None
    return float(found.group(1))


@pytest.fixture(scope="module")
def model(stack: Stack) -> str:
    stack.client.create_model("coalesced", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    return "coalesced"


async def _completions(stack: Stack, model: str, count: int, **options: Any) -> list[Any]:
    client = stack.async_openai(timeout=120)
    try:
        return list(
            await asyncio.gather(
                *(
                    client.chat.completions.create(model=model, messages=USER, max_tokens=8, **options)
                    for _ in range(count)
                )
            )
        )
    finally:
        await client.close()


def test_identical_requests_share_a_call_and_each_gets_its_own_samples(stack: Stack, model: str) -> None:
    before = coalesced(stack)
    completions = asyncio.run(_completions(stack, model, 8))
    assert coalesced(stack) - before >= 2, "no two of 8 identical concurrent requests shared a call"
    assert all(len(c.choices) == 1 for c in completions)
    keys = [c.choices[0].model_extra["sample_key"] for c in completions]
    assert all(keys) and len(set(keys)) == 8, keys
    # Each request's usage is its own: its prompt once, its own completion tokens.
    prompt_tokens = {c.usage.prompt_tokens for c in completions}
    assert len(prompt_tokens) == 1
    for c in completions:
        assert c.usage.completion_tokens == len(c.choices[0].model_extra["token_ids"])


def test_seeded_requests_are_drawn_alone(stack: Stack, model: str) -> None:
    before = coalesced(stack)
    completions = asyncio.run(_completions(stack, model, 4, seed=7, n=2))
    assert coalesced(stack) == before
    # The seed fixes each request's draw: equal requests, equal answers.
    texts = {tuple(choice.message.content for choice in c.choices) for c in completions}
    assert len(texts) == 1
