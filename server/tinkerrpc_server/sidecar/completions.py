"""`POST /v1/completions`: OpenAI's legacy completions, one text or token-id prompt per request.

Logprobs take the legacy shape (tokens, token_logprobs, top_logprobs, text_offset); `echo` puts the
prompt's text before the sampled one.
"""

from __future__ import annotations

from collections.abc import Iterator, Sequence
from typing import Any, Literal

from fastapi import APIRouter, Response

from tinkerrpc import Sample, SamplingOptions
from tinkerrpc_server.sidecar.completion_route import CompletionFamily, answer
from tinkerrpc_server.sidecar.completions_protocol import Completion, CompletionChoice, CompletionRequest
from tinkerrpc_server.sidecar.errors import bad_request
from tinkerrpc_server.sidecar.json_bounds import BoundedJSONRoute
from tinkerrpc_server.sidecar.models import ModelRef
from tinkerrpc_server.sidecar.openai_shapes import Logprobs
from tinkerrpc_server.sidecar.sample_output import (
    ReplyHead,
    rl_fields_asked,
    split_by_tokens,
    stop_truncated,
    token_label,
    token_text,
    usage_of,
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
        )
        for index, sample in enumerate(samples)
    ]
    return Completion(**head.body_fields(samples), choices=choices)


def completion_stream_chunks(
    request: CompletionRequest, ref: ModelRef, args: SamplingOptions, samples: Sequence[Sample], created: int
) -> Iterator[Completion]:
    """Legacy completion chunks, one per sampled token, interleaved by index.

    When asked, each choice's first chunk carries its complete `token_ids`, `policy_version` and
    the `prompt_token_ids`, as in a chat stream.
    """
    head = ReplyHead.of("cmpl", ref, samples, created)
    rl_fields = rl_fields_asked(request.return_token_ids, request.logprobs is not None)

    def chunk(choices: list[CompletionChoice], **extra: Any) -> Completion:
        return Completion(**head.fields(), choices=choices, **extra)

    texts = [completion_text(s, args.stop, request) for s in samples]
    pieces = [split_by_tokens(t, s) for t, s in zip(texts, samples, strict=True)]
    echoes = [completion_echo(request, s) for s in samples]
    for index, echo in enumerate(echoes):
        if echo:
            yield chunk([CompletionChoice(index=index, text=echo, finish_reason=None, logprobs=None)])
    offsets = [len(echo) for echo in echoes]
    for position in range(max((len(p) for p in pieces), default=0)):
        for index, sample in enumerate(samples):
            if position >= len(pieces[index]):
                continue
            logprobs = (
                _legacy_logprobs(
                    sample, range(position, position + 1), offsets[index], request.return_tokens_as_token_ids
                )
                if request.logprobs is not None and position < len(sample.tokens)
                else None
            )
            offsets[index] += len(token_text(sample, position))
            choice = CompletionChoice(
                index=index, text=pieces[index][position], finish_reason=None, logprobs=logprobs
            )
            if not (rl_fields and position == 0):
                yield chunk([choice])
                continue
            choice.token_ids, choice.policy_version = list(sample.tokens), sample.policy_version
            choice.sample_key = sample.sample_key or None
            yield chunk(
                [choice], prompt_token_ids=list(sample.prompt_token_ids), policy_version=head.policy_version
            )
    for index, sample in enumerate(samples):
        yield chunk([CompletionChoice(index=index, text="", finish_reason=_finish(sample), logprobs=None)])
    if request.stream_options is not None and request.stream_options.include_usage:
        yield chunk([], usage=usage_of(samples))


COMPLETIONS = CompletionFamily(
    ROUTE, completion_sample_args, completion_prompt, build_completion, completion_stream_chunks
)


def create_router(sample: Sampler) -> APIRouter:
    router = APIRouter(route_class=BoundedJSONRoute)

    @router.post(ROUTE, response_model=None)
    async def completions(request: CompletionRequest) -> Response:
        return await answer(COMPLETIONS, request, sample)

    return router
