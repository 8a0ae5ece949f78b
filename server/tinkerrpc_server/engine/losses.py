"""Tinker's loss functions as pure tensor math: per token, summed over tokens (never averaged).

Each loss takes the learner's logprobs of the target tokens `lp` (N,), the datum's loss inputs
as float tensors (N,), and the loss config, and returns a scalar tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

Tensor = torch.Tensor
LossInputs = dict[str, Tensor]
LossConfig = dict[str, float]


def cross_entropy(lp: Tensor, inputs: LossInputs, config: LossConfig) -> Tensor:
    return -(lp * inputs["weights"]).sum()


def importance_sampling(lp: Tensor, inputs: LossInputs, config: LossConfig) -> Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    return -(ratio * inputs["advantages"]).sum()


def ppo(lp: Tensor, inputs: LossInputs, config: LossConfig) -> Tensor:
    advantages = inputs["advantages"]
    ratio = torch.exp(lp - inputs["logprobs"])
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


def cispo(lp: Tensor, inputs: LossInputs, config: LossConfig) -> Tensor:
    ratio = torch.exp(lp - inputs["logprobs"])
    # The clipped ratio only weights the policy gradient; no gradient flows through it.
    weight = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"]).detach()
    return -(weight * lp * inputs["advantages"]).sum()


def dro(lp: Tensor, inputs: LossInputs, config: LossConfig) -> Tensor:
    drift = lp - inputs["logprobs"]
    return -(lp * inputs["advantages"] - 0.5 * config["beta"] * drift**2).sum()


def gspo(lp: Tensor, inputs: LossInputs, config: LossConfig) -> Tensor:
    """GSPO-token: one datum is one sequence; every token's ratio has the value of the geometric mean of
    the token ratios over the positions sequence_ratio_mask marks, and its own logprob's gradient."""
    in_ratio = inputs["sequence_ratio_mask"] != 0
    sequence_log_ratio = (lp.detach() - inputs["logprobs"])[in_ratio].mean()
    ratio = torch.exp(sequence_log_ratio + lp - lp.detach())
    advantages = inputs["advantages"]
    clipped = torch.clamp(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    return -torch.minimum(ratio * advantages, clipped * advantages).sum()


def stable_reinforce(lp: Tensor, inputs: LossInputs, config: LossConfig) -> Tensor:
    """REINFORCE weighted by the detached importance ratio, with a kl_coeff-weighted estimate of
    KL(sampler || learner) per token, (r - 1) - log r, which is >= 0 and 0 on-policy. Tinker does not
    publish its objective: docs/tinker_parity.md says what is Tinker's and what is this engine's choice."""
    log_ratio = lp - inputs["logprobs"]
    ratio = torch.exp(log_ratio)
    kl = ratio - 1 - log_ratio
    return -(ratio.detach() * lp * inputs["advantages"] - config["kl_coeff"] * kl).sum()


def empty_sequence_ratio_mask(inputs: dict[str, np.ndarray]) -> str | None:
    if not np.any(np.asarray(inputs["sequence_ratio_mask"]) != 0):
        return "loss_fn_inputs['sequence_ratio_mask'] marks no position: gspo's sequence ratio needs one"
    return None


@dataclass(frozen=True)
class LossSpec:
    fn: Callable[[Tensor, LossInputs, LossConfig], Tensor]
    float_inputs: tuple[str, ...]  # required beside target_tokens
    config_defaults: dict[str, float | None]  # None = the caller must set it
    # A datum's inputs the loss cannot take, as a message for the user; None when they are fine.
    check_inputs: Callable[[dict[str, np.ndarray]], str | None] | None = None


_CLIP_DEFAULTS: dict[str, float | None] = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("weights",), {}),
    "importance_sampling": LossSpec(importance_sampling, ("logprobs", "advantages"), {}),
    "ppo": LossSpec(ppo, ("logprobs", "advantages"), _CLIP_DEFAULTS),
    "cispo": LossSpec(cispo, ("logprobs", "advantages"), _CLIP_DEFAULTS),
    "dro": LossSpec(dro, ("logprobs", "advantages"), {"beta": None}),
    "gspo": LossSpec(
        gspo, ("logprobs", "advantages", "sequence_ratio_mask"), _CLIP_DEFAULTS, empty_sequence_ratio_mask
    ),
    "stable_reinforce": LossSpec(stable_reinforce, ("logprobs", "advantages"), {"kl_coeff": 0.0}),
}

# Config values that must not be negative (the clip thresholds are checked against each other).
_NON_NEGATIVE = ("kl_coeff",)


def resolve_config(loss_fn: str, config: dict[str, float] | None) -> LossConfig:
    """Fill defaults and check the keys; raises ValueError with a message meant for the user."""
    spec = LOSSES[loss_fn]
    given = dict(config or {})
    unknown = sorted(set(given) - set(spec.config_defaults))
    if unknown:
        allowed = ", ".join(spec.config_defaults) or "none"
        raise ValueError(f"loss_fn_config keys {unknown} are not used by {loss_fn} (allowed: {allowed})")
    resolved: LossConfig = {}
    for key, default in spec.config_defaults.items():
        value = given.get(key, default)
        if value is None:
            raise ValueError(f"{loss_fn} needs loss_fn_config[{key!r}]")
        if not torch.isfinite(torch.tensor(float(value))):
            raise ValueError(f"loss_fn_config[{key!r}] must be finite, got {value}")
        resolved[key] = float(value)
    for key in _NON_NEGATIVE:
        if key in resolved and resolved[key] < 0:
            raise ValueError(f"loss_fn_config[{key!r}] must be >= 0, got {resolved[key]}")
    if "clip_low_threshold" in resolved and resolved["clip_low_threshold"] > resolved["clip_high_threshold"]:
        raise ValueError("clip_low_threshold must not exceed clip_high_threshold")
    return resolved
