"""Every keyword argument ART's callers pass to `Backend.train()`, each implemented or refused by name.

ART 0.5.20+'s PipelineTrainer always passes `optimizer_save_interval`, and `grad_accumulation_sequences`
and `kl_penalty_coef`/`kl_penalty_source`/`kl_penalty_reference_step` when they are set; its
LocalBackend's `train()` takes more (knobs of ART's own GPU trainer). Code written for either reaches
TinkerRPCBackend.train() with them. What each does here is decided once, in this module: implemented
(the backend reads the resolved `ArtTrainOptions`), of no effect on what is trained (how ART's own trainer
batches, logs or pre-computes), or accepted only at the value at which it changes nothing and refused
with a ValueError naming it at any other. A keyword no ART backend takes stays a TypeError.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

from tinkerrpc._train_terms import KLPenalty, PolicyRef

# The KL penalty source ART names that tinkerrpc's KLPenalty is: d = sampler − reference logprob per
# sampled token ("sample", all PipelineTrainer sends); LocalBackend's default "current_learner" (the
# learner's logprobs) is another.
KL_PENALTY_SOURCE = "sample"

# Arguments of LocalBackend.train() that change nothing tinkerrpc trains, whatever their value.
NO_EFFECT: Mapping[str, str] = {
    "verbose": "tinkerrpc reports each step in its metrics and run history",
    "plot_tensors": "ART's debugging plots of its own trainer's tensors",
    "logprob_calculation_chunk_size": "ART's own trainer's memory knob; the server batches its forward passes",
    "packed_sequence_length": "ART's own trainer's packing; the server packs each step's turns itself",
    "final_training_step": "ART's own trainer's last-step optimizer snapshot",
    "precalculate_logprobs": "each turn brings the sampler's logprobs (or the sample key of the server's copy)",
    "allow_training_without_logprobs": (
        "a Choice without logprobs trains on the server's copy named by its sample key, or is scored"
    ),
}

# Arguments accepted only at the value at which they change nothing: (that value, why another is refused).
NEUTRAL_ONLY: Mapping[str, tuple[object, str]] = {
    "kl_ref_adapter_path": (None, "a KL reference is a policy version of the model, not an adapter path"),
    "epsilon": (
        None,
        "set the ratio clip as loss_fn_config={'clip_low_threshold': ..., 'clip_high_threshold': ...}",
    ),
    "epsilon_high": (
        None,
        "set the ratio clip as loss_fn_config={'clip_low_threshold': ..., 'clip_high_threshold': ...}",
    ),
    "advantage_balance": (0.0, "advantages are the group's centred (and optionally scaled) rewards"),
    "importance_sampling_level": (
        "token",
        "importance ratios are per token (loss_fn 'gspo' for per sequence)",
    ),
    "max_negative_advantage_importance_sampling_weight": (None, "no cap on negative-advantage ratios"),
    "mask_prob_ratio": (False, "ratios are clipped by the loss, never masked"),
    "kimi_k2_tau": (None, "no Kimi K2 loss"),
    "scale_learning_rate_by_reward_std_dev": (False, "the learning rate is the one given"),
    "num_trajectories_learning_rate_multiplier_power": (0.0, "the learning rate is the one given"),
}


@dataclass(frozen=True)
class ArtTrainOptions:
    """What the backend does with ART's arguments: divide advantages by the group's reward std, save the
    full training state at every version that is a multiple of `optimizer_save_interval`, penalise the
    KL to a reference (ART's kl_penalty_*) and cap importance ratios (truncated_importance_sampling)."""

    normalize_std: bool
    optimizer_save_interval: int | None
    kl_penalty: KLPenalty | None
    importance_ratio_cap: float | None

    def saves_state_at(self, version: int) -> bool:
        interval = self.optimizer_save_interval
        return interval is not None and version % interval == 0


def _is_int(value: object) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def resolve_train_options(
    *,
    trajectories: int,
    normalize_advantages: bool,
    scale_rewards: bool,
    optimizer_save_interval: int | None,
    grad_accumulation_sequences: int | None,
    kl_penalty_coef: float,
    kl_penalty_reference_step: int | None,
    kl_penalty_source: str,
    truncated_importance_sampling: float | None,
    others: Mapping[str, Any],
) -> ArtTrainOptions:
    """ART's train() arguments checked; `trajectories` is the step's count (one optimizer step over them)."""
    unknown = sorted(set(others) - set(NO_EFFECT) - set(NEUTRAL_ONLY))
    if unknown:
        raise TypeError(
            f"TinkerRPCBackend.train() got unexpected keyword arguments {unknown}: no ART backend takes them"
        )
    for name, value in others.items():
        if name in NEUTRAL_ONLY and value != NEUTRAL_ONLY[name][0]:
            neutral, why = NEUTRAL_ONLY[name]
            raise ValueError(
                f"TinkerRPCBackend.train(): {name}={value!r} is not supported ({why}); leave it at {neutral!r}"
            )
    if optimizer_save_interval is not None and not (
        _is_int(optimizer_save_interval) and optimizer_save_interval >= 1
    ):
        raise ValueError(f"optimizer_save_interval must be an integer >= 1, got {optimizer_save_interval!r}")
    if grad_accumulation_sequences is not None:
        if not _is_int(grad_accumulation_sequences):
            raise ValueError(
                f"grad_accumulation_sequences must be an integer >= 1, got {grad_accumulation_sequences!r}"
            )
        if grad_accumulation_sequences < trajectories:
            raise ValueError(
                f"grad_accumulation_sequences={grad_accumulation_sequences} asks for an optimizer step every "
                f"{grad_accumulation_sequences} sequences; TinkerRPCBackend takes one optimizer step per train() "
                f"call, over all {trajectories} trajectories: leave it None or set it >= {trajectories}"
            )
    return ArtTrainOptions(
        normalize_advantages and scale_rewards,
        optimizer_save_interval,
        _kl_penalty(kl_penalty_coef, kl_penalty_reference_step, kl_penalty_source),
        # ART's truncation threshold of importance weights is tinkerrpc's importance_ratio_cap (checked there).
        truncated_importance_sampling,
    )


def _kl_penalty(coef: float, reference_step: int | None, source: str) -> KLPenalty | None:
    """ART's KL arguments as tinkerrpc's KLPenalty (its coefficient range checked there): the reference is
    the model's `reference_step` version (PipelineTrainer's kl_penalty_step_lag behind), else its base model
    (ART's Tinker backend's default). Step 0, what PipelineTrainer sends without a lag, is ART's
    identity/base reference and is the base model here too: version 0's adapter is the base model exactly
    (LoRA's B starts at zero; the server scores a reference to version 0 as its base model as well). Any
    other step is pinned by the server while Trains name it, past its --keep-sampler-versions."""
    if source != KL_PENALTY_SOURCE:
        raise ValueError(
            f"kl_penalty_source={source!r} is not supported: tinkerrpc's KL penalty compares the sampler's "
            f"logprobs with the reference's ({KL_PENALTY_SOURCE!r})"
        )
    if reference_step is not None and not (_is_int(reference_step) and reference_step >= 0):
        raise ValueError(
            f"kl_penalty_reference_step must be a policy version (an integer >= 0), got {reference_step!r}"
        )
    if isinstance(coef, bool) or not isinstance(coef, int | float):
        raise ValueError(f"kl_penalty_coef must be a number, got {coef!r}")
    if coef == 0:
        return None
    return KLPenalty(float(coef), PolicyRef.version(reference_step) if reference_step else None)
