"""Identical unseeded requests that arrive together are drawn in one Sample call (sidecar/coalescing.py):
through the real sidecar and server with the openai client, and the gathering rules on their own."""

from __future__ import annotations

import asyncio
import re
from typing import Any

import grpc
import pytest
from sidecar_support import Stack

from tinkerrpc import RPCError, Sample
from tinkerrpc_server.sidecar.coalescing import MAX_MERGED_N, SampleCoalescer
from tinkerrpc_server.sidecar.sampling_args import Prompt, SampleArgs

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


ARGS = SampleArgs(
    n=1, max_tokens=4, temperature=1.0, top_p=None, top_k=0, seed=None, policy_version=None, top_logprobs=0
)


class Upstream:
    """An upstream Sample call that answers n numbered samples, after `delay`, or fails as told."""

    def __init__(self, delay: float = 0.0, max_n: int | None = None) -> None:
        self.calls: list[int] = []
        self.cancelled = 0
        self.delay = delay
        self.max_n = max_n

    async def __call__(self, name: str, prompt: Prompt, args: SampleArgs) -> list[Sample]:
        self.calls.append(args.n)
        if self.max_n is not None and args.n > self.max_n:
            raise RPCError(grpc.StatusCode.INVALID_ARGUMENT, f"params.n: {args.n} is over the limit")
        try:
            await asyncio.sleep(self.delay)
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        start = sum(self.calls[:-1])
        return [Sample((start + i,), (0.0,), f"{start + i}", None, "length", 0, (1,)) for i in range(args.n)]


async def test_members_get_disjoint_samples_in_one_call_up_to_the_cap() -> None:
    upstream = Upstream()
    merged: list[int] = []
    coalescer = SampleCoalescer(upstream, merged.append)
    answers = await asyncio.gather(*(coalescer.sample("m", "p", ARGS) for _ in range(MAX_MERGED_N + 3)))
    assert upstream.calls == [MAX_MERGED_N, 3] and merged == [MAX_MERGED_N, 3]
    tokens = [sample.tokens for answer in answers for sample in answer]
    assert len(tokens) == len(set(tokens)) == MAX_MERGED_N + 3
    # Different prompts or arguments never share a call.
    upstream.calls.clear()
    await asyncio.gather(
        coalescer.sample("m", "p", ARGS),
        coalescer.sample("m", "q", ARGS),
        coalescer.sample("m", "p", SampleArgs(**{**ARGS.sdk_kwargs(), "temperature": 0.5})),
        coalescer.sample("other", "p", ARGS),
    )
    assert upstream.calls == [1, 1, 1, 1]


async def test_a_merged_call_the_server_refuses_is_retried_member_by_member() -> None:
    upstream = Upstream(max_n=2)
    coalescer = SampleCoalescer(upstream)
    answers = await asyncio.gather(*(coalescer.sample("m", "p", ARGS) for _ in range(3)))
    assert upstream.calls == [3, 1, 1, 1] and [len(a) for a in answers] == [1, 1, 1]
    # A request that is refused alone gets its own refusal.
    with pytest.raises(RPCError) as refused:
        await coalescer.sample("m", "p", SampleArgs(**{**ARGS.sdk_kwargs(), "n": 3}))
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT


async def test_a_member_that_goes_away_leaves_the_call_to_the_others() -> None:
    upstream = Upstream(delay=0.2)
    coalescer = SampleCoalescer(upstream)
    leaving = asyncio.ensure_future(coalescer.sample("m", "p", ARGS))
    staying = asyncio.ensure_future(coalescer.sample("m", "p", ARGS))
    await asyncio.sleep(0.05)
    leaving.cancel()
    assert len(await staying) == 1 and upstream.calls == [2] and upstream.cancelled == 0
    # When every member goes away, the call is dropped.
    lone = [asyncio.ensure_future(coalescer.sample("m", "p", ARGS)) for _ in range(2)]
    await asyncio.sleep(0.05)
    for member in lone:
        member.cancel()
    await asyncio.sleep(0.01)
    assert upstream.cancelled == 1
