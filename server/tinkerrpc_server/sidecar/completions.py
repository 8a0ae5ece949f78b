"""`POST /v1/completions`: OpenAI's legacy completions, one text or token-id prompt per request.

Logprobs take the legacy shape (tokens, token_logprobs, top_logprobs, text_offset); `echo` puts the
prompt's text before the sampled one.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any, Literal

from fastapi import APIRouter, Response

from tinkerrpc import Sample, SamplingOptions
from tinkerrpc_server.sidecar.completion_route import CompletionFamily, answer
from tinkerrpc_server.sidecar.completions_protocol import Completion, CompletionChoice, CompletionRequest
from tinkerrpc_server.sidecar.errors import bad_request
from tinkerrpc_server.sidecar.json_bounds import BoundedJSONRoute
from tinkerrpc_server.sidecar.models import ModelRef
from tinkerrpc_server.sidecar.openai_shapes import Logprobs
from tinkerrpc_server.sidecar.prompt_logprobs import vllm_prompt_logprobs
from tinkerrpc_server.sidecar.sample_output import (
    ReplyHead,
    new_id,
    rl_fields_asked,
    stop_truncated,
    token_label,
    token_text,
    usage_of,
)
from tinkerrpc_server.sidecar.sample_streams import (
    ChoiceContent,
    OpenedStream,
    StreamSampler,
    delta_sample,
    deltas_then_samples,
)
from tinkerrpc_server.sidecar.sampling_args import (
    Sampler,
    check_sampling_fields,
    sampling_fields_args,
)

ROUTE = "/v1/completions"


def completion_prompt(request: CompletionRequest) -> str | list[int]:
    """The single prompt of a legacy completion: text or token ids."""
    prompt = request.prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return prompt
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        return [int(p) for p in prompt]  # type: ignore[arg-type]
    if len(prompt) > 1:
        raise bad_request("batches of prompts are not supported: send one prompt per request", "prompt")
    return completion_prompt(request.model_copy(update={"prompt": prompt[0]}))


def completion_sample_args(request: CompletionRequest, ref: ModelRef) -> SamplingOptions:
    check_sampling_fields(request)
    if request.echo and request.logprobs is not None:
        raise bad_request(
            "echo with logprobs is not supported (the prompt's logprobs are not returned here)", "echo"
        )
    if request.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    max_tokens = request.max_tokens if request.max_tokens is not None else 16
    return sampling_fields_args(
        request, ref, max_tokens, request.logprobs or 0, return_prompt_text=request.echo
    )


def _legacy_logprobs(sample: Sample, positions: range, text_start: int, as_token_ids: bool) -> Logprobs:
    tokens: list[str] = []
    offsets: list[int] = []
    top: list[dict[str, float]] = []
    offset = text_start
    for p in positions:
        text = token_text(sample, p)
        tokens.append(token_label(sample.tokens[p], text, as_token_ids))
        offsets.append(offset)
        offset += len(text)
        alternatives = sample.top_logprobs[p] if p < len(sample.top_logprobs) else ()
        top.append({token_label(a.token_id, a.text, as_token_ids): a.logprob for a in alternatives})
    return Logprobs(
        tokens=tokens,
        token_logprobs=[sample.logprobs[p] for p in positions],
        top_logprobs=top if sample.top_logprobs else None,
        text_offset=offsets,
    )


def completion_text(sample: Sample, stops: Sequence[str], request: CompletionRequest) -> str:
    """The sampled text, stop strings cut as asked (the prompt's text before it when echoed)."""
    return stop_truncated(sample.text, sample, stops, request)


def completion_echo(request: CompletionRequest, sample: Sample) -> str:
    if not request.echo:
        return ""
    return request.prompt if isinstance(request.prompt, str) else sample.prompt_text


def _finish(sample: Sample) -> Literal["stop", "length"]:
    return "length" if sample.stop_reason == "length" else "stop"


def build_completion(
    request: CompletionRequest, ref: ModelRef, args: SamplingOptions, samples: Sequence[Sample], created: int
) -> Completion:
    head = ReplyHead.of("cmpl", ref, samples, created)
    prompt_logprobs = vllm_prompt_logprobs(samples)
    choices = [
        CompletionChoice(
            index=index,
            text=completion_echo(request, sample) + completion_text(sample, args.stop, request),
            finish_reason=_finish(sample),
            logprobs=_legacy_logprobs(
                sample, range(len(sample.tokens)), 0, request.return_tokens_as_token_ids
            )
            if request.logprobs is not None
            else None,
            token_ids=list(sample.tokens),
            policy_version=sample.policy_version,
            sample_key=sample.sample_key or None,
            prompt_logprobs=prompt_logprobs,
        )
        for index, sample in enumerate(samples)
    ]
    return Completion(**head.body_fields(samples), choices=choices)


async def completion_stream_chunks(
    request: CompletionRequest, ref: ModelRef, args: SamplingOptions, opened: OpenedStream, created: int
) -> AsyncIterator[Completion]:
    """Legacy completion chunks, each choice's as its tokens arrive, interleaved by index.

    When asked, each chunk carries its tokens' `token_ids` (vLLM's shape), each choice's first chunk its
    `policy_version` and the `prompt_token_ids`, and its last chunk its `sample_key`. An echoed prompt
    given as token ids has its text only once the samples are there: such a stream sends its text then.
    """
    head = ReplyHead(new_id("cmpl"), created, ref.served_id(opened.policy_version), opened.policy_version)
    rl_fields = rl_fields_asked(request.return_token_ids, request.logprobs is not None)

    def chunk(choices: list[CompletionChoice], **extra: Any) -> Completion:
        return Completion(**head.fields(), choices=choices, **extra)

    echo_first = request.echo and isinstance(request.prompt, str)
    contents = [ChoiceContent(chat=False, held=request.echo and not echo_first) for _ in range(args.n)]
    offsets = [0] * args.n
    started = [False] * args.n
    if echo_first:
        assert isinstance(request.prompt, str)
        offsets = [len(request.prompt)] * args.n
        for index in range(args.n):
            yield chunk(
                [CompletionChoice(index=index, text=request.prompt, finish_reason=None, logprobs=None)]
            )
    samples: tuple[Sample, ...] = ()
    async for item in deltas_then_samples(opened):
        if isinstance(item, tuple):
            samples = item
            break
        index = item.index
        text = contents[index].take(item)
        part = delta_sample(item, opened.policy_version)
        logprobs = (
            _legacy_logprobs(
                part, range(len(item.tokens)), offsets[index], request.return_tokens_as_token_ids
            )
            if request.logprobs is not None
            else None
        )
        offsets[index] += sum(len(token_text(part, p)) for p in range(len(item.tokens)))
        choice = CompletionChoice(index=index, text=text, finish_reason=None, logprobs=logprobs)
        if not rl_fields:
            if text or logprobs is not None:
                yield chunk([choice])
            continue
        choice.token_ids = list(item.tokens)
        if started[index]:
            yield chunk([choice])
            continue
        started[index] = True
        choice.policy_version = opened.policy_version
        yield chunk(
            [choice], prompt_token_ids=list(opened.head.prompt_token_ids), policy_version=head.policy_version
        )
    for index, sample in enumerate(samples):
        echo = completion_echo(request, sample) if not echo_first else ""
        rest = echo + contents[index].finish(completion_text(sample, args.stop, request))
        if rest:
            yield chunk([CompletionChoice(index=index, text=rest, finish_reason=None, logprobs=None)])
    for index, sample in enumerate(samples):
        last = CompletionChoice(index=index, text="", finish_reason=_finish(sample), logprobs=None)
        last.sample_key = (sample.sample_key or None) if rl_fields else None
        yield chunk([last])
    if request.stream_options is not None and request.stream_options.include_usage:
        yield chunk([], usage=usage_of(samples))


COMPLETIONS = CompletionFamily(
    ROUTE, completion_sample_args, completion_prompt, build_completion, completion_stream_chunks
)


def create_router(sample: Sampler, stream: StreamSampler) -> APIRouter:
    router = APIRouter(route_class=BoundedJSONRoute)

    @router.post(ROUTE, response_model=None)
    async def completions(request: CompletionRequest) -> Response:
        return await answer(COMPLETIONS, request, sample, stream)

    return router
