"""What a chat or legacy completion route does, written once: translate the request, then sample once and
answer the completion body or, when `stream` is set, open a SampleStream and answer its chunks as the
tokens arrive."""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Callable, Sequence
from dataclasses import dataclass
from typing import Generic, TypeVar

from fastapi import Response
from pydantic import BaseModel

from tinkerrpc import Sample, SamplingOptions
from tinkerrpc_server.sidecar.chat_protocol import ChatCompletion
from tinkerrpc_server.sidecar.completions_protocol import Completion
from tinkerrpc_server.sidecar.models import ModelRef, parse_model_id
from tinkerrpc_server.sidecar.protocol import SamplingFields
from tinkerrpc_server.sidecar.sample_output import response_json
from tinkerrpc_server.sidecar.sample_streams import OpenedStream, StreamSampler
from tinkerrpc_server.sidecar.sampling_args import Prompt, Sampler
from tinkerrpc_server.sidecar.streaming import chunk_stream

RequestT = TypeVar("RequestT", bound=SamplingFields)


@dataclass(frozen=True)
class CompletionFamily(Generic[RequestT]):
    """One endpoint family's translations: request → Sample arguments and prompt, samples → body
    and stream chunks (both given the request, model, arguments, samples and creation time)."""

    route: str
    sample_args: Callable[[RequestT, ModelRef], SamplingOptions]
    prompt: Callable[[RequestT], Prompt]
    build: Callable[[RequestT, ModelRef, SamplingOptions, Sequence[Sample], int], ChatCompletion | Completion]
    stream_chunks: Callable[
        [RequestT, ModelRef, SamplingOptions, OpenedStream, int], AsyncIterator[BaseModel]
    ]


async def answer(
    family: CompletionFamily[RequestT], request: RequestT, sample: Sampler, stream: StreamSampler
) -> Response:
    ref = parse_model_id(request.model)
    args = family.sample_args(request, ref)
    if request.stream:
        opened = await stream(family.route, ref, family.prompt(request), args)
        chunks = family.stream_chunks(request, ref, args, opened, int(time.time()))
        return chunk_stream(chunks, opened.close, ref.requested)
    samples = await sample(family.route, ref, family.prompt(request), args)
    created = int(time.time())
    body = family.build(request, ref, args, samples, created)
    return Response(response_json(body, request), media_type="application/json")
