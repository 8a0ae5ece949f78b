"""The per-token terms of an RL step that need another policy's logprobs (contract/train_terms.py): the
KL penalty's reference and distillation's teacher resolved to a sampler the backend serves (a base model,
a model's version, a named checkpoint) that shares the trained model's tokenizer, a version pinned for as
long as the model trains against it (service/reference_pins.py); the batch's sampled
tokens scored there with the tinker SDK's SamplingClient.compute_logprobs; the terms folded into the
datums' advantages, each datum's by its loss-aggregation weight. Everything is resolved before the
training client is touched, so a bad reference changes nothing (not even a pin)."""

from __future__ import annotations

import asyncio
from dataclasses import dataclass

import numpy as np
import numpy.typing as npt
import tinker
from tinker_cookbook.tokenizer_utils import Tokenizer

from tinkerrpc.contract.limits import DEFAULT_DISTILLATION_COEFFICIENT
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server import model_store
from tinkerrpc_server.service import errors, reference_pins
from tinkerrpc_server.service.datums import Batch
from tinkerrpc_server.service.models import ModelRegistry
from tinkerrpc_server.service.rendering import ChatCodec, UnknownRendererError, off_loop
from tinkerrpc_server.service.store import KIND_SAMPLER, KIND_STATE, ModelRow, Store

Floats = npt.NDArray[np.float64]
# Scoring passes in flight at once (one per datum).
SCORING_CONCURRENCY = 32


@dataclass(frozen=True)
class Scorer:
    """A resolved reference or teacher: the sampler weights (a tinker:// path) or the base model to score
    with, the model version the term pins (None for a base model, version 0 or a checkpoint), and the
    term's coefficient."""

    field: str
    coefficient: float
    path: str | None = None
    base_model: str | None = None
    pinned: tuple[str, int] | None = None


@dataclass(frozen=True)
class Scorers:
    kl_penalty: Scorer | None = None
    distillation: Scorer | None = None


@dataclass(frozen=True)
class TermFigures:
    """What the step reports of its terms (TrainMetrics.reference_kl and teacher_kl)."""

    reference_kl: float | None = None
    teacher_kl: float | None = None


def _sampled(batch: Batch) -> list[npt.NDArray[np.bool_]]:
    return [np.asarray(mask, dtype=bool) for mask in batch.sampled_masks]


def _inputs(datum: tinker.types.Datum, key: str) -> Floats:
    return np.asarray(datum.loss_fn_inputs[key].to_numpy(), dtype=np.float64).reshape(-1)


def kl_penalty_terms(
    sampler: list[Floats], reference: list[Floats], sampled: list[npt.NDArray[np.bool_]], coefficient: float
) -> tuple[list[Floats], float]:
    """Per datum, the KL penalty's advantage term c·(m − d) on its sampled positions (0 elsewhere), with
    d = sampler − reference and m the mean of d over every sampled position; and m."""
    gaps = [(q - ref)[mask] for q, ref, mask in zip(sampler, reference, sampled, strict=True)]
    mean = float(np.concatenate(gaps).mean())
    terms = []
    for mask, gap in zip(sampled, gaps, strict=True):
        term = np.zeros(len(mask))
        term[mask] = coefficient * (mean - gap)
        terms.append(term)
    return terms, mean


def distillation_terms(
    sampler: list[Floats], teacher: list[Floats], sampled: list[npt.NDArray[np.bool_]], coefficient: float
) -> tuple[list[Floats], float]:
    """Per datum, distillation's advantage term c·(teacher − sampler) on its sampled positions; and the
    mean of sampler − teacher over them (the reverse KL's estimate)."""
    terms = []
    for q, p, mask in zip(sampler, teacher, sampled, strict=True):
        term = np.zeros(len(mask))
        term[mask] = coefficient * (p - q)[mask]
        terms.append(term)
    gaps = np.concatenate([(q - p)[mask] for q, p, mask in zip(sampler, teacher, sampled, strict=True)])
    return terms, float(gaps.mean())


def same_tokenizer(first: Tokenizer, second: Tokenizer) -> bool:
    """Whether two tokenizers give every token string the same id (so their logprobs are of one vocabulary)."""
    return len(first) == len(second) and first.get_vocab() == second.get_vocab()


class TrainTerms:
    def __init__(self, store: Store, models: ModelRegistry) -> None:
        self._store = store
        self._models = models
        # (base model, base model) pairs whose tokenizers were compared: equal or not.
        self._same_tokenizer: dict[tuple[str, str], bool] = {}

    async def scorers(self, request: pb.TrainRequest, row: ModelRow, codec: ChatCodec) -> Scorers:
        """The request's reference and teacher, resolved; INVALID_ARGUMENT naming the field for one that
        does not exist on this server or has another tokenizer."""
        kl = distillation = None
        if request.HasField("kl_penalty"):
            penalty = request.kl_penalty
            kl = (
                await self._resolve(
                    "kl_penalty.reference", penalty.reference, row, codec, penalty.coefficient
                )
                if penalty.HasField("reference")
                else Scorer("kl_penalty.reference", penalty.coefficient, base_model=row.base_model)
            )
        if request.HasField("distillation"):
            teacher = request.distillation
            coefficient = (
                teacher.coefficient if teacher.HasField("coefficient") else DEFAULT_DISTILLATION_COEFFICIENT
            )
            distillation = await self._resolve(
                "distillation.teacher", teacher.teacher, row, codec, coefficient
            )
        return Scorers(kl, distillation)

    def hold_pins(self, row: ModelRow, scorers: Scorers) -> None:
        """Once the request passed every check: each term present pins its version or releases its pin; a
        term left out keeps it. One transaction, with no await since each pinned version's sampler path is
        read again (a version another model's commit pruned after it resolved is REFERENCE_NOT_KEPT)."""
        with self._store.transaction() as tx:
            for term, scorer in zip(
                reference_pins.TERMS, (scorers.kl_penalty, scorers.distillation), strict=True
            ):
                if scorer is None:
                    continue
                field = f"{scorer.field}.version.policy_version"
                if scorer.pinned is not None and self._store.sampler_path(*scorer.pinned) != scorer.path:
                    model, version = scorer.pinned
                    raise reference_pins.not_kept(
                        field, model, version, self._store.sampleable_versions(model)
                    )
                reference_pins.hold(tx, row.name, term, scorer.pinned, row.policy_version, field)

    async def _resolve(
        self,
        field: str,
        reference: types_pb2.PolicyReference,
        row: ModelRow,
        codec: ChatCodec,
        coefficient: float,
    ) -> Scorer:
        kind = reference.WhichOneof("policy")
        if kind == "base_model":
            try:
                other = await off_loop(lambda: self._models.base_codec(reference.base_model))
            except (model_store.UnknownBaseModelError, UnknownRendererError) as err:
                raise errors.invalid_argument([(f"{field}.base_model", str(err))]) from err
            await self._check_tokenizer(f"{field}.base_model", codec, other)
            return Scorer(field, coefficient, base_model=reference.base_model)
        if kind == "version":
            model, version = reference.version.model or row.name, reference.version.policy_version
            other_row = self._reference_row(f"{field}.version.model", model)
            if version > other_row.policy_version:
                raise errors.invalid_argument(
                    [
                        (
                            f"{field}.version.policy_version",
                            f"model {errors.shown(model)} has no version {version} "
                            f"(it is at version {other_row.policy_version})",
                        )
                    ]
                )
            await self._check_tokenizer(f"{field}.version.model", codec, await self._models.codec(other_row))
            if version == 0:
                # The fresh adapter: LoRA's B starts at zero, so it is the base model exactly and needs no
                # checkpoint (retention may have deleted version 0's long ago).
                return Scorer(field, coefficient, base_model=other_row.base_model)
            path = self._store.sampler_path(model, version)
            if path is None:
                raise reference_pins.not_kept(
                    f"{field}.version.policy_version", model, version, self._store.sampleable_versions(model)
                )
            return Scorer(field, coefficient, path=path, pinned=(model, version))
        assert kind == "checkpoint", "validation refuses a reference without a policy"
        model, name = reference.checkpoint.model or row.name, reference.checkpoint.name
        other_row = self._reference_row(f"{field}.checkpoint.model", model)
        checkpoint = self._store.get_checkpoint(model, KIND_SAMPLER, name) or self._store.get_checkpoint(
            model, KIND_STATE, name
        )
        if checkpoint is None:
            raise errors.invalid_argument(
                [
                    (
                        f"{field}.checkpoint.name",
                        f"model {errors.shown(model)} has no checkpoint {errors.shown(name)}",
                    )
                ]
            )
        await self._check_tokenizer(f"{field}.checkpoint.model", codec, await self._models.codec(other_row))
        return Scorer(field, coefficient, path=checkpoint.tinker_path)

    def _reference_row(self, field: str, model: str) -> ModelRow:
        other = self._store.get_model(model)
        if other is None:
            raise errors.invalid_argument([(field, f"no model {errors.shown(model)} on this server")])
        return other

    async def _check_tokenizer(self, field: str, codec: ChatCodec, other: ChatCodec) -> None:
        """A scorer's logprobs are of the same token ids only when it shares the model's tokenizer."""
        key = (codec.base_model, other.base_model)
        if key not in self._same_tokenizer:
            self._same_tokenizer[key] = codec.base_model == other.base_model or await off_loop(
                lambda: same_tokenizer(codec.tokenizer, other.tokenizer)
            )
        if not self._same_tokenizer[key]:
            raise errors.invalid_argument(
                [
                    (
                        field,
                        f"{errors.shown(other.base_model)} has another tokenizer than the trained model's "
                        f"{errors.shown(codec.base_model)}: its logprobs would be of other tokens",
                    )
                ]
            )

    async def fold(self, scorers: Scorers, batch: Batch) -> TermFigures:
        """Score the batch's sampled tokens with each scorer and add the terms to the datums' advantages."""
        if scorers.kl_penalty is None and scorers.distillation is None:
            return TermFigures()
        sampled = _sampled(batch)
        sampler = [_inputs(datum, "logprobs") for datum in batch.datums]
        terms = [np.zeros(len(mask)) for mask in sampled]
        reference_kl = teacher_kl = None
        if scorers.kl_penalty is not None:
            reference = await self._score(scorers.kl_penalty, batch, sampled)
            added, reference_kl = kl_penalty_terms(
                sampler, reference, sampled, scorers.kl_penalty.coefficient
            )
            terms = [t + a for t, a in zip(terms, added, strict=True)]
        if scorers.distillation is not None:
            teacher = await self._score(scorers.distillation, batch, sampled)
            added, teacher_kl = distillation_terms(
                sampler, teacher, sampled, scorers.distillation.coefficient
            )
            terms = [t + a for t, a in zip(terms, added, strict=True)]
        for i, (datum, term, weight) in enumerate(
            zip(batch.datums, terms, batch.advantage_weights, strict=True)
        ):
            advantages = _inputs(datum, "advantages") + weight * term
            inputs = {
                **datum.loss_fn_inputs,
                "advantages": tinker.types.TensorData(
                    data=advantages.astype(np.float32).tolist(), dtype="float32", shape=[len(advantages)]
                ),
            }
            batch.datums[i] = tinker.types.Datum(model_input=datum.model_input, loss_fn_inputs=inputs)
        return TermFigures(reference_kl, teacher_kl)

    async def _score(
        self, scorer: Scorer, batch: Batch, sampled: list[npt.NDArray[np.bool_]]
    ) -> list[Floats]:
        """Per datum, the scorer's logprob of each target token (0 where it scored none: before the first
        sampled position, which compute_logprobs is asked to skip)."""
        limit = asyncio.Semaphore(SCORING_CONCURRENCY)
        # A version's sampler weights are kept while they score: the term pinned them (hold_pins).
        client = await self._models.sampling_client(scorer.path, scorer.base_model)

        async def score(datum: tinker.types.Datum, mask: npt.NDArray[np.bool_]) -> Floats:
            tokens = [*datum.model_input.to_ints(), int(datum.loss_fn_inputs["target_tokens"].data[-1])]
            scored_positions = len(mask) - int(np.argmax(mask))
            async with limit:
                logprobs = await client.compute_logprobs(
                    tinker.types.ModelInput.from_ints(tokens), prompt_logprobs_last_n=scored_positions
                )
            if len(logprobs) != len(tokens):
                raise RuntimeError(
                    f"{scorer.field}: the backend scored {len(logprobs)} of {len(tokens)} tokens"
                )
            # Entry i + 1 is the logprob of target i.
            targets = np.zeros(len(mask))
            for i, value in enumerate(logprobs[1:]):
                if value is not None:
                    targets[i] = value
                elif mask[i]:
                    raise RuntimeError(f"{scorer.field}: the backend scored no logprob at position {i}")
            return targets

        return list(await asyncio.gather(*(score(d, m) for d, m in zip(batch.datums, sampled, strict=True))))
