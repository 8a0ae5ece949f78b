"""A sample whose tokens arrive as they are made (the SampleStream RPC): `model.sample_stream(prompt,
options)` is an iterator on Model (`for chunk in ...`) and an async one on AsyncModel (`async for`).

The first chunk says what is sampled (`prompt_token_ids`, `policy_version`); then each chunk carries new
tokens of one or more samples (`deltas`); the last carries every `Sample` as `model.sample` returns it
(`samples`: texts, parsed messages, sample keys). A delta's `text` is what its tokens add to the sample's
text; text that could be the start of a stop string waits until it is known, so a stop string never
arrives in pieces. Closing the stream early (leaving its `with` block, `close()`) stops the sampling.
"""

from __future__ import annotations

from dataclasses import dataclass

from tinkerrpc import _convert as convert
from tinkerrpc._call_kinds import WatchCall
from tinkerrpc._sampling import Prompt, SamplingOptions
from tinkerrpc._types import Sample, StopReason, TopLogprob
from tinkerrpc.v1 import trainer_service_pb2 as service_pb


@dataclass(frozen=True)
class SampleDelta:
    """New tokens of one sample (`index` in 0..n-1)."""

    index: int
    tokens: tuple[int, ...]
    logprobs: tuple[float, ...]
    text: str
    top_logprobs: tuple[tuple[TopLogprob, ...], ...] = ()
    token_texts: tuple[str, ...] = ()
    token_bytes: tuple[bytes, ...] = ()
    # Set on the sample's last delta.
    stop_reason: StopReason | None = None


@dataclass(frozen=True)
class SampleChunk:
    """One response of a sample stream: the head, new tokens, or the whole result."""

    deltas: tuple[SampleDelta, ...] = ()
    # The first chunk's: the prompt as the sampler sees it, and the version every sample comes from.
    prompt_token_ids: tuple[int, ...] = ()
    policy_version: int | None = None
    # The last chunk's: every sample, as `model.sample` returns them.
    samples: tuple[Sample, ...] | None = None


def _delta(delta: service_pb.SequenceDelta) -> SampleDelta:
    return SampleDelta(
        index=delta.index,
        tokens=tuple(delta.token_ids),
        logprobs=tuple(delta.logprobs),
        text=delta.text,
        top_logprobs=tuple(convert.top_logprobs_from_proto(top) for top in delta.top_logprobs),
        token_texts=tuple(delta.token_texts),
        token_bytes=tuple(delta.token_bytes),
        stop_reason=convert.stop_reason_from_proto(delta.stop_reason),
    )


def chunk_from_proto(response: service_pb.SampleStreamResponse) -> SampleChunk:
    event = response.WhichOneof("event")
    if event == "head":
        return SampleChunk(
            prompt_token_ids=tuple(response.head.prompt_token_ids),
            policy_version=response.head.policy_version,
        )
    if event == "deltas":
        return SampleChunk(deltas=tuple(_delta(d) for d in response.deltas.sequences))
    if event == "done":
        return SampleChunk(
            policy_version=response.done.policy_version,
            samples=tuple(convert.samples_from_proto(response.done)),
        )
    raise ValueError(f"a SampleStream response without an event: {response}")


def sample_stream(
    model: str, prompt: Prompt, options: SamplingOptions | None = None, *, timeout: float | None = None
) -> WatchCall[SampleChunk]:
    """Sample as `sample` does, with its options as one `SamplingOptions` (the defaults when None),
    receiving the tokens as they are made. `timeout`: seconds for the whole stream (None: no deadline)."""
    request = (options or SamplingOptions()).request(model, prompt)
    return WatchCall(
        "SampleStream", service_pb.SampleStreamRequest(request=request), chunk_from_proto, timeout
    )
