"""Top-K logprobs on the sidecar against the real stack (serve + embedded engine, tiny-chat) through the
openai client: vLLM's `prompt_logprobs` (extra_body) on chat completions, legacy completions and
/inference/v1/generate, OpenAI's `top_logprobs` on chat and `logprobs: k` on completions. Each value is
checked against the SDK's Model.sample with the same prompt and seed (the Sample RPC, whose values
test_sample_topk.py checks against the tinker SDK's own topk_prompt_logprobs)."""

from __future__ import annotations

from collections.abc import Sequence
from typing import Any

import httpx
import openai
import pytest
from sidecar_support import API_KEY, Stack

import tinkerrpc

pytestmark = pytest.mark.process

MODEL = "prompt-logprobs"
MESSAGES = [{"role": "user", "content": "Name three colours of the rainbow."}]
TEXT = "Red, orange, yellow, green"
K = 4


@pytest.fixture(scope="module")
def model(stack: Stack) -> tinkerrpc.Model:
    return stack.client.create_model(MODEL, base_model="tinkerrpc/tiny-chat", lora_rank=8)


def _check_vllm_prompt_logprobs(entries: list[Any], expected: tinkerrpc.Sample, k: int) -> None:
    """vLLM's shape, each value the Sample RPC's: None first, then the prompt token (its own logprob,
    its rank and text where it is among the top k) and the top k ranked 1..k."""
    prompt = expected.prompt_token_ids
    assert len(entries) == len(prompt) and entries[0] is None
    for position in range(1, len(prompt)):
        entry = entries[position]
        token, own = str(prompt[position]), expected.prompt_logprobs[position]
        assert next(iter(entry)) == token  # the prompt token first, as vLLM lists it
        assert entry[token]["logprob"] == pytest.approx(own, abs=1e-4)
        top = expected.prompt_top_logprobs[position] if k else ()
        assert len(top) == k
        ranked = sorted(
            (value["rank"], key, value["decoded_token"], value["logprob"])
            for key, value in entry.items()
            if value["rank"] is not None
        )
        assert [r[:3] for r in ranked] == [(rank, str(a.token_id), a.text) for rank, a in enumerate(top, 1)]
        assert [r[3] for r in ranked] == pytest.approx([a.logprob for a in top], abs=1e-4)
        listed = {str(a.token_id) for a in top}
        assert len(entry) == k + (token not in listed)
        if token not in listed:  # outside the top k: no rank or text known, no likelier than the k-th
            assert entry[token]["rank"] is None and entry[token]["decoded_token"] is None
        if k:
            assert top[0].logprob >= own - 1e-5
            assert token in listed or own <= top[-1].logprob + 1e-5


def _check_top_logprobs(content: Sequence[Any], expected: tinkerrpc.Sample) -> None:
    """OpenAI's chat logprobs: each token's top alternatives are the Sample RPC's (the engine's top-K)."""
    assert len(content) == len(expected.tokens)
    for position, item in enumerate(content):
        assert item.logprob == pytest.approx(expected.logprobs[position], abs=1e-4)
        top = expected.top_logprobs[position]
        assert [t.token for t in item.top_logprobs] == [a.text for a in top]
        assert [t.logprob for t in item.top_logprobs] == pytest.approx([a.logprob for a in top], abs=1e-4)


def test_chat_prompt_logprobs_and_top_logprobs_are_the_samples(stack: Stack, model: tinkerrpc.Model) -> None:
    completion = stack.openai().chat.completions.create(
        model=MODEL,
        messages=MESSAGES,  # type: ignore[arg-type]
        max_tokens=6,
        seed=5,
        logprobs=True,
        top_logprobs=3,
        extra_body={"prompt_logprobs": K},
    )
    (expected,) = model.sample(
        MESSAGES,
        max_tokens=6,
        seed=5,
        top_logprobs=3,
        include_prompt_logprobs=True,
        prompt_top_logprobs=K,
        return_token_texts=True,
    )
    extra = completion.model_extra or {}
    assert extra["prompt_token_ids"] == list(expected.prompt_token_ids)
    _check_vllm_prompt_logprobs(extra["prompt_logprobs"], expected, K)
    (choice,) = completion.choices
    assert choice.logprobs is not None and choice.logprobs.content is not None
    _check_top_logprobs(choice.logprobs.content, expected)
    # Without prompt_logprobs, vLLM's field is null.
    plain = stack.openai().chat.completions.create(model=MODEL, messages=MESSAGES, max_tokens=1)  # type: ignore[arg-type]
    assert (plain.model_extra or {})["prompt_logprobs"] is None


def test_completions_prompt_logprobs_and_logprobs_k_are_the_samples(
    stack: Stack, model: tinkerrpc.Model
) -> None:
    completion = stack.openai().completions.create(
        model=MODEL, prompt=TEXT, max_tokens=5, seed=9, logprobs=2, extra_body={"prompt_logprobs": 2}
    )
    (expected,) = model.sample(
        TEXT,
        max_tokens=5,
        seed=9,
        top_logprobs=2,
        include_prompt_logprobs=True,
        prompt_top_logprobs=2,
        return_token_texts=True,
    )
    (choice,) = completion.choices
    _check_vllm_prompt_logprobs((choice.model_extra or {})["prompt_logprobs"], expected, 2)
    assert choice.logprobs is not None and choice.logprobs.top_logprobs is not None
    assert choice.logprobs.token_logprobs == pytest.approx(list(expected.logprobs), abs=1e-4)
    for alternatives, top in zip(choice.logprobs.top_logprobs, expected.top_logprobs, strict=True):
        assert list(alternatives) == [a.text for a in top]
        assert list(alternatives.values()) == pytest.approx([a.logprob for a in top], abs=1e-4)


@pytest.mark.parametrize("k", [0, 3])
def test_generate_prompt_logprobs_k(stack: Stack, model: tinkerrpc.Model, k: int) -> None:
    (rendered,) = model.sample(MESSAGES, max_tokens=1)
    prompt = list(rendered.prompt_token_ids)
    answer = httpx.post(
        f"{stack.sidecar.base_url}/inference/v1/generate",
        json={
            "model": f"{MODEL}@0",
            "token_ids": prompt,
            "sampling_params": {"max_tokens": 2, "seed": 1, "prompt_logprobs": k},
        },
        headers={"authorization": f"Bearer {API_KEY}"},
        timeout=60,
    )
    assert answer.status_code == 200, answer.text
    (expected,) = model.sample(
        prompt,
        max_tokens=2,
        seed=1,
        include_prompt_logprobs=True,
        prompt_top_logprobs=k,
        policy_version=0,
        return_token_texts=True,
    )
    _check_vllm_prompt_logprobs(answer.json()["prompt_logprobs"], expected, k)


def test_prompt_logprobs_are_not_streamed(stack: Stack, model: tinkerrpc.Model) -> None:
    with pytest.raises(openai.BadRequestError) as refused:
        stack.openai().chat.completions.create(
            model=MODEL,
            messages=MESSAGES,
            max_tokens=1,
            stream=True,
            extra_body={"prompt_logprobs": 1},  # type: ignore[arg-type]
        )
    assert refused.value.body is not None and refused.value.body.get("param") == "prompt_logprobs"  # type: ignore[union-attr]
