"""SampleStream through the SDK (sync and async) against a real server and engine: tokens arrive while the
sample is being made, the deltas join to the Sample the last chunk carries (and Sample would give), a
stop string is never sent in pieces, the request is checked as Sample's, and closing the stream stops
the sampling."""

from __future__ import annotations

import asyncio
import dataclasses
from collections.abc import Iterator, Sequence

import pytest
from svc import TINY, Server, poll_until

import tinkerrpc
from tinkerrpc import SampleChunk, SamplingOptions
from tinkerrpc_server.stream_text import held_back_from

pytestmark = pytest.mark.process

MODEL = "stream-model"
PROMPT = "Once upon a time"


@pytest.fixture(scope="module")
def client(server: Server) -> Iterator[tinkerrpc.Client]:
    with tinkerrpc.Client(server.proc.target) as sdk:
        sdk.create_model(MODEL, base_model=TINY, lora_rank=8)
        yield sdk


def _joined(chunks: Sequence[SampleChunk], index: int) -> tuple[list[int], str]:
    deltas = [d for c in chunks for d in c.deltas if d.index == index]
    return [t for d in deltas for t in d.tokens], "".join(d.text for d in deltas)


def test_the_stream_sends_tokens_then_the_whole_sample(client: tinkerrpc.Client) -> None:
    options = SamplingOptions(
        max_tokens=64, seed=5, ignore_default_stops=True, top_logprobs=2, return_token_texts=True
    )
    model = client.model(MODEL)
    with model.sample_stream(PROMPT, options) as stream:
        chunks = list(stream)
    head, *middle, last = chunks
    assert head.policy_version == 0 and head.prompt_token_ids
    assert len(middle) > 8, "the tokens came in a few pieces, not as they were made"
    assert last.samples is not None
    (sample,) = last.samples
    tokens, text = _joined(middle, 0)
    assert tokens == list(sample.tokens) and len(tokens) == 64
    assert text == sample.text
    assert [len(top) for d in (d for c in middle for d in c.deltas) for top in d.top_logprobs] == [2] * 64
    assert [d.stop_reason for c in middle for d in c.deltas][-1] == "length"
    assert sample.sample_key and sample.prompt_token_ids == head.prompt_token_ids
    # The same seed through Sample draws the same tokens.
    (unary,) = model.sample(PROMPT, options=options)
    assert unary.tokens == sample.tokens and unary.text == sample.text


def test_the_async_stream_interleaves_samples(server: Server, client: tinkerrpc.Client) -> None:
    async def stream() -> list[SampleChunk]:
        async with tinkerrpc.AsyncClient(server.proc.target) as sdk:
            options = SamplingOptions(n=2, max_tokens=24, seed=9, ignore_default_stops=True)
            return [chunk async for chunk in sdk.model(MODEL).sample_stream([1, 2, 3], options)]

    chunks = asyncio.run(stream())
    samples = chunks[-1].samples
    assert samples is not None and len(samples) == 2
    for index, sample in enumerate(samples):
        tokens, text = _joined(chunks, index)
        assert tokens == list(sample.tokens) and text == sample.text


def test_a_stop_string_is_never_sent_in_pieces(client: tinkerrpc.Client) -> None:
    greedy = SamplingOptions(
        max_tokens=48, temperature=0.0, ignore_default_stops=True, return_token_texts=True
    )
    model = client.model(MODEL)
    (plain,) = model.sample(PROMPT, options=greedy)
    # A stop string spanning two tokens, at its first occurrence in the text.
    ends = [len("".join(plain.token_texts[: i + 1])) for i in range(len(plain.token_texts))]
    stop_at, stop = next(
        (end - 2, plain.text[end - 2 : end + 2])
        for end in ends[4:-4]
        if "\ufffd" not in plain.text[end - 2 : end + 2]
        and plain.text.find(plain.text[end - 2 : end + 2]) == end - 2
    )
    with model.sample_stream(PROMPT, dataclasses.replace(greedy, stop=(stop,))) as stream:
        chunks = list(stream)
    deltas = [d for c in chunks for d in c.deltas]
    (sample,) = chunks[-1].samples or ()
    assert sample.stop_reason == "stop" and sample.text.find(stop) == stop_at
    assert "".join(d.text for d in deltas) == sample.text
    sent_before_the_end = "".join(d.text for d in deltas[:-1])
    assert len(sent_before_the_end) <= stop_at, "part of the stop string was sent before it was known"


def test_held_back_text() -> None:
    assert held_back_from("hello wor", ["world"]) == len("hello ")
    assert held_back_from("hello", ["xyz"]) == 5
    assert held_back_from("ab\ufffd", []) == 2
    assert held_back_from("a stop", ["stop"]) == len("a stop")  # a whole stop is not held (it ended)


def test_the_stream_checks_requests_as_sample_does(client: tinkerrpc.Client) -> None:
    model = client.model(MODEL)
    with pytest.raises(tinkerrpc.InvalidArgumentError) as streamed:
        list(model.sample_stream(PROMPT, SamplingOptions(max_tokens=10**9)))
    with pytest.raises(tinkerrpc.InvalidArgumentError) as unary:
        model.sample(PROMPT, max_tokens=10**9)
    assert str(streamed.value) == str(unary.value)
    with pytest.raises(tinkerrpc.NotFoundError):
        list(client.model("no-such-model").sample_stream(PROMPT))


def test_closing_the_stream_stops_the_sampling(server: Server, client: tinkerrpc.Client) -> None:
    options = SamplingOptions(max_tokens=2000, ignore_default_stops=True)
    left = server.proc.log().count("its reader left")
    with client.model(MODEL).sample_stream([5, 6, 7], options) as stream:
        head = next(stream)
        first = next(stream)
    assert head.prompt_token_ids == (5, 6, 7) and first.deltas and first.samples is None
    # The engine drops the request at its next decode step, long before its 2000 tokens.
    assert poll_until(lambda: server.proc.log().count("its reader left") > left, 20)
