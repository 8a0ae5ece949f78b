"""The Train transaction. One step on model M at version N:
  validate → build datums → forward_backward, optim_step, save_weights_for_sampler("vNNNNNN") and,
  every --checkpoint-every steps, save_state("step_NNNNNN"), all submitted at once (the SDK orders
  them by sequence id) → ONE transaction commits version N+1, the checkpoint rows, the metrics, the
  idempotency record and, for a version without a state checkpoint, the step's write-ahead record
  (service/recovery.py) → respond.
A step that fails, is cancelled or passes its deadline (service/deadlines.py bounds each future) after it
submitted work marks the model dirty; the next call that trains first drops the training client and
rebuilds it at the committed version: loaded from the recovery point (the last committed state checkpoint),
the recorded steps after it replayed. A step the engine refused as non-finite (NON_FINITE_UPDATE) changed
nothing there: the model stays clean and only the saves submitted after it are deleted. A step that came
back with a non-finite loss or metric from a backend without that guard fails NON_FINITE_UPDATE too, and
the model is rebuilt the same way."""

from __future__ import annotations

import asyncio
import hashlib
import logging
import math
import time
from collections.abc import Awaitable
from typing import Literal, Protocol

import grpc
import tinker

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service import errors, minibatches, recovery
from tinkerrpc_server.service.datums import Batch, RenderedPrompts, build_batch, turn_prompt
from tinkerrpc_server.service.deadlines import bounded
from tinkerrpc_server.service.limits import Limits
from tinkerrpc_server.service.mismatch import sampler_mismatch
from tinkerrpc_server.service.models import (
    ModelRegistry,
    ModelRuntime,
    checkpoint_info,
    sampler_name,
    state_name,
)
from tinkerrpc_server.service.recovery import StepRecord
from tinkerrpc_server.service.rendering import ChatCodec, off_loop
from tinkerrpc_server.service.sample_cache import SampleCache
from tinkerrpc_server.service.sampling import sampler_path
from tinkerrpc_server.service.step_loss import loss_from_logprobs
from tinkerrpc_server.service.store import KIND_SAMPLER, KIND_STATE, CheckpointRow, ModelRow, Store
from tinkerrpc_server.service.train_options import adam_params, loss_config, loss_name
from tinkerrpc_server.service.train_terms import TermFigures, TrainTerms
from tinkerrpc_server.service.validation import (
    check_expected_version,
    check_train_request,
    check_train_size,
    check_train_tokens,
)

log = logging.getLogger("tinkerrpc.service")

# The points of a step a fault test may stop the process at.
StepPoint = Literal["after_optim", "after_sampler_save", "before_commit", "after_commit"]
# Scoring passes in flight at once for turns that came without logprobs or a usable sample key.
SCORING_CONCURRENCY = 32


class StepHooks(Protocol):
    def reached(self, point: StepPoint) -> None:
        """Called as a Train step passes `point`."""


class NoStepHooks:
    """Production: a step passes its points without a hook."""

    def reached(self, point: StepPoint) -> None:
        pass


def request_hash(request: pb.TrainRequest) -> str:
    keyless = pb.TrainRequest()
    keyless.CopyFrom(request)
    keyless.idempotency_key = ""
    return hashlib.sha256(keyless.SerializeToString(deterministic=True)).hexdigest()


def _step_loss(
    loss_fn: str,
    loss_config: dict[str, float] | None,
    datums: list[tinker.types.Datum],
    output: tinker.types.ForwardBackwardOutput,
) -> float:
    """One forward_backward's loss: Tinker's `loss:sum`, or when the backend reports none, the same sum
    from the logprobs it returned for `datums`."""
    if "loss:sum" in output.metrics:
        return float(output.metrics["loss:sum"])
    return loss_from_logprobs(loss_fn, loss_config, datums, output.loss_fn_outputs)


def _turns_without_logprobs(request: pb.TrainRequest) -> list[tuple[types_pb2.Trajectory, int]]:
    return [
        (trajectory, k)
        for group in request.groups
        for trajectory in group.trajectories
        for k, turn in enumerate(trajectory.turns)
        if not turn.completion_logprobs
    ]


class Trainer:
    def __init__(
        self,
        store: Store,
        models: ModelRegistry,
        checkpoint_every: int,
        limits: Limits,
        hooks: StepHooks,
        sample_cache: SampleCache,
    ) -> None:
        self._store = store
        self._models = models
        self._checkpoint_every = checkpoint_every
        self._limits = limits
        self._hooks = hooks
        self._sample_cache = sample_cache
        self._terms = TrainTerms(store, models)

    async def train(self, request: pb.TrainRequest) -> pb.TrainResponse:
        runtime = self._models.runtime(request.model)
        check_train_size(request, self._limits)
        hashed = request_hash(request) if request.idempotency_key else ""
        # Supervised examples render alike at every version, so they render while the steps queued
        # before this one run; their result (or error) is taken where the batch is built.
        early_batch = None if request.groups else asyncio.ensure_future(self._supervised_batch(request))
        try:
            return await self._train_in_turn(request, runtime, hashed, early_batch)
        finally:
            if early_batch is not None:
                early_batch.cancel()
                # A step that ended before its batch (a replay, an invalid request) discards the render.
                await asyncio.gather(early_batch, return_exceptions=True)

    async def _supervised_batch(self, request: pb.TrainRequest) -> Batch:
        codec = await self._models.codec(self._models.row(request.model))
        return await build_batch(request, 0, codec)

    async def _train_in_turn(
        self,
        request: pb.TrainRequest,
        runtime: ModelRuntime,
        hashed: str,
        early_batch: asyncio.Future[Batch] | None,
    ) -> pb.TrainResponse:
        # Steps on one model queue here in arrival order; a retry of a running step waits for it and
        # then finds its record.
        async with runtime.lock:
            started = time.monotonic()
            row = self._models.row(request.model)
            replay = self._replay(request, hashed)
            if replay is not None:
                return replay
            codec = await self._models.codec(row)
            # A malformed request (a negative expected version among them) is INVALID_ARGUMENT first.
            check_train_request(request, row.policy_version, codec.vocab_size, codec.max_context_length)
            check_expected_version(row, request)
            scorers = await self._terms.scorers(request, row, codec)
            request, scored_tokens = await self._with_sampler_logprobs(request, row, codec)
            batch = await (early_batch or build_batch(request, row.policy_version, codec))
            if not batch.datums:
                emptied_by = (
                    "dropping stale trajectories and zero-variance groups"
                    if request.groups
                    else "rendering the supervised examples (the renderer made no sequence of them)"
                )
                raise errors.failed_precondition(
                    errors.NOTHING_TO_TRAIN,
                    f"nothing left to train after {emptied_by}; the model was not changed",
                    {
                        "dropped_stale": batch.dropped_stale,
                        "dropped_zero_variance": batch.dropped_zero_variance,
                        "zero_variance_groups": batch.zero_variance_groups,
                    },
                )
            check_train_tokens(batch.total_tokens, self._limits)
            self._terms.hold_pins(row, scorers)
            figures = await self._terms.fold(scorers, batch)
            client = await self._models.training_client(request.model, runtime)
            runtime.dirty = True
            try:
                response = await self._step(
                    request, hashed, row, runtime, client, batch, (scored_tokens, figures), started
                )
            except (asyncio.CancelledError, errors.ServiceError) as ended:
                if (
                    isinstance(ended, asyncio.CancelledError)
                    or ended.code == grpc.StatusCode.DEADLINE_EXCEEDED
                ):
                    log.warning(
                        "model %s: Train cancelled mid-step (deadline, client or engine loss); nothing "
                        "committed, the model rolls back to version %d before its next step",
                        row.name,
                        row.policy_version,
                    )
                raise
            runtime.dirty = False
            self._hooks.reached("after_commit")
            return response

    async def _with_sampler_logprobs(
        self, request: pb.TrainRequest, row: ModelRow, codec: ChatCodec
    ) -> tuple[pb.TrainRequest, int]:
        """The request with every turn's completion logprobs filled in, and how many tokens that took
        scoring: a turn without logprobs takes those the sample cache kept under its sample_key when the
        key is genuine and names the turn's exact model, version, prompt and completion; any other such
        turn is scored with a prompt-logprobs pass at its policy version (the policy at temperature 1)."""
        if not _turns_without_logprobs(request):
            return request, 0
        filled = pb.TrainRequest()
        filled.CopyFrom(request)
        missing = _turns_without_logprobs(filled)
        rendered: RenderedPrompts = {}
        prompts = await off_loop(
            lambda: [turn_prompt(trajectory, k, codec, rendered) for trajectory, k in missing]
        )
        to_score: list[tuple[types_pb2.SampledTurn, list[int]]] = []
        for (trajectory, k), prompt in zip(missing, prompts, strict=True):
            turn = trajectory.turns[k]
            # The batch is built from this copy: its turns keep the prompt rendered here.
            if not turn.prompt_token_ids:
                turn.prompt_token_ids.extend(prompt)
            cached = (
                self._sample_cache.logprobs(
                    turn.sample_key, row.name, turn.policy_version, prompt, list(turn.completion_token_ids)
                )
                if turn.HasField("sample_key")
                else None
            )
            if cached is not None:
                turn.completion_logprobs.extend(cached)
            else:
                to_score.append((turn, prompt))
        limit = asyncio.Semaphore(SCORING_CONCURRENCY)

        async def score(turn: types_pb2.SampledTurn, prompt: list[int]) -> None:
            async with limit:
                turn.completion_logprobs.extend(await self._scored(row, turn.policy_version, prompt, turn))

        await asyncio.gather(*(score(turn, prompt) for turn, prompt in to_score))
        return filled, sum(len(turn.completion_token_ids) for turn, _ in to_score)

    async def _scored(
        self, row: ModelRow, version: int, prompt: list[int], turn: types_pb2.SampledTurn
    ) -> list[float]:
        """The completion's logprobs under the policy at `version`: prompt logprobs of prompt + completion."""
        with self._models.retention.pinned(row.name, version):
            client = await self._models.sampling_client(sampler_path(self._store, row, version))
            result = await client.sample(
                tinker.types.ModelInput.from_ints(prompt + list(turn.completion_token_ids)),
                num_samples=1,
                sampling_params=tinker.types.SamplingParams(max_tokens=1, seed=0),
                include_prompt_logprobs=True,
            )
        scored = (result.prompt_logprobs or [])[len(prompt) :]
        logprobs = [lp for lp in scored if lp is not None]
        if len(logprobs) != len(turn.completion_token_ids):
            raise RuntimeError(
                f"the backend scored {len(logprobs)} of {len(turn.completion_token_ids)} tokens"
            )
        return logprobs

    def _replay(self, request: pb.TrainRequest, hashed: str) -> pb.TrainResponse | None:
        """The recorded response of a request retried with its idempotency key."""
        if not request.idempotency_key:
            return None
        record = self._store.get_idempotency(request.model, request.idempotency_key)
        if record is None:
            return None
        if record.request_hash != hashed:
            raise errors.failed_precondition(
                errors.IDEMPOTENCY_KEY_REUSED,
                f"idempotency key {errors.shown(request.idempotency_key)} was used for a different request",
                {"idempotency_key": request.idempotency_key, "policy_version": record.policy_version},
            )
        replay = pb.TrainResponse.FromString(record.response)
        replay.replayed = True
        return replay

    async def _step(
        self,
        request: pb.TrainRequest,
        hashed: str,
        row: ModelRow,
        runtime: ModelRuntime,
        client: tinker.TrainingClient,
        batch: Batch,
        scored: tuple[int, TermFigures],
        started: float,
    ) -> pb.TrainResponse:
        """`scored`: the tokens scored for missing sampler logprobs, and the per-token terms' figures."""
        version = row.policy_version + 1
        scored_tokens, figures = scored
        loss = loss_name(request)
        save_state = version % self._checkpoint_every == 0
        config = loss_config(request)
        steps = minibatches.plan(request, batch, adam_params(request.adam))
        # The SDK sends them all at once; each waits for its result in a task of its own, so a step that
        # ends early (cancelled, past its deadline, failed) cancels the waits it no longer needs and the
        # engine drops those operations instead of running them for nobody.
        operations = [
            (
                asyncio.ensure_future(client.forward_backward(batch.datums[m.start : m.stop], loss, config)),
                asyncio.ensure_future(client.optim_step(m.adam)),
            )
            for m in steps
        ]
        sampler_save = asyncio.ensure_future(client.save_weights_for_sampler(sampler_name(version)))
        state_save = asyncio.ensure_future(client.save_state(state_name(version))) if save_state else None
        name = row.name
        try:
            fb_outputs: list[tinker.types.ForwardBackwardOutput] = []
            optim_metrics: list[dict[str, float] | None] = []
            for forward_backward, optim_step in operations:
                fb_outputs.append(await bounded(forward_backward, "forward_backward"))
                try:
                    optim_metrics.append((await bounded(optim_step, "optim_step")).metrics)
                except tinker.RequestFailedError as err:
                    if not errors.is_non_finite_update(err):
                        raise
                    await self._discard_saves(sampler_save, state_save)
                    # The engine kept the weights and optimizer state: with one optimizer step the training
                    # client is as before; other minibatches stepped it, so it rolls back.
                    runtime.dirty = len(operations) > 1
                    refused = errors.from_tinker(err)
                    assert refused is not None
                    raise refused from None
            fb_output = minibatches.combined_forward_backward(fb_outputs)
            losses = [
                _step_loss(loss, config, batch.datums[m.start : m.stop], output)
                for m, output in zip(steps, fb_outputs, strict=True)
            ]
            trainer_metrics = {**fb_output.metrics, **minibatches.combined_optim_metrics(optim_metrics)}
            non_finite = sorted(key for key, value in trainer_metrics.items() if not math.isfinite(value))
            if non_finite:
                # A backend without the engine's guard applied it: the model rolls back (it stays dirty).
                await self._discard_saves(sampler_save, state_save)
                raise errors.non_finite_update(f"the step's {', '.join(non_finite)} came out non-finite")
            self._hooks.reached("after_optim")
            sampler_path = (await bounded(sampler_save, "save_weights_for_sampler")).path
            self._hooks.reached("after_sampler_save")
            state_path = (await bounded(state_save, "save_state")).path if state_save is not None else None
            step_seconds = time.monotonic() - started

            metrics = types_pb2.TrainMetrics(
                loss=math.fsum(losses),
                mean_reward=batch.mean_reward,
                std_reward=batch.std_reward,
                learning_rate=request.adam.learning_rate,
                trained_tokens=batch.trained_tokens,
                scored_tokens=scored_tokens,
                total_tokens=batch.total_tokens,
                trajectories_used=batch.used,
                dropped_stale=batch.dropped_stale,
                dropped_zero_variance=batch.dropped_zero_variance,
                zero_variance_groups=batch.zero_variance_groups,
                staleness_histogram=batch.staleness_histogram,
                step_seconds=step_seconds,
                tokens_per_second=batch.total_tokens / step_seconds if step_seconds > 0 else 0.0,
                extra={**{k: float(v) for k, v in trainer_metrics.items()}, **batch.env_metrics},
                sampler_mismatch=sampler_mismatch(
                    batch.datums,
                    batch.sampled_masks,
                    fb_output.loss_fn_outputs,
                    request.importance_ratio_cap if request.HasField("importance_ratio_cap") else None,
                ),
                reference_kl=figures.reference_kl,
                teacher_kl=figures.teacher_kl,
                minibatch_losses=losses if request.HasField("minibatch_size") else [],
            )
            now = time.time()
            sampler_row = CheckpointRow(
                name, KIND_SAMPLER, sampler_name(version), version, sampler_path, now, True
            )
            state_row = (
                CheckpointRow(name, KIND_STATE, state_name(version), version, state_path, now, True)
                if state_path is not None
                else None
            )
            response = pb.TrainResponse(
                policy_version=version,
                metrics=metrics,
                sampler_checkpoint=checkpoint_info(sampler_row),
                state_checkpoint=checkpoint_info(state_row) if state_row is not None else None,
            )
            # Without a state checkpoint, this version is rebuilt from its record after the recovery point.
            step_record = (
                recovery.encode(StepRecord(batch.datums, loss, config, steps)) if state_row is None else None
            )
            # A state checkpoint of this name from an abandoned timeline (before a restore) is replaced.
            replaced = (
                self._store.get_checkpoint(name, KIND_STATE, state_name(version)) if state_row else None
            )
            self._hooks.reached("before_commit")
            with self._store.transaction() as tx:
                self._store.set_version(
                    tx, name, version, (version, state_path) if state_path is not None else None
                )
                self._store.put_checkpoint(tx, sampler_row)
                if state_row is not None:
                    self._store.put_checkpoint(tx, state_row)
                self._store.put_metrics(tx, name, version, metrics.SerializeToString())
                if step_record is not None:
                    self._store.put_step_inputs(tx, name, version, *step_record)
                if request.idempotency_key:
                    self._store.put_idempotency(
                        tx, name, request.idempotency_key, hashed, version, response.SerializeToString()
                    )
                self._store.set_run_id(name, str(client.model_id), tx)
                # Retention: what this version makes superfluous goes with its commit, the files after it.
                pruned = self._models.retention.prune(tx, row)
            self._models.events.train_committed(name, response)
            if replaced is not None and replaced.tinker_path != state_path:
                pruned.append(replaced.tinker_path)
            self._models.tidy_after_commit(runtime, name, pruned, str(client.model_id))
            log.info(
                "model %s: version %d (loss %.4f, %d datums, %.3fs)",
                name,
                version,
                metrics.loss,
                len(batch.datums),
                step_seconds,
            )
            return response
        finally:
            for operation in (*(o for pair in operations for o in pair), sampler_save, state_save):
                if operation is not None:
                    operation.cancel()  # a no-op for those already done

    async def _discard_saves(
        self,
        sampler_save: asyncio.Future[tinker.types.SaveWeightsForSamplerResponse],
        state_save: asyncio.Future[tinker.types.SaveWeightsResponse] | None,
    ) -> None:
        """A step that is not committed: the saves submitted after it still run (the SDK sent them at
        once); their files are deleted so the next step can save under the same names."""
        saves: list[Awaitable[tinker.types.SaveWeightsForSamplerResponse | tinker.types.SaveWeightsResponse]]
        saves = [bounded(sampler_save, "save_weights_for_sampler")]
        if state_save is not None:
            saves.append(bounded(state_save, "save_state"))
        saved = await asyncio.gather(*saves, return_exceptions=True)
        await self._models.delete_tinker_paths(
            [result.path for result in saved if not isinstance(result, BaseException)]
        )
