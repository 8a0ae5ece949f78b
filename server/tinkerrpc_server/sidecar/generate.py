"""`POST /inference/v1/generate`: vLLM's tokens-in, tokens-out endpoint, which RL training clients call
after rendering the conversation themselves (the `renderers` package's client, used by verifiers'
TrainClient and prime-rl).

Token ids and vLLM's `sampling_params` in; per choice the sampled `token_ids`, their logprobs as chat
logprob entries labelled `token_id:N` (what that client checks), and the RL fields every route returns
(`policy_version`, `sample_key`, `prompt_token_ids`). No text is returned: the client parses the tokens.
With `stream`, vLLM's server-sent events: a GenerateStreamResponse per batch of new tokens as they are
made, then `data: [DONE]`.
"""

from __future__ import annotations

import re
import time
from collections.abc import AsyncIterator, Sequence

from fastapi import APIRouter, Response

from tinkerrpc import Sample, SampleDelta, SamplingOptions
from tinkerrpc.contract.sampling import SIDECAR_CHAT_MAX_TOKENS
from tinkerrpc_server.sidecar.errors import OpenAIError, bad_request
from tinkerrpc_server.sidecar.generate_protocol import (
    GenerateChoice,
    GenerateFinishReason,
    GenerateRequest,
    GenerateResponse,
    GenerateSamplingParams,
    GenerateStreamChoice,
    GenerateStreamResponse,
)
from tinkerrpc_server.sidecar.json_bounds import BoundedJSONRoute
from tinkerrpc_server.sidecar.models import ModelRef, parse_model_id
from tinkerrpc_server.sidecar.openai_shapes import ChoiceLogprobs
from tinkerrpc_server.sidecar.prompt_logprobs import prompt_logprob_options, vllm_prompt_logprobs
from tinkerrpc_server.sidecar.protocol import Usage
from tinkerrpc_server.sidecar.sample_output import ReplyHead, chat_logprob_entry, new_id, usage_of
from tinkerrpc_server.sidecar.sample_streams import (
    OpenedStream,
    StreamSampler,
    delta_sample,
    deltas_then_samples,
)
from tinkerrpc_server.sidecar.sampling_args import (
    Sampler,
    base_sample_args,
    check_neutral_knobs,
    stop_list,
)
from tinkerrpc_server.sidecar.streaming import chunk_stream

ROUTE = "/inference/v1/generate"
PARAMS = "sampling_params."


def _check_served(request: GenerateRequest) -> None:
    """400 naming the first field the sampler cannot honour."""
    params = request.sampling_params
    check_neutral_knobs(params, PARAMS)
    refused = (
        ("logit_bias", bool(params.logit_bias)),
        ("allowed_token_ids", params.allowed_token_ids is not None),
        ("bad_words", bool(params.bad_words)),
        ("structured_outputs", params.structured_outputs is not None),
    )
    for name, is_set in refused:
        if is_set:
            raise bad_request(
                f"{PARAMS}{name} is not supported: Tinker's sampler cannot mask tokens", PARAMS + name
            )
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if request.priority != 0:
        raise bad_request("priority must be 0: this server does not schedule by priority", "priority")


def generate_sample_args(request: GenerateRequest, ref: ModelRef) -> SamplingOptions:
    _check_served(request)
    params = request.sampling_params
    max_tokens = params.max_tokens if params.max_tokens is not None else SIDECAR_CHAT_MAX_TOKENS
    if params.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens ({params.min_tokens}) must not exceed max_tokens ({max_tokens})",
            PARAMS + "min_tokens",
        )
    return base_sample_args(
        params,
        ref,
        n=params.n,
        max_tokens=max_tokens,
        top_logprobs=params.logprobs or 0,
        **prompt_logprob_options(params.prompt_logprobs, request.stream),
        stop=stop_list(params.stop, PARAMS + "stop"),
        stop_token_ids=list(params.stop_token_ids or ()),
        ignore_default_stops=params.ignore_eos,
        min_tokens=params.min_tokens,
        skip_special_tokens=params.skip_special_tokens,
        spaces_between_special_tokens=params.spaces_between_special_tokens,
    )


_PARAM_ROOT = re.compile(r"[.\[]")


def generate_param(param: str | None) -> str | None:
    """A parameter the app's Sample call named (the chat route's names) as this request names it:
    the prompt is `token_ids`, the sampling knobs live under `sampling_params`."""
    if param is None:
        return None
    root = _PARAM_ROOT.split(param, maxsplit=1)[0]
    if root == "prompt":
        return "token_ids" + param[len(root) :]
    if root == "top_logprobs":
        return PARAMS + "logprobs" + param[len(root) :]
    if root in GenerateSamplingParams.model_fields:
        return PARAMS + param
    return param


def finish_reason(stop_reason: str | None) -> GenerateFinishReason:
    return "length" if stop_reason == "length" else "stop"


def token_logprobs(request: GenerateRequest, sample: Sample) -> ChoiceLogprobs | None:
    """The logprob entries of `sample`'s tokens, labelled `token_id:N`, when the request asks."""
    if request.sampling_params.logprobs is None:
        return None
    return ChoiceLogprobs(
        content=[chat_logprob_entry(sample, p, as_token_ids=True) for p in range(len(sample.tokens))]
    )


def build_generate_response(
    request: GenerateRequest, ref: ModelRef, samples: Sequence[Sample], created: int
) -> GenerateResponse:
    head = ReplyHead.of("gen", ref, samples, created)
    choices = [
        GenerateChoice(
            index=index,
            logprobs=token_logprobs(request, sample),
            finish_reason=finish_reason(sample.stop_reason),
            token_ids=list(sample.tokens),
            policy_version=sample.policy_version,
            sample_key=sample.sample_key or None,
        )
        for index, sample in enumerate(samples)
    ]
    return GenerateResponse(
        request_id=request.request_id or head.id,
        model=head.model,
        created=created,
        choices=choices,
        usage=usage_of(samples),
        prompt_logprobs=vllm_prompt_logprobs(samples),
        prompt_token_ids=list(samples[0].prompt_token_ids) if samples else list(request.token_ids),
        policy_version=head.policy_version,
    )


async def generate_stream_chunks(
    request: GenerateRequest, opened: OpenedStream
) -> AsyncIterator[GenerateStreamResponse]:
    """vLLM's generate stream: a chunk per batch of a choice's new tokens as they are made (with their
    logprobs when asked), the first carrying the prompt; a choice's last tokens are held until every
    sample is there, so that their chunk carries the finish_reason (as vLLM's does) and the sample_key;
    then the usage when `stream_options.include_usage` asks."""
    version = opened.policy_version
    request_id = request.request_id or new_id("gen")
    prompt = list(opened.head.prompt_token_ids)
    options = request.stream_options
    include_usage = options is not None and options.include_usage
    continuous_usage = include_usage and options is not None and options.continuous_usage_stats
    made = [0] * request.sampling_params.n
    last: dict[int, SampleDelta] = {}
    first = True

    def chunk(
        delta: SampleDelta | None,
        index: int,
        finish: GenerateFinishReason | None = None,
        key: str | None = None,
    ) -> GenerateStreamResponse:
        nonlocal first
        tokens = delta.tokens if delta is not None else ()
        made[index] += len(tokens)
        logprobs = token_logprobs(request, delta_sample(delta, version)) if delta is not None else None
        choice = GenerateStreamChoice(
            index=index,
            logprobs=logprobs,
            finish_reason=finish,
            token_ids=list(tokens),
            policy_version=version,
            sample_key=key,
        )
        usage = Usage(
            prompt_tokens=len(prompt), completion_tokens=made[index], total_tokens=len(prompt) + made[index]
        )
        response = GenerateStreamResponse(
            request_id=request_id,
            choices=[choice],
            usage=usage if continuous_usage else None,
            prompt_token_ids=prompt if first else None,
            policy_version=version,
        )
        first = False
        return response

    async for item in deltas_then_samples(opened):
        if isinstance(item, tuple):
            for index, sample in enumerate(item):
                yield chunk(
                    last.get(index), index, finish_reason(sample.stop_reason), sample.sample_key or None
                )
            if include_usage:
                yield GenerateStreamResponse(
                    request_id=request_id, choices=[], usage=usage_of(item), policy_version=version
                )
            return
        if item.stop_reason is not None:
            last[item.index] = item
        elif item.tokens:
            yield chunk(item, item.index)


async def _answer(request: GenerateRequest, sample: Sampler, stream: StreamSampler) -> Response:
    ref = parse_model_id(request.model)
    args = generate_sample_args(request, ref)
    prompt = list(request.token_ids)
    if request.stream:
        opened = await stream(ROUTE, ref, prompt, args)
        frames = generate_stream_chunks(request, opened)
        return chunk_stream(frames, opened.close, ref.requested, GenerateStreamResponse.frame_json)
    samples = await sample(ROUTE, ref, prompt, args)
    body = build_generate_response(request, ref, samples, int(time.time()))
    return Response(body.model_dump_json(), media_type="application/json")


def create_router(sample: Sampler, stream: StreamSampler) -> APIRouter:
    router = APIRouter(route_class=BoundedJSONRoute)

    @router.post(ROUTE, response_model=None)
    async def generate(request: GenerateRequest) -> Response:
        try:
            return await _answer(request, sample, stream)
        except OpenAIError as error:
            error.param = generate_param(error.param)
            raise

    return router
