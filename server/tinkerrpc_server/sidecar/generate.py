"""`POST /inference/v1/generate`: vLLM's tokens-in, tokens-out endpoint, which RL training clients call
after rendering the conversation themselves (the `renderers` package's client, used by verifiers'
TrainClient and prime-rl).

Token ids and vLLM's `sampling_params` in; per choice the sampled `token_ids`, their logprobs as chat
logprob entries labelled `token_id:N` (what that client checks), and the RL fields every route returns
(`policy_version`, `sample_key`, `prompt_token_ids`). No text is returned: the client parses the tokens.
"""

from __future__ import annotations

import re
import time
from collections.abc import Sequence

from fastapi import APIRouter, Response

from tinkerrpc import Sample, SamplingOptions
from tinkerrpc.contract.sampling import SIDECAR_CHAT_MAX_TOKENS
from tinkerrpc_server.sidecar.errors import OpenAIError, bad_request
from tinkerrpc_server.sidecar.generate_protocol import (
    GenerateChoice,
    GenerateRequest,
    GenerateResponse,
    GenerateSamplingParams,
)
from tinkerrpc_server.sidecar.json_bounds import BoundedJSONRoute
from tinkerrpc_server.sidecar.models import ModelRef, parse_model_id
from tinkerrpc_server.sidecar.openai_shapes import ChoiceLogprobs
from tinkerrpc_server.sidecar.prompt_logprobs import prompt_logprob_options, vllm_prompt_logprobs
from tinkerrpc_server.sidecar.sample_output import ReplyHead, chat_logprob_entry, usage_of
from tinkerrpc_server.sidecar.sampling_args import (
    Sampler,
    base_sample_args,
    check_neutral_knobs,
    stop_list,
)

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
    if request.stream:
        raise bad_request("stream is not served on /inference/v1/generate: send stream false", "stream")
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
        **prompt_logprob_options(params.prompt_logprobs),
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


def build_generate_response(
    request: GenerateRequest, ref: ModelRef, samples: Sequence[Sample], created: int
) -> GenerateResponse:
    head = ReplyHead.of("gen", ref, samples, created)
    logprobs_asked = request.sampling_params.logprobs is not None
    choices = [
        GenerateChoice(
            index=index,
            logprobs=ChoiceLogprobs(
                content=[chat_logprob_entry(sample, p, as_token_ids=True) for p in range(len(sample.tokens))]
            )
            if logprobs_asked
            else None,
            finish_reason="length" if sample.stop_reason == "length" else "stop",
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


def create_router(sample: Sampler) -> APIRouter:
    router = APIRouter(route_class=BoundedJSONRoute)

    @router.post(ROUTE, response_model=None)
    async def generate(request: GenerateRequest) -> Response:
        ref = parse_model_id(request.model)
        args = generate_sample_args(request, ref)
        try:
            samples = await sample(ROUTE, ref, list(request.token_ids), args)
        except OpenAIError as error:
            error.param = generate_param(error.param)
            raise
        body = build_generate_response(request, ref, samples, int(time.time()))
        return Response(body.model_dump_json(), media_type="application/json")

    return router
