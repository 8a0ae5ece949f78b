"""Finished samples as the SampleStream the sidecar's stream builders read (one delta per token position,
interleaved by sample, the last of each sample with its stop reason), and a builder's output collected:
the stream builders tested without a server."""

from __future__ import annotations

import asyncio
from collections.abc import AsyncIterator, Sequence
from typing import TypeVar

from tinkerrpc import Sample, SampleChunk, SampleDelta
from tinkerrpc_server.sidecar.sample_streams import OpenedStream

T = TypeVar("T")


def replayed(samples: Sequence[Sample]) -> OpenedStream:
    async def chunks() -> AsyncIterator[SampleChunk]:
        for position in range(max(len(s.tokens) for s in samples)):
            deltas = tuple(
                SampleDelta(
                    index=index,
                    tokens=(s.tokens[position],),
                    logprobs=(s.logprobs[position],),
                    text=s.token_texts[position],
                    top_logprobs=s.top_logprobs[position : position + 1],
                    token_texts=s.token_texts[position : position + 1],
                    token_bytes=s.token_bytes[position : position + 1],
                    stop_reason=s.stop_reason if position == len(s.tokens) - 1 else None,
                )
                for index, s in enumerate(samples)
                if position < len(s.tokens)
            )
            yield SampleChunk(deltas=deltas)
        yield SampleChunk(policy_version=samples[0].policy_version, samples=tuple(samples))

    async def close() -> None:
        pass

    head = SampleChunk(prompt_token_ids=samples[0].prompt_token_ids, policy_version=samples[0].policy_version)
    return OpenedStream(head, chunks(), close)


def collected(stream: AsyncIterator[T]) -> list[T]:
    async def collect() -> list[T]:
        return [item async for item in stream]

    return asyncio.run(collect())
