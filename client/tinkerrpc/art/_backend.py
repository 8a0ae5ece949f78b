"""TinkerRPCBackend: ART's `Backend` over a tinkerrpc server and the OpenAI sidecar it hosts."""

from __future__ import annotations

import math
import os
from collections.abc import AsyncIterator, Iterable, Mapping, Sequence
from contextlib import asynccontextmanager
from contextvars import ContextVar
from typing import Any, cast

import art
from art import dev

from tinkerrpc._async_client import AsyncClient, AsyncModel
from tinkerrpc._channel import TlsOption
from tinkerrpc._errors import AlreadyExistsError, FailedPreconditionError, ResourceExhaustedError
from tinkerrpc._openai_client import sidecar_connection
from tinkerrpc._types import CheckpointInfo, SupervisedExample, TrainResult
from tinkerrpc.art._train_options import resolve_train_options
from tinkerrpc.art._trajectories import TrajectoryGroupLike, convert_groups, sft_conversation
from tinkerrpc.contract.losses import TRAIN_CONFIG_KEYS, RLLossName
from tinkerrpc.v1.errors_pb2 import ErrorReason

# ART's Tinker defaults (its TinkerNativeBackend) when no adam_params are given: AdamW betas (0.9, 0.95)
# and eps 1e-8.
DEFAULT_ADAM = {"beta1": 0.9, "beta2": 0.95, "eps": 1e-8}
# The loss_fn_config keys a Train sets (clip thresholds for ppo/cispo/gspo, beta for dro).
LOSS_CONFIG_KEYS = tuple(key.name for key in TRAIN_CONFIG_KEYS)
# The full training state train() saves (save_checkpoint, optimizer_save_interval), named per version;
# the state of that name left by another timeline (before a restore) is replaced (_save_art_checkpoint).
ART_CHECKPOINT_NAME = "art-step-{version:06d}"
# SFT conversations per optimizer step when TrainSFTConfig.batch_size is "auto".
AUTO_SFT_BATCH_SIZE = 32

Model = art.Model[Any, Any]
TrainableModel = art.TrainableModel[Any, Any]

# The policy version each model's inference is pinned to in this context (adapter leases), by model name.
_pinned_versions: ContextVar[Mapping[str, int] | None] = ContextVar(
    "tinkerrpc_art_pinned_versions", default=None
)


class TinkerRPCBackend(art.Backend):
    """ART's Backend on a `tinkerrpc serve --sidecar-port ...`: `model.register(backend)` gets or creates
    the tinkerrpc model of the same name, `model.openai_client()` talks to the hosted sidecar, and
    `backend.train(model, groups, ...)` is one tinkerrpc Train step on the sampled tokens.

    `target`/`token`/`tls` are those of `tinkerrpc.AsyncClient`. The sidecar's URL comes from the server
    unless `sidecar_url` is given; its key is `sidecar_api_key` or $TINKERRPC_SIDECAR_API_KEY. `path` is
    where ART keeps its local logs (history.jsonl), as with ART's own backends.

    A model's LoRA shape and renderer come from ART's `_internal_config["tinker_native_args"]`
    (`renderer_name`, `training_client_args`: rank, seed, train_mlp/attn/unembed), as on Tinker; what
    they leave out takes tinkerrpc's defaults (`create_model`'s)."""

    def __init__(
        self,
        target: str = "127.0.0.1:50051",
        *,
        token: str | None = None,
        tls: TlsOption = False,
        sidecar_url: str | None = None,
        sidecar_api_key: str | None = None,
        path: str = ".art",
    ) -> None:
        self._target, self._token, self._tls = target, token, tls
        self._sidecar_url = sidecar_url
        self._sidecar_api_key = sidecar_api_key
        self._path = path
        self._client: AsyncClient | None = None
        # Each registered model's policy version as last seen: _model_inference_name cannot await.
        self._steps: dict[str, int] = {}

    async def _connected(self) -> AsyncClient:
        # Made on first use, on the caller's event loop (grpc.aio binds a channel to it).
        if self._client is None:
            self._client = AsyncClient(self._target, self._token, self._tls)
        return await self._client.connect()

    async def _handle(self, model: Model) -> AsyncModel:
        return (await self._connected()).model(model.name)

    async def close(self) -> None:
        if self._client is not None:
            await self._client.close()
            self._client = None

    async def register(self, model: Model) -> None:
        model.base_path = self._path
        os.makedirs(model._get_output_dir(), exist_ok=True)
        if not model.trainable:
            return
        trainable = cast(TrainableModel, model)
        native: Mapping[str, Any] = (trainable._internal_config or {}).get("tinker_native_args") or {}
        args: Mapping[str, Any] = native.get("training_client_args") or {}
        # ART's Tinker options where given, else tinkerrpc's defaults.
        options = {
            key: args[key] for key in ("seed", "train_mlp", "train_attn", "train_unembed") if key in args
        }
        if "rank" in args:
            options["lora_rank"] = args["rank"]
        client = await self._connected()
        handle = await client.create_model(
            trainable.name,
            trainable.base_model,
            renderer=native.get("renderer_name"),
            exist_ok=True,
            **options,
        )
        self._steps[trainable.name] = (await handle.info()).policy_version

    async def _prepare_backend_for_training(
        self, model: TrainableModel, config: dev.OpenAIServerConfig | None = None
    ) -> tuple[str, str]:
        """The sidecar's base URL and key, for ART's `model.openai_client()`. `config` (ART's options for
        the inference server it would start) does not apply: the server hosts the sidecar."""
        info = None if self._sidecar_url else await (await self._connected()).server_info()
        return sidecar_connection(info, self._sidecar_url, self._sidecar_api_key)

    def _model_inference_name(self, model: Model, step: int | None = None) -> str:
        """`name@step`, the sidecar's id of that policy version; when step is None, the version an adapter
        lease pins in this context, else the latest seen."""
        if step is None:
            step = (_pinned_versions.get() or {}).get(model.name, self._steps.get(model.name, 0))
        return f"{model.name}@{step}"

    @asynccontextmanager
    async def adapter_lease(self, model: TrainableModel, step: int) -> AsyncIterator[None]:
        """Within the context (and the tasks it starts), `model.get_inference_name()` is `name@step`: the
        sidecar samples policy version `step`, whatever trains meanwhile (ART's PipelineTrainer pins its
        rollouts to the version they started from). The version stays sampleable while ART keeps it
        (PipelineTrainer passes leased steps to `_delete_checkpoint_files` as steps to keep)."""
        token = _pinned_versions.set({**(_pinned_versions.get() or {}), model.name: step})
        try:
            yield
        finally:
            _pinned_versions.reset(token)

    @asynccontextmanager
    async def exact_adapter_lease(self, model: TrainableModel, step: int) -> AsyncIterator[None]:
        """`adapter_lease` after checking that the server can sample version `step` now (PipelineTrainer's
        eval of a step): a version whose sampler weights are gone is a ValueError naming it."""
        info = await (await self._handle(model)).info()
        if step != info.policy_version and step not in info.sampleable_versions:
            raise ValueError(
                f"exact_adapter_lease: {model.name} cannot sample policy version {step} (its sampleable "
                f"versions: {sorted({*info.sampleable_versions, info.policy_version})})"
            )
        async with self.adapter_lease(model, step):
            yield

    async def _get_step(self, model: TrainableModel) -> int:
        step = (await (await self._handle(model)).info()).policy_version
        self._steps[model.name] = step
        return step

    async def train(
        self,
        model: TrainableModel,
        trajectory_groups: Iterable[TrajectoryGroupLike],
        *,
        learning_rate: float = 1e-5,
        loss_fn: RLLossName = "cispo",
        normalize_advantages: bool = True,
        save_checkpoint: bool = False,
        loss_fn_config: Mapping[str, float] | None = None,
        adam_params: Any = None,
        optimizer_save_interval: int | None = None,
        grad_accumulation_sequences: int | None = None,
        scale_rewards: bool = True,
        kl_penalty_coef: float = 0.0,
        kl_penalty_reference_step: int | None = None,
        kl_penalty_source: str = "sample",
        truncated_importance_sampling: float | None = None,
        **art_options: Any,
    ) -> art.TrainResult:
        """One Train step on the groups' sampled turns (every Choice or captured exchange of this model,
        token-exact). `adam_params` (a tinker.AdamParams) overrides `learning_rate`; with
        `normalize_advantages` and `scale_rewards` the advantages are divided by the group's reward std;
        groups whose rewards are all equal are skipped. `save_checkpoint` saves the full training state
        after the step, and so does every version that is a multiple of `optimizer_save_interval`.
        The other arguments ART's backends take are checked by `_train_options` (implemented, or
        refused naming them)."""
        unknown = set(loss_fn_config or {}) - set(LOSS_CONFIG_KEYS)
        if unknown:
            raise ValueError(f"loss_fn_config keys must be among {LOSS_CONFIG_KEYS}, got {sorted(unknown)}")
        groups = convert_groups(trajectory_groups, model.name)
        options = resolve_train_options(
            trajectories=sum(len(g.trajectories) for g in groups),
            normalize_advantages=normalize_advantages,
            scale_rewards=scale_rewards,
            optimizer_save_interval=optimizer_save_interval,
            grad_accumulation_sequences=grad_accumulation_sequences,
            kl_penalty_coef=kl_penalty_coef,
            kl_penalty_reference_step=kl_penalty_reference_step,
            kl_penalty_source=kl_penalty_source,
            truncated_importance_sampling=truncated_importance_sampling,
            others=art_options,
        )
        handle = await self._handle(model)
        metrics = {"data/step_num_groups_submitted": float(len(groups))}
        if not groups:
            return art.TrainResult(step=await self._get_step(model), metrics=metrics)
        adam = {**DEFAULT_ADAM, "learning_rate": learning_rate}
        if adam_params is not None:
            adam = {k: getattr(adam_params, k) for k in (*DEFAULT_ADAM, "learning_rate")}
        try:
            result = await handle.train(
                groups,
                loss=loss_fn,
                learning_rate=adam["learning_rate"],
                adam_beta1=adam["beta1"],
                adam_beta2=adam["beta2"],
                adam_eps=adam["eps"],
                weight_decay=float(getattr(adam_params, "weight_decay", 0.0) or 0.0),
                grad_clip_norm=float(getattr(adam_params, "grad_clip_norm", 0.0) or 0.0),
                normalize_std=options.normalize_std,
                clip_low_threshold=(loss_fn_config or {}).get("clip_low_threshold"),
                clip_high_threshold=(loss_fn_config or {}).get("clip_high_threshold"),
                beta=(loss_fn_config or {}).get("beta"),
                kl_penalty=options.kl_penalty,
                importance_ratio_cap=options.importance_ratio_cap,
            )
        except FailedPreconditionError as err:
            if err.reason != ErrorReason.ERROR_REASON_NOTHING_TO_TRAIN:
                raise
            metrics["data/step_num_groups_trainable"] = 0.0
            return art.TrainResult(step=await self._get_step(model), metrics=metrics)
        if save_checkpoint or options.saves_state_at(result.policy_version):
            await _save_art_checkpoint(handle, result.policy_version)
        self._steps[model.name] = result.policy_version
        trainable = len(groups) - result.metrics.zero_variance_groups
        metrics["data/step_num_groups_trainable"] = float(trainable)
        return art.TrainResult(step=result.policy_version, metrics={**metrics, **_art_metrics(result)})

    async def _train_sft(
        self,
        model: TrainableModel,
        trajectories: Iterable[art.Trajectory],
        config: art.TrainSFTConfig,
        dev_config: dev.TrainSFTConfig,
        verbose: bool = False,
    ) -> AsyncIterator[dict[str, float]]:
        """Supervised steps on the trajectories' conversations (every assistant message trains), in
        batches of `config.batch_size` ("auto": 32), each with its learning rate (one, or one per batch).
        As ART's own backends end an SFT run in one checkpoint, the batches go as minibatches of one Train
        (one policy version, one sampler save), or of as few Trains as the server's per-Train limits
        allow (its example limit, then halving a Train the server refuses for its tokens); each batch's
        figures are yielded once its Train is done."""
        client = await self._connected()
        handle = client.model(model.name)
        examples = [SupervisedExample(*sft_conversation(t)) for t in trajectories]
        size = AUTO_SFT_BATCH_SIZE if config.batch_size == "auto" else config.batch_size
        batches = math.ceil(len(examples) / size)
        rates = config.learning_rate
        if isinstance(rates, list) and len(rates) < batches:
            raise ValueError(f"{len(rates)} learning rates for {batches} batches")
        per_train = max(1, (await client.server_info()).limits.max_train_trajectories // size)
        first = 0
        while first < batches:
            last = min(first + per_train, batches)
            schedule = rates[first:last] if isinstance(rates, list) else []
            try:
                result = await handle.train_supervised(
                    examples[first * size : last * size],
                    learning_rate=schedule[0] if schedule else cast(float, rates),
                    minibatch_size=size,
                    minibatch_learning_rates=schedule,
                )
            except ResourceExhaustedError:
                # Past the server's tokens per Train (refused, nothing trained): half as many batches.
                if last - first == 1:
                    raise
                per_train = (last - first) // 2
                continue
            self._steps[model.name] = result.policy_version
            for k, loss in enumerate(result.metrics.minibatch_losses):
                if verbose:
                    print(f"tinkerrpc SFT batch {first + k + 1}/{batches}: loss {loss:.4f}")
                yield {
                    **_art_metrics(result),
                    "loss/train": loss,
                    "loss/learning_rate": schedule[k] if schedule else cast(float, rates),
                }
            first = last

    async def _delete_checkpoint_files(self, model: TrainableModel, steps_to_keep: list[int]) -> None:
        """Delete the checkpoints (sampler weights and full states) of every version but `steps_to_keep`;
        the current version's sampler and the state the model recovers from always stay."""
        handle = await self._handle(model)
        doomed: Sequence[CheckpointInfo] = [
            c for c in await handle.checkpoints() if c.policy_version not in steps_to_keep
        ]
        for checkpoint in doomed:
            try:
                await handle.delete_checkpoint(checkpoint)
            except FailedPreconditionError as err:
                if err.reason not in (
                    ErrorReason.ERROR_REASON_RECOVERY_CHECKPOINT,
                    ErrorReason.ERROR_REASON_CURRENT_SAMPLER_CHECKPOINT,
                ):
                    raise


async def _save_art_checkpoint(handle: AsyncModel, version: int) -> None:
    """Save the full training state as `art-step-<version>`: named, so the server's retention of its
    automatic per-step states keeps it until ART deletes it. A state of that name already there was
    saved before the model was restored to an earlier version, on the timeline the restore discarded:
    it is replaced, as ART's own backends overwrite a step's checkpoint when training reaches the step
    again."""
    name = ART_CHECKPOINT_NAME.format(version=version)
    try:
        await handle.save_checkpoint(name)
    except AlreadyExistsError:
        await handle.delete_checkpoint(name, "state")
        await handle.save_checkpoint(name)


def _art_metrics(result: TrainResult) -> dict[str, float]:
    """A Train step's figures under ART's metric names."""
    m = result.metrics
    figures = {
        "loss/train": m.loss,
        "loss/learning_rate": m.learning_rate,
        "data/step_num_trajectories": float(m.trajectories_used),
        "data/step_trainer_tokens": float(m.trained_tokens),
        "data/step_scored_tokens": float(m.scored_tokens),
        "time/step_trainer_s": m.step_seconds,
    }
    if m.reference_kl is not None:  # ART's name for the KL penalty's mean sampler − reference logprob
        figures["loss/kl_policy_ref"] = m.reference_kl
    return figures
