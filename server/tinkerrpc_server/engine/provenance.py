"""Provenance spans of forward_backward datums (the SDK's `Datum.with_provenance`), checked against what
the engine sampled (engine/sampled.py), and the stability information stable_reinforce takes from them.

A datum's `model_input_spans` tile its input tokens and its `loss_fn_input_spans` tile its
`target_tokens`; each span claims that a run of them is a run of a named sequence's request prompt or of
its sampled tokens. A claim is accepted only when the engine sampled that sequence (and still keeps it),
the run lies inside that prompt or those tokens, and the datum's tokens there are those tokens.

stable_reinforce uses what the sampler recorded (`record_stability_info`): at the target positions a
sampled span covers, the sampler's own logprobs of those tokens replace the datum's `logprobs` input, so
the importance ratio compares the learner with the sampler that really produced each token. A span that
names a sequence sampled without stability information is refused for stable_reinforce; a datum without
spans keeps its own `logprobs` (docs/tinker_parity.md).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
from tinker.proto import tinker_public_pb2 as pb

from tinkerrpc_server.engine.compute.errors import EngineUserError
from tinkerrpc_server.engine.runtime import DatumArrays
from tinkerrpc_server.engine.sampled import SampledRecord, SampledSequences, UnknownSequence


@dataclass(frozen=True)
class Span:
    sampled: bool  # the named sequence's sampled tokens; False: its request's prompt
    sequence_id: str
    offset: int
    length: int


@dataclass(frozen=True)
class DatumProvenance:
    model_input: tuple[Span, ...]
    loss_fn_inputs: tuple[Span, ...]


def parse_provenance(datum: pb.Datum) -> DatumProvenance | None:
    """The datum's spans, None when it has none (the SDK sends both lists or neither)."""
    if not datum.model_input_spans and not datum.loss_fn_input_spans:
        return None
    return DatumProvenance(_spans(datum.model_input_spans), _spans(datum.loss_fn_input_spans))


def _spans(spans: object) -> tuple[Span, ...]:
    parsed = []
    for span in spans:  # type: ignore[attr-defined]
        arm = span.WhichOneof("span")
        claim = span.sampled_tokens if arm == "sampled_tokens" else span.prompt_tokens
        parsed.append(Span(arm == "sampled_tokens", claim.sequence_id, claim.offset, claim.length))
    return tuple(parsed)


def check_provenance(
    data: list[DatumArrays],
    provenance: list[DatumProvenance | None],
    sampled: SampledSequences,
    loss_fn: str,
) -> None:
    """Refuse (EngineUserError) a claim the engine's record does not bear out; for stable_reinforce, put
    the recorded sampler logprobs into the datums' `logprobs` where sampled spans cover them."""
    for index, (datum, claims) in enumerate(zip(data, provenance, strict=True)):
        if claims is None:
            continue
        _check_field(f"data[{index}].model_input_spans", claims.model_input, datum.input_tokens, sampled)
        targets = datum.loss_fn_inputs.get("target_tokens")
        if targets is None or targets.ndim != 1:
            continue
        field = f"data[{index}].loss_fn_input_spans"
        records = _check_field(field, claims.loss_fn_inputs, targets, sampled)
        if loss_fn == "stable_reinforce":
            _use_stability_info(field, datum, claims.loss_fn_inputs, records)


def _check_field(
    field: str, spans: tuple[Span, ...], tokens: np.ndarray, sampled: SampledSequences
) -> list[SampledRecord]:
    """Each span's record, once the spans tile `tokens` and each one's run is what the engine sampled."""
    covered = sum(span.length for span in spans)
    if covered != len(tokens):
        raise EngineUserError(f"{field}: the spans cover {covered} positions, the field has {len(tokens)}")
    records = []
    position = 0
    for number, span in enumerate(spans):
        where = f"{field}[{number}]"
        if span.offset < 0 or span.length < 0:
            raise EngineUserError(f"{where}: offset and length must be >= 0")
        try:
            record = sampled.get(span.sequence_id)
        except UnknownSequence as exc:
            raise EngineUserError(f"{where}: {exc}") from None
        source, what = (record.tokens, "sampled tokens") if span.sampled else (record.prompt, "prompt")
        if span.offset + span.length > len(source):
            raise EngineUserError(
                f"{where}: positions [{span.offset}, {span.offset + span.length}) are past the end of "
                f"sequence {span.sequence_id!r}'s {what} ({len(source)} tokens)"
            )
        claimed = source[span.offset : span.offset + span.length]
        if not np.array_equal(tokens[position : position + span.length], claimed):
            raise EngineUserError(
                f"{where}: the datum's tokens at [{position}, {position + span.length}) are not sequence "
                f"{span.sequence_id!r}'s {what} at [{span.offset}, {span.offset + span.length})"
            )
        records.append(record)
        position += span.length
    return records


def _use_stability_info(
    field: str, datum: DatumArrays, spans: tuple[Span, ...], records: list[SampledRecord]
) -> None:
    logprobs = datum.loss_fn_inputs.get("logprobs")
    if logprobs is None or logprobs.shape != datum.loss_fn_inputs["target_tokens"].shape:
        return  # the loss's own input check names what is missing
    position = 0
    for number, (span, record) in enumerate(zip(spans, records, strict=True)):
        if span.sampled:
            if record.stability is None:
                raise EngineUserError(
                    f"{field}[{number}]: stable_reinforce needs the stability information of sequence "
                    f"{span.sequence_id!r}, which was sampled without record_stability_info"
                )
            recorded = record.stability.logprobs[span.offset : span.offset + span.length]
            logprobs[position : position + span.length] = recorded
        position += span.length
