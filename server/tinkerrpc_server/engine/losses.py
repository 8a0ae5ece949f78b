"""Tinker's loss functions as pure tensor math: per token, summed over tokens (never averaged).

Each loss takes the learner's logprobs of the target tokens `lp` (N,), the datum's loss inputs
as float tensors (N,), and the loss config, and returns a scalar tensor. A loss whose contract row takes
soft targets gets `[N, K]` logprobs and inputs when a datum has K targets per position: the same
elementwise formula, summed over both axes (cross_entropy: -Σ_{n,k} w[n,k]·log p(t[n,k] | prefix n)).
Which losses exist, the inputs each takes and its config keys' defaults and ranges are the contract's
loss table (`tinkerrpc.contract.losses`); here is only their math, keyed by the table's names.
"""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np
import torch

from tinkerrpc.contract import losses as contract

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


LossFunction = Callable[[Tensor, LossInputs, LossConfig], Tensor]
# A datum's inputs a loss cannot take, as a message for the user; None when they are fine.
InputCheck = Callable[[dict[str, np.ndarray]], str | None]

LOSS_FUNCTIONS: dict[str, LossFunction] = {
    "cross_entropy": cross_entropy,
    "importance_sampling": importance_sampling,
    "ppo": ppo,
    "cispo": cispo,
    "dro": dro,
    "gspo": gspo,
    "stable_reinforce": stable_reinforce,
}
_INPUT_CHECKS: dict[str, InputCheck] = {"gspo": empty_sequence_ratio_mask}


@dataclass(frozen=True)
class LossSpec:
    fn: LossFunction
    float_inputs: tuple[str, ...]  # required beside target_tokens
    config: tuple[contract.ConfigKey, ...]
    check_inputs: InputCheck | None
    soft_targets: bool  # takes [N, K] target_tokens


LOSSES: dict[str, LossSpec] = {
    loss.name: LossSpec(
        LOSS_FUNCTIONS[loss.name], loss.inputs, loss.config, _INPUT_CHECKS.get(loss.name), loss.soft_targets
    )
    for loss in contract.LOSSES
}


def resolve_config(loss_fn: str, config: dict[str, float] | None) -> LossConfig:
    """Fill defaults and check the keys; raises ValueError with a message meant for the user. A key
    Tinker's API requires (dro's beta) has no default here either."""
    keys = LOSSES[loss_fn].config
    given = dict(config or {})
    unknown = sorted(set(given) - {key.name for key in keys})
    if unknown:
        allowed = ", ".join(key.name for key in keys) or "none"
        raise ValueError(f"loss_fn_config keys {unknown} are not used by {loss_fn} (allowed: {allowed})")
    resolved: LossConfig = {}
    for key in keys:
        if key.name not in given and key.tinker_requires:
            raise ValueError(f"{loss_fn} needs loss_fn_config[{key.name!r}]")
        value = float(given.get(key.name, key.default))
        if not math.isfinite(value):
            raise ValueError(f"loss_fn_config[{key.name!r}] must be finite, got {value}")
        resolved[key.name] = value
    if "clip_low_threshold" in resolved and resolved["clip_low_threshold"] > resolved["clip_high_threshold"]:
        raise ValueError("clip_low_threshold must not exceed clip_high_threshold")
    for key in keys:
        if resolved[key.name] not in key.range:
            raise ValueError(
                f"loss_fn_config[{key.name!r}] must be {key.range.rule()}, got {resolved[key.name]}"
            )
    return resolved
