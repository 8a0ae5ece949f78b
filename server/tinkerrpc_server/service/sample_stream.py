"""SampleStream: a Sample whose tokens are sent as they are made.

The request is checked and translated exactly as Sample's (sampling.Sampler.prepare), and the stream ends
with the SampleResponse Sample would answer (Sampler.respond). On the embedded engine the tokens come from
its token stream (token_stream_wire.py, an engine extension reached over HTTP with the key the SDK uses);
a backend that does not stream (Tinker itself), and a request with min_tokens (drawn in pieces), is
sampled whole and replayed as deltas, one per token.

A delta's text is what its tokens add to the sequence's text, decoded as Sample decodes it, except what
could still change: a tail that could be the start of a stop string, or an unfinished character, waits
for the next tokens (or the sequence's end). So the deltas of a sequence join to its text, and a stop
string is never sent in pieces.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from functools import partial

import httpx
import tinker

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server import token_stream_wire as wire
from tinkerrpc_server.service.backend import Backend
from tinkerrpc_server.service.rendering import off_loop
from tinkerrpc_server.service.sampling import (
    Drawn,
    PreparedSample,
    PromptScores,
    Sampler,
    TopEntry,
    add_top,
    decode_text,
)
from tinkerrpc_server.stream_text import held_back_from

_STOP_REASONS = {"stop": types_pb2.STOP_REASON_STOP, "length": types_pb2.STOP_REASON_LENGTH}


class _SequenceText:
    """One sequence's tokens so far and the part of its text already sent."""

    def __init__(self, prepared: PreparedSample, stops: Sequence[str]) -> None:
        self._prepared = prepared
        self._stops = stops
        self.tokens: list[int] = []
        self.logprobs: list[float] = []
        self.top: list[TopEntry] = []
        self.stop_reason: wire.StopReason | None = None
        self._sent = ""

    def delta(
        self,
        index: int,
        tokens: list[int],
        logprobs: list[float],
        tops: list[TopEntry] | None,
        stop_reason: wire.StopReason | None,
    ) -> pb.SequenceDelta:
        """The delta of `tokens`, just sampled (runs off the event loop: it decodes)."""
        params, codec = self._prepared.request.params, self._prepared.codec
        self.tokens += tokens
        self.logprobs += logprobs
        self.top += tops or []
        self.stop_reason = stop_reason
        delta = pb.SequenceDelta(index=index, token_ids=tokens, logprobs=logprobs)
        for entry in tops or ():
            add_top(delta.top_logprobs, entry, params, codec)
        if params.return_token_texts:
            delta.token_texts.extend(codec.token_text(t) for t in tokens)
            delta.token_bytes.extend(codec.token_bytes(t) for t in tokens)
        text = decode_text(self.tokens, params, codec)
        stable = text if stop_reason is not None else text[: held_back_from(text, self._stops)]
        # A decoder that rewrote text already sent (none of ours does) gets nothing more until the end.
        if stable.startswith(self._sent):
            delta.text, self._sent = stable[len(self._sent) :], stable
        if stop_reason is not None:
            delta.stop_reason = _STOP_REASONS[stop_reason]
        return delta


def _stop_strings(prepared: PreparedSample) -> list[str]:
    stop = prepared.sampling_params.stop or []
    return [s for s in ([stop] if isinstance(stop, str) else stop) if isinstance(s, str)]


class SampleStreamer:
    def __init__(self, sampler: Sampler, backend: Backend) -> None:
        self._sampler = sampler
        self._backend = backend

    async def stream(self, request: pb.SampleStreamRequest) -> AsyncIterator[pb.SampleStreamResponse]:
        inner = request.request
        async with self._sampler.pinned(inner) as (row, version):
            prepared = await self._sampler.prepare(inner, row, version)
            yield pb.SampleStreamResponse(
                head=pb.SampleStreamHead(
                    prompt_token_ids=prepared.prompt, policy_version=version, model=row.name
                )
            )
            texts = [_SequenceText(prepared, _stop_strings(prepared)) for _ in range(inner.params.n or 1)]
            if self._backend.embedded and not inner.params.min_tokens:
                stream = self._streamed(prepared, texts)
            else:
                stream = self._replayed(prepared, texts)
            async for response in stream:
                yield response

    async def _streamed(
        self, prepared: PreparedSample, texts: list[_SequenceText]
    ) -> AsyncIterator[pb.SampleStreamResponse]:
        """The engine's token stream as deltas, then the response of what it sampled."""
        async for line in self._engine_lines(prepared):
            if isinstance(line, wire.StreamFailed):
                raise tinker.RequestFailedError(
                    line.message, "", tinker.types.RequestErrorCategory(line.category)
                )
            if isinstance(line, wire.StreamDone):
                drawn = [
                    Drawn(s.tokens, s.logprobs, s.stop_reason == "stop", text.top or None)
                    for s, text in zip(line.sequences, texts, strict=True)
                ]
                done = await self._sampler.respond(prepared, drawn, PromptScores(line.prompt_logprobs))
                yield pb.SampleStreamResponse(done=done)
                return
            deltas = await off_loop(partial(_deltas_of, line, texts))
            yield pb.SampleStreamResponse(deltas=pb.SampleStreamDeltas(sequences=deltas))
        raise tinker.APIConnectionError(
            httpx.Request("POST", wire.SAMPLE_STREAM_PATH), "the stream ended early"
        )

    async def _replayed(
        self, prepared: PreparedSample, texts: list[_SequenceText]
    ) -> AsyncIterator[pb.SampleStreamResponse]:
        """Sampled whole, then sent as one delta per token position, then the response."""
        drawn, prompt_scores = await self._sampler.draw(prepared)
        done = await self._sampler.respond(prepared, drawn, prompt_scores)
        for position in range(max((len(s.token_ids) for s in done.sequences), default=0)):
            deltas = await off_loop(partial(_replayed_deltas, done, position, texts))
            yield pb.SampleStreamResponse(deltas=pb.SampleStreamDeltas(sequences=deltas))
        yield pb.SampleStreamResponse(done=done)

    async def _engine_lines(self, prepared: PreparedSample) -> AsyncIterator[wire.StreamLine]:
        params = prepared.request.params
        body = tinker.types.SampleRequest(
            num_samples=params.n or 1,
            prompt=tinker.types.ModelInput.from_ints(prepared.prompt),
            sampling_params=prepared.sampling_params,
            model_path=prepared.path,
            prompt_logprobs=params.include_prompt_logprobs,
            topk_sample_logprobs=params.top_logprobs,
        )
        backend = self._backend
        url = backend.base_url.rstrip("/") + wire.SAMPLE_STREAM_PATH
        http = backend.token_stream_client()
        try:
            async with http.stream(
                "POST", url, json=body.model_dump(mode="json"), headers={"X-API-Key": backend.api_key}
            ) as answer:
                if answer.status_code != 200:
                    await answer.aread()
                    detail = answer.json().get("detail", answer.text) if answer.text else ""
                    raise tinker.APIStatusError(str(detail), response=answer, body=None)
                async for text in answer.aiter_lines():
                    if text:
                        yield wire.parse_line(text)
        except httpx.TransportError as err:
            raise tinker.APIConnectionError(err.request, f"the engine's token stream: {err}") from err


def _deltas_of(tokens: list[wire.StreamedToken], texts: list[_SequenceText]) -> list[pb.SequenceDelta]:
    by_sample: dict[int, list[wire.StreamedToken]] = {}
    for token in tokens:
        by_sample.setdefault(token.sample, []).append(token)
    return [
        texts[index].delta(
            index,
            [t.token for t in sampled],
            [t.logprob for t in sampled],
            [t.top for t in sampled if t.top is not None] or None,
            sampled[-1].stop_reason,
        )
        for index, sampled in sorted(by_sample.items())
    ]


def _replayed_deltas(
    done: pb.SampleResponse, position: int, texts: list[_SequenceText]
) -> list[pb.SequenceDelta]:
    deltas = []
    for index, sequence in enumerate(done.sequences):
        if position >= len(sequence.token_ids):
            continue
        last = position == len(sequence.token_ids) - 1
        top = sequence.top_logprobs[position] if position < len(sequence.top_logprobs) else None
        delta = texts[index].delta(
            index,
            [sequence.token_ids[position]],
            [sequence.logprobs[position]] if position < len(sequence.logprobs) else [],
            None if top is None else [(list(top.token_ids), list(top.logprobs))],
            ("stop" if sequence.stop_reason == types_pb2.STOP_REASON_STOP else "length") if last else None,
        )
        deltas.append(delta)
    return deltas
