"""Sample: the prompt (rendered chat, token ids or tokenized text), Tinker's sampling parameters, and
the response's sequences (text, parsed message, token texts, top logprobs) at a pinned or the latest
policy version. Rendering, tokenising and decoding run off the event loop."""

from __future__ import annotations

import asyncio
import math

import tinker

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service import errors
from tinkerrpc_server.service.limits import Limits
from tinkerrpc_server.service.models import VERSION_RESOURCE, ModelRegistry
from tinkerrpc_server.service.rendering import ChatCodec, off_loop, to_proto_message
from tinkerrpc_server.service.store import Store
from tinkerrpc_server.service.validation import check_prompt, check_prompt_tokens, check_sampling_params


def _prompt(request: pb.SampleRequest, codec: ChatCodec) -> list[int]:
    prompt: list[int]
    if request.WhichOneof("prompt") == "chat":
        prompt = codec.generation_prompt(list(request.chat.messages), list(request.chat.tools))
    elif request.WhichOneof("prompt") == "tokens":
        prompt = list(request.tokens.token_ids)
    else:
        prompt = list(codec.tokenizer.encode(request.text, add_special_tokens=False))
    check_prompt_tokens(request, prompt, codec.vocab_size)
    return prompt


def _sampling_params(params: types_pb2.SamplingParams, codec: ChatCodec) -> tinker.types.SamplingParams:
    stop_tokens = list(params.stop_token_ids)
    if not params.ignore_default_stops:
        stop_tokens += [t for t in codec.default_stop_tokens() if t not in stop_tokens]
    # Tinker takes either stop strings or stop token ids: with both, tokens become their texts.
    stop: list[str] | list[int] = (
        [*params.stop, *(codec.token_text(t) for t in stop_tokens)] if params.stop else stop_tokens
    )
    return tinker.types.SamplingParams(
        max_tokens=params.max_tokens,
        seed=params.seed if params.HasField("seed") else None,
        stop=stop,
        temperature=params.temperature if params.HasField("temperature") else 1.0,
        top_k=params.top_k or -1,
        top_p=params.top_p if params.HasField("top_p") else 1.0,
    )


def _sampled_sequence(
    sequence: tinker.types.SampledSequence, request: pb.SampleRequest, version: int, codec: ChatCodec
) -> types_pb2.SampledSequence:
    tokens = sequence.tokens
    sampled = types_pb2.SampledSequence(
        token_ids=tokens,
        logprobs=sequence.logprobs or [],
        text=codec.decode(tokens),
        stop_reason=types_pb2.STOP_REASON_LENGTH
        if sequence.stop_reason == "length"
        else types_pb2.STOP_REASON_STOP,
        policy_version=version,
    )
    if request.WhichOneof("prompt") == "chat":
        message, _termination = codec.renderer.parse_response(tokens)
        sampled.message.CopyFrom(to_proto_message(message))
    if request.params.return_token_texts:
        sampled.token_texts.extend(codec.token_text(t) for t in tokens)
    return sampled


async def _fill_top_logprobs(
    client: tinker.SamplingClient,
    prompt: list[int],
    sequence: types_pb2.SampledSequence,
    params: types_pb2.SamplingParams,
    codec: ChatCodec,
) -> None:
    """Top-k alternatives at each sampled position, from a prompt-logprobs pass over prompt + completion
    (a plain SDK call, so it works on Tinker itself too)."""
    tokens = list(sequence.token_ids)
    if not tokens:
        return
    scored = await client.sample(
        tinker.types.ModelInput.from_ints(prompt + tokens),
        num_samples=1,
        sampling_params=tinker.types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=params.top_logprobs,
    )
    rows = scored.topk_prompt_logprobs or []

    def add_rows() -> None:
        for position in range(len(prompt), len(prompt) + len(tokens)):
            alternatives = rows[position] if position < len(rows) and rows[position] else []
            top = sequence.top_logprobs.add(
                token_ids=[t for t, _ in alternatives], logprobs=[lp for _, lp in alternatives]
            )
            if params.return_token_texts:
                top.token_texts.extend(codec.token_text(t) for t, _ in alternatives)

    await off_loop(add_rows)


class Sampler:
    def __init__(self, store: Store, models: ModelRegistry, limits: Limits) -> None:
        self._store = store
        self._models = models
        self._limits = limits

    async def sample(self, request: pb.SampleRequest) -> pb.SampleResponse:
        row = self._models.row(request.model)
        version = request.policy_version if request.HasField("policy_version") else row.policy_version
        path = self._store.sampler_path(row.name, version)
        if path is None:
            raise errors.not_found(
                VERSION_RESOURCE,
                f"{row.name}@{version}",
                f"model {row.name!r} has no sampleable version {version} "
                f"(sampleable: {self._store.sampleable_versions(row.name)})",
            )
        codec = await self._models.codec(row)
        check_prompt(request, codec.max_context_length)
        prompt = await off_loop(lambda: _prompt(request, codec))
        params = request.params
        check_sampling_params(params, len(prompt), codec.vocab_size, codec.max_context_length, self._limits)
        client = await self._models.sampling_client(path)
        result = await client.sample(
            tinker.types.ModelInput.from_ints(prompt),
            num_samples=params.n or 1,
            sampling_params=await off_loop(lambda: _sampling_params(params, codec)),
            include_prompt_logprobs=params.include_prompt_logprobs,
        )
        sequences = await off_loop(
            lambda: [_sampled_sequence(sequence, request, version, codec) for sequence in result.sequences]
        )
        if params.top_logprobs > 0:
            await asyncio.gather(
                *(_fill_top_logprobs(client, prompt, seq, params, codec) for seq in sequences)
            )
        response = pb.SampleResponse(
            sequences=sequences, prompt_token_ids=prompt, policy_version=version, model=row.name
        )
        if params.include_prompt_logprobs:
            response.prompt_logprobs.extend(
                math.nan if lp is None else lp for lp in (result.prompt_logprobs or [None] * len(prompt))
            )
        return response
