"""Tinker's loss functions as pure tensor math: per token, summed over tokens (never averaged).

Each loss takes the learner's logprobs of the target tokens `lp` (N,), the datum's loss inputs
as float tensors (N,), and the loss config, and returns a scalar tensor.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

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


@dataclass(frozen=True)
class LossSpec:
    fn: Callable[[Tensor, LossInputs, LossConfig], Tensor]
    float_inputs: tuple[str, ...]  # required beside target_tokens
    config_defaults: dict[str, float | None]  # None = the caller must set it


_CLIP_DEFAULTS: dict[str, float | None] = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}

LOSSES: dict[str, LossSpec] = {
    "cross_entropy": LossSpec(cross_entropy, ("weights",), {}),
    "importance_sampling": LossSpec(importance_sampling, ("logprobs", "advantages"), {}),
    "ppo": LossSpec(ppo, ("logprobs", "advantages"), _CLIP_DEFAULTS),
    "cispo": LossSpec(cispo, ("logprobs", "advantages"), _CLIP_DEFAULTS),
    "dro": LossSpec(dro, ("logprobs", "advantages"), {"beta": None}),
}


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
    if "clip_low_threshold" in resolved and resolved["clip_low_threshold"] > resolved["clip_high_threshold"]:
        raise ValueError("clip_low_threshold must not exceed clip_high_threshold")
    return resolved
