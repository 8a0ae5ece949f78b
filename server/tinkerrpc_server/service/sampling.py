"""Sample: the prompt (rendered chat, token ids or tokenized text), Tinker's sampling parameters, and
the response's sequences (text, parsed message, token texts, top logprobs) at a pinned or the latest
policy version. Rendering, tokenising and decoding run off the event loop.

Per request, a chat prompt may switch to its renderer's thinking variant and force a tool call (the
call's opening appended as prompt tokens); min_tokens is sampled in pieces (see `_draw_min_tokens`)."""

from __future__ import annotations

import asyncio
import math
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import tinker
from google.protobuf.internal.containers import RepeatedCompositeFieldContainer

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service import errors
from tinkerrpc_server.service.backend import Backend
from tinkerrpc_server.service.limits import Limits
from tinkerrpc_server.service.models import VERSION_RESOURCE, ModelRegistry
from tinkerrpc_server.service.rendering import ChatCodec, RendererVariantError, off_loop, thinking_variant
from tinkerrpc_server.service.replies import parse_reply, tool_call_opening
from tinkerrpc_server.service.sample_cache import SampleCache
from tinkerrpc_server.service.store import ModelRow, Store
from tinkerrpc_server.service.validation import check_prompt, check_prompt_tokens, check_sampling_params

# A model that keeps drawing stop tokens before min_tokens is not sampled forever.
MAX_MIN_TOKENS_REJECTIONS = 64


# One sampled position's top alternatives: token ids and logprobs, most likely first.
TopEntry = tuple[list[int], list[float]]


@dataclass
class Drawn:
    """One sampled sequence, however it was drawn."""

    tokens: list[int]
    logprobs: list[float]
    stopped: bool  # by a stop token or string (else max_tokens)
    # Its top alternatives per token, when the sampler gave them with the tokens (the sample call's
    # topk_sample_logprobs, or a token stream); None leaves them to a second pass (`_fill_top_logprobs`).
    top: list[TopEntry] | None = None


@dataclass
class PromptScores:
    """What the sampler said of the prompt: each token's logprob and its top alternatives per position
    (None at position 0; each None when not asked, or not given, as by a token stream's end)."""

    logprobs: list[float | None] | None = None
    top: list[TopEntry | None] | None = None


def top_entries(rows: list[list[tuple[int, float]] | None] | None) -> list[TopEntry | None]:
    """The SDK's top-k rows ((token, logprob) pairs, None where it has none) as TopEntries."""
    return [None if row is None else ([t for t, _ in row], [lp for _, lp in row]) for row in rows or ()]


def _request_codec(request: pb.SampleRequest, codec: ChatCodec) -> ChatCodec:
    """The model's codec, or its thinking variant when the chat prompt asks for one."""
    if request.WhichOneof("prompt") != "chat" or not request.chat.HasField("enable_thinking"):
        return codec
    try:
        return codec.with_renderer(thinking_variant(codec.renderer_name, request.chat.enable_thinking))
    except RendererVariantError as err:
        raise errors.invalid_argument([("chat.enable_thinking", str(err))]) from err


def _forced_opening(request: pb.SampleRequest, codec: ChatCodec) -> list[int]:
    """The tool-call opening a chat prompt forces (prompt tokens), or nothing."""
    if request.WhichOneof("prompt") != "chat" or not request.chat.HasField("forced_tool_call"):
        return []
    try:
        return tool_call_opening(codec, request.chat.forced_tool_call.function_name)
    except RendererVariantError as err:
        raise errors.invalid_argument([("chat.forced_tool_call", str(err))]) from err


def _prompt(request: pb.SampleRequest, codec: ChatCodec, forced: list[int]) -> list[int]:
    prompt: list[int]
    if request.WhichOneof("prompt") == "chat":
        prompt = codec.generation_prompt(list(request.chat.messages), list(request.chat.tools)) + forced
    elif request.WhichOneof("prompt") == "tokens":
        prompt = list(request.tokens.token_ids)
    else:
        prompt = list(codec.tokenizer.encode(request.text, add_special_tokens=False))
    check_prompt_tokens(request, prompt, codec.vocab_size)
    return prompt


def _sampling_params(params: types_pb2.SamplingParams, codec: ChatCodec) -> tinker.types.SamplingParams:
    stop_tokens = _stop_token_ids(params, codec)
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


def decode_text(tokens: list[int], params: types_pb2.SamplingParams, codec: ChatCodec) -> str:
    return codec.decode(
        tokens,
        skip_special_tokens=params.skip_special_tokens if params.HasField("skip_special_tokens") else True,
        spaces_between_special_tokens=params.spaces_between_special_tokens
        if params.HasField("spaces_between_special_tokens")
        else True,
    )


def _sampled_sequence(
    sequence: Drawn, request: pb.SampleRequest, version: int, codec: ChatCodec, forced: list[int]
) -> types_pb2.SampledSequence:
    tokens = sequence.tokens
    sampled = types_pb2.SampledSequence(
        token_ids=tokens,
        logprobs=sequence.logprobs,
        text=decode_text(tokens, request.params, codec),
        stop_reason=types_pb2.STOP_REASON_STOP if sequence.stopped else types_pb2.STOP_REASON_LENGTH,
        policy_version=version,
    )
    if request.WhichOneof("prompt") == "chat":
        # A forced tool-call opening is the reply's start: parsed with it, the reply is the call.
        tool_names = {tool.name for tool in request.chat.tools}
        sampled.message.CopyFrom(
            parse_reply(codec, tokens, forced, tool_names, request.chat.single_tool_call)
        )
    if request.params.return_token_texts:
        sampled.token_texts.extend(codec.token_text(t) for t in tokens)
        sampled.token_bytes.extend(codec.token_bytes(t) for t in tokens)
    for entry in sequence.top or ():
        add_top(sampled.top_logprobs, entry, request.params, codec)
    return sampled


def add_top(
    tops: RepeatedCompositeFieldContainer[types_pb2.TopLogprobs],
    entry: TopEntry,
    params: types_pb2.SamplingParams,
    codec: ChatCodec,
) -> None:
    """One position's top alternatives appended to `tops`, with their texts when asked."""
    top = tops.add(token_ids=entry[0], logprobs=entry[1])
    if params.return_token_texts:
        top.token_texts.extend(codec.token_text(t) for t in entry[0])
        top.token_bytes.extend(codec.token_bytes(t) for t in entry[0])


async def _fill_top_logprobs(
    client: tinker.SamplingClient,
    prompt: list[int],
    sequence: types_pb2.SampledSequence,
    params: types_pb2.SamplingParams,
    codec: ChatCodec,
) -> None:
    """Top-k alternatives at each sampled position, from a prompt-logprobs pass over prompt + completion:
    for a backend whose sample call does not answer topk_sample_logprobs (Backend.samples_topk)."""
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
    rows = top_entries(scored.topk_prompt_logprobs)

    def add_rows() -> None:
        for position in range(len(prompt), len(prompt) + len(tokens)):
            entry = rows[position] if position < len(rows) else None
            add_top(sequence.top_logprobs, entry or ([], []), params, codec)

    await off_loop(add_rows)


def _stop_token_ids(params: types_pb2.SamplingParams, codec: ChatCodec) -> list[int]:
    stop_tokens = list(params.stop_token_ids)
    if not params.ignore_default_stops:
        stop_tokens += [t for t in codec.default_stop_tokens() if t not in stop_tokens]
    return stop_tokens


def _piece_seed(params: types_pb2.SamplingParams, sequence: int, piece: int) -> int | None:
    """A seeded request's pieces get seeds of their own, the same on every run."""
    if not params.HasField("seed"):
        return None
    return (params.seed + sequence + piece * max(params.n, 1) * 7919) % 2**63


async def _draw_min_tokens(
    client: tinker.SamplingClient,
    prompt: list[int],
    params: types_pb2.SamplingParams,
    full: tinker.types.SamplingParams,
    stop_tokens: list[int],
    sequence: int,
) -> Drawn:
    """One sequence with no stop before params.min_tokens, over plain Tinker sampling: the first
    min_tokens are drawn with only the stop tokens as stops and no stop strings; a stop token drawn
    there is rejected and its position drawn again (so it is drawn from the policy with the stop tokens
    masked out; greedy takes the best other token); the rest is drawn with every stop from there."""
    tokens: list[int] = []
    logprobs: list[float] = []
    first_part = min(params.min_tokens, params.max_tokens)
    rejections = 0
    piece = 0
    while len(tokens) < first_part:
        drawn = (
            await client.sample(
                tinker.types.ModelInput.from_ints(prompt + tokens),
                num_samples=1,
                sampling_params=full.model_copy(
                    update={
                        "max_tokens": first_part - len(tokens),
                        "stop": stop_tokens,
                        "seed": _piece_seed(params, sequence, piece),
                    }
                ),
            )
        ).sequences[0]
        piece += 1
        kept = list(drawn.tokens)
        kept_logprobs = list(drawn.logprobs or [])
        rejected = bool(kept) and kept[-1] in stop_tokens
        if rejected:
            kept, kept_logprobs = kept[:-1], kept_logprobs[:-1]
            rejections += 1
            if rejections > MAX_MIN_TOKENS_REJECTIONS:
                raise errors.ServiceError(
                    grpc.StatusCode.FAILED_PRECONDITION,
                    f"the model drew a stop token {rejections} times before min_tokens={params.min_tokens} "
                    f"(after {len(tokens) + len(kept)} tokens); lower min_tokens",
                )
        tokens += kept
        logprobs += kept_logprobs
        if rejected and full.temperature == 0:
            # Greedy would draw the same stop again.
            token, logprob = await _best_non_stop(client, prompt + tokens, stop_tokens)
            tokens.append(token)
            logprobs.append(logprob)
    if len(tokens) >= params.max_tokens:
        return Drawn(tokens, logprobs, stopped=False)
    rest = (
        await client.sample(
            tinker.types.ModelInput.from_ints(prompt + tokens),
            num_samples=1,
            sampling_params=full.model_copy(
                update={
                    "max_tokens": params.max_tokens - len(tokens),
                    "seed": _piece_seed(params, sequence, piece),
                }
            ),
        )
    ).sequences[0]
    return Drawn(
        tokens + list(rest.tokens), logprobs + list(rest.logprobs or []), rest.stop_reason != "length"
    )


async def _score_prompt(client: tinker.SamplingClient, prompt: list[int], top_k: int) -> PromptScores:
    """The prompt's logprobs (and top_k alternatives per position) from a pass of their own."""
    scored = await client.sample(
        tinker.types.ModelInput.from_ints(prompt),
        num_samples=1,
        sampling_params=tinker.types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=top_k,
    )
    return _prompt_scores(scored, top_k)


def _prompt_scores(result: tinker.types.SampleResponse, top_k: int) -> PromptScores:
    return PromptScores(result.prompt_logprobs, top_entries(result.topk_prompt_logprobs) if top_k else None)


async def _best_non_stop(
    client: tinker.SamplingClient, context: list[int], stop_tokens: list[int]
) -> tuple[int, float]:
    """Greedy decoding's next token with the stop tokens masked out, from a top-k prompt-logprobs pass."""
    scored = await client.sample(
        tinker.types.ModelInput.from_ints([*context, 0]),
        num_samples=1,
        sampling_params=tinker.types.SamplingParams(max_tokens=1),
        include_prompt_logprobs=True,
        topk_prompt_logprobs=len(stop_tokens) + 1,
    )
    alternatives = (scored.topk_prompt_logprobs or [])[len(context)] or []
    return next((t, lp) for t, lp in alternatives if t not in stop_tokens)


def sampler_path(store: Store, row: ModelRow, version: int) -> str:
    """The sampler weights of the model at `version`; NOT_FOUND, naming the versions left, when gone."""
    path = store.sampler_path(row.name, version)
    if path is None:
        raise errors.not_found(
            VERSION_RESOURCE,
            f"{row.name}@{version}",
            f"model {row.name!r} has no sampleable version {version} "
            f"(sampleable: {store.sampleable_versions(row.name)})",
        )
    return path


@dataclass(frozen=True)
class PreparedSample:
    """A Sample request checked and translated, ready to draw from its version's sampler weights."""

    request: pb.SampleRequest
    model: str
    version: int
    path: str  # the version's sampler weights (tinker:// path)
    codec: ChatCodec  # the model's, or its thinking variant's
    forced: list[int]  # a forced tool call's opening, the prompt's last tokens
    prompt: list[int]
    client: tinker.SamplingClient
    sampling_params: tinker.types.SamplingParams


class Sampler:
    def __init__(
        self, store: Store, models: ModelRegistry, limits: Limits, sample_cache: SampleCache, backend: Backend
    ) -> None:
        self._store = store
        self._backend = backend
        self._models = models
        self._limits = limits
        self._sample_cache = sample_cache

    async def sample(self, request: pb.SampleRequest) -> pb.SampleResponse:
        async with self.pinned(request) as (row, version):
            prepared = await self.prepare(request, row, version)
            drawn, prompt_scores = await self.draw(prepared)
            return await self.respond(prepared, drawn, prompt_scores)

    @asynccontextmanager
    async def pinned(self, request: pb.SampleRequest) -> AsyncIterator[tuple[ModelRow, int]]:
        """The model and the version a request samples, kept sampleable while the block runs; a failure
        because a restore or DeleteModel discarded the version meanwhile is NOT_FOUND."""
        row = self._models.row(request.model)
        version = request.policy_version if request.HasField("policy_version") else row.policy_version
        # Pinned: retention keeps this version's sampler weights until the call ends.
        with self._models.retention.pinned(row.name, version):
            path = self._store.sampler_path(row.name, version)
            try:
                yield row, version
            except Exception as err:
                # A restore or DeleteModel may discard the version while it is sampled: the backend then
                # fails on weights that are gone, which is the version's absence, not a bad request.
                if path is None or self._store.sampler_path(row.name, version) == path:
                    raise
                raise errors.not_found(
                    VERSION_RESOURCE,
                    f"{row.name}@{version}",
                    f"version {version} of model {row.name!r} was discarded (a restore or DeleteModel) "
                    "while it was being sampled",
                ) from err

    async def prepare(self, request: pb.SampleRequest, row: ModelRow, version: int) -> PreparedSample:
        """Every check of a Sample request (Sample and SampleStream alike), and what drawing it needs."""
        path = sampler_path(self._store, row, version)
        model_codec = await self._models.codec(row)
        check_prompt(request, model_codec.max_context_length)
        codec = await off_loop(lambda: _request_codec(request, model_codec))
        forced = await off_loop(lambda: _forced_opening(request, codec))
        prompt = await off_loop(lambda: _prompt(request, codec, forced))
        params = request.params
        check_sampling_params(params, len(prompt), codec.vocab_size, codec.max_context_length, self._limits)
        client = await self._models.sampling_client(path)
        sampling_params = await off_loop(lambda: _sampling_params(params, codec))
        return PreparedSample(
            request, row.name, version, path, codec, forced, prompt, client, sampling_params
        )

    async def draw(self, prepared: PreparedSample) -> tuple[list[Drawn], PromptScores]:
        """The request's sequences and (when asked) its prompt's scores, sampled whole."""
        client, prompt, params = prepared.client, prepared.prompt, prepared.request.params
        prompt_asked = params.include_prompt_logprobs or params.prompt_top_logprobs > 0
        if params.min_tokens:
            stop_tokens = await off_loop(lambda: _stop_token_ids(params, prepared.codec))
            drawn = list(
                await asyncio.gather(
                    *(
                        _draw_min_tokens(client, prompt, params, prepared.sampling_params, stop_tokens, i)
                        for i in range(params.n or 1)
                    )
                )
            )
            scores = (
                await _score_prompt(client, prompt, params.prompt_top_logprobs)
                if prompt_asked
                else PromptScores()
            )
            return drawn, scores
        # The sampled tokens' top-k come with them where the backend answers it, else by a second pass.
        sample_top_k = params.top_logprobs if self._backend.samples_topk else 0
        result = await client.sample(
            tinker.types.ModelInput.from_ints(prompt),
            num_samples=params.n or 1,
            sampling_params=prepared.sampling_params,
            include_prompt_logprobs=prompt_asked,
            topk_prompt_logprobs=params.prompt_top_logprobs,
            topk_sample_logprobs=sample_top_k,
        )
        drawn = [
            Drawn(
                list(s.tokens),
                list(s.logprobs or []),
                s.stop_reason != "length",
                [entry or ([], []) for entry in top_entries(s.topk_logprobs)] if sample_top_k else None,
            )
            for s in result.sequences
        ]
        return drawn, _prompt_scores(result, params.prompt_top_logprobs)

    async def respond(
        self, prepared: PreparedSample, drawn: list[Drawn], prompt_scores: PromptScores
    ) -> pb.SampleResponse:
        """The SampleResponse of drawn sequences: texts, parsed messages, sample keys, top logprobs."""
        request, version, codec, prompt = prepared.request, prepared.version, prepared.codec, prepared.prompt
        params = request.params
        sequences = await off_loop(
            lambda: [
                _sampled_sequence(sequence, request, version, codec, prepared.forced) for sequence in drawn
            ]
        )
        # Every sequence keeps its sampler logprobs, asked for or not: a trajectory naming the key trains on
        # them without another forward pass.
        for sequence in sequences:
            if len(sequence.logprobs) == len(sequence.token_ids):
                sequence.sample_key = self._sample_cache.put(
                    prepared.model,
                    version,
                    prompt,
                    list(sequence.token_ids),
                    list(sequence.logprobs),
                    sampled_from=prepared.path,
                )
        if params.top_logprobs > 0:
            await asyncio.gather(
                *(
                    _fill_top_logprobs(prepared.client, prompt, seq, params, codec)
                    for seq, sampled in zip(sequences, drawn, strict=True)
                    if sampled.top is None
                )
            )
        response = pb.SampleResponse(
            sequences=sequences, prompt_token_ids=prompt, policy_version=version, model=prepared.model
        )
        if params.return_prompt_text:
            response.prompt_text = await off_loop(lambda: decode_text(prompt, params, codec))
        if params.include_prompt_logprobs:
            response.prompt_logprobs.extend(
                math.nan if lp is None else lp for lp in (prompt_scores.logprobs or [None] * len(prompt))
            )
        if params.prompt_top_logprobs:
            scores = prompt_scores
            if scores.top is None:  # a token stream's end carries no prompt top-k
                scores = await _score_prompt(prepared.client, prompt, params.prompt_top_logprobs)
            rows = scores.top or []

            def add_rows() -> None:
                for position in range(len(prompt)):
                    entry = rows[position] if position < len(rows) else None
                    add_top(response.prompt_top_logprobs, entry or ([], []), params, codec)

            await off_loop(add_rows)
        return response
