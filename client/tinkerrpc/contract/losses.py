"""The loss table: one row per loss that Train, the SDK and the embedded engine know.

A row names the loss as Tinker does (its `loss_fn`, which is also the SDK's name and, upper-cased, the
proto's `LossFunction` value), the `loss_fn_inputs` a datum carries for it besides `target_tokens`, and
its `loss_fn_config` keys, each with its one default and its allowed range. The math lives in two
places keyed by these names: the engine's torch functions (`tinkerrpc_server.engine.losses`) and the
service's numpy step-loss functions (`tinkerrpc_server.service.step_loss`), for a backend that reports no
`loss:sum`.
"""

from __future__ import annotations

import math
from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from tinkerrpc.contract.limits import MAX_LOSS_PARAMETER, markdown_table

# The table's loss names, for the type checker (tests/foundation/test_contract.py keeps them equal to
# the rows'); a row's name must be one of them.
LossName = Literal["cross_entropy", "importance_sampling", "ppo", "cispo", "dro", "stable_reinforce", "gspo"]
RLLossName = Literal["importance_sampling", "ppo", "cispo", "dro", "stable_reinforce", "gspo"]


@dataclass(frozen=True)
class Range:
    """Allowed values of a number: within [low, high], each end excluded when `*_open`; None: no bound.
    Non-finite values are never in a range."""

    low: float | None = None
    high: float | None = None
    low_open: bool = False
    high_open: bool = False

    def __contains__(self, value: float) -> bool:
        if not math.isfinite(value):
            return False
        if self.low is not None and (value <= self.low if self.low_open else value < self.low):
            return False
        return self.high is None or (value < self.high if self.high_open else value <= self.high)

    def rule(self) -> str:
        """The range as an error message says it: "in (0, 1]", ">= 0"."""
        return str(self) if self.low is None or self.high is None else f"in {self}"

    def __str__(self) -> str:
        if self.high is None:
            return f"{'>' if self.low_open else '>='} {self.low:g}" if self.low is not None else "finite"
        if self.low is None:
            return f"{'<' if self.high_open else '<='} {self.high:g}"
        return f"{'(' if self.low_open else '['}{self.low:g}, {self.high:g}{')' if self.high_open else ']'}"


@dataclass(frozen=True)
class ConfigKey:
    """A `loss_fn_config` key: `default` is what tinkerrpc uses when it is unset (Train fills it in; the
    engine too unless `tinker_requires`, where Tinker's API names no default, so the engine refuses a
    forward_backward without it as Tinker does); `train_field` is the LossConfig field that sets it
    through Train, None when only the engine's Tinker API takes it."""

    name: str
    default: float
    range: Range
    train_field: str | None
    tinker_requires: bool = False


@dataclass(frozen=True)
class Loss:
    """One loss. `inputs`: the float `loss_fn_inputs` besides `target_tokens`; `rl`: trains trajectory
    groups (policy gradient) rather than supervised examples; `objective`: its per-datum value, summed
    over tokens (lp the learner's logprob of the target, q the sampler's, A the advantage,
    r = exp(lp - q), sg a stop-gradient); `soft_targets`: the engine takes `[N, K]` target_tokens (K
    per position, its inputs of the same shape, at most limits.MAX_ENGINE_SOFT_TARGETS), the sum then
    running over every target of every position; the tinker SDK sparsifies only target_tokens and
    weights, and its custom losses and the cookbook's distillation send [N, K] to cross_entropy."""

    name: LossName
    inputs: tuple[str, ...]
    config: tuple[ConfigKey, ...]
    rl: bool
    objective: str
    soft_targets: bool = False

    @property
    def proto_enum(self) -> str:
        """Its `tinkerrpc.v1.LossFunction` value's name."""
        return f"LOSS_FUNCTION_{self.name.upper()}"

    def defaults(self) -> dict[str, float]:
        return {key.name: key.default for key in self.config}


CLIP_LOW = ConfigKey("clip_low_threshold", 0.8, Range(0.0, 1.0, low_open=True), "clip_low_threshold")
CLIP_HIGH = ConfigKey("clip_high_threshold", 1.2, Range(1.0, MAX_LOSS_PARAMETER), "clip_high_threshold")
# Tinker's docs give DRO's objective with β from loss_fn_config["beta"] and no default (its engine
# requires it). tinkerrpc's one default is 0.05, which Train has always sent and types.proto documents: a
# gentle quadratic pull towards the sampler (at a logprob drift of 1 the penalty is 0.025 per token,
# small beside advantages of order 1). The step-loss fallback no longer assumes 0.0.
DRO_BETA = ConfigKey("beta", 0.05, Range(0.0, MAX_LOSS_PARAMETER), "beta", tinker_requires=True)
# stable_reinforce's KL weight: Tinker's SDK names the key and default 0; Train does not expose it.
KL_COEFF = ConfigKey("kl_coeff", 0.0, Range(0.0), None)
_POLICY = ("logprobs", "advantages")

LOSSES: tuple[Loss, ...] = (
    Loss("cross_entropy", ("weights",), (), False, "-Σ lp·w", soft_targets=True),
    Loss("importance_sampling", _POLICY, (), True, "-Σ r·A"),
    Loss("ppo", _POLICY, (CLIP_LOW, CLIP_HIGH), True, "-Σ min(r·A, clip(r, low, high)·A)"),
    Loss("cispo", _POLICY, (CLIP_LOW, CLIP_HIGH), True, "-Σ sg(clip(r, low, high))·lp·A"),
    Loss("dro", _POLICY, (DRO_BETA,), True, "-Σ (lp·A - β/2·(lp - q)²)"),
    Loss(
        "stable_reinforce",
        _POLICY,
        (KL_COEFF,),
        True,
        "-Σ (sg(r)·lp·A - kl_coeff·(r - 1 - log r)) (the engine's objective: Tinker does not publish one)",
    ),
    Loss(
        "gspo",
        (*_POLICY, "sequence_ratio_mask"),
        (CLIP_LOW, CLIP_HIGH),
        True,
        "GSPO-token: -Σ min(s·A, clip(s, low, high)·A), s the geometric mean of r over the masked tokens",
    ),
)

LOSS_BY_NAME: Mapping[str, Loss] = {loss.name: loss for loss in LOSSES}
RL_LOSS_NAMES: tuple[str, ...] = tuple(loss.name for loss in LOSSES if loss.rl)
# The loss_fn_config keys Train's LossConfig sets, in table order.
TRAIN_CONFIG_KEYS: tuple[ConfigKey, ...] = tuple(
    {key.name: key for loss in LOSSES for key in loss.config if key.train_field is not None}.values()
)
# What Train uses when a request leaves LossConfig.function unset.
DEFAULT_SUPERVISED_LOSS: LossName = "cross_entropy"
DEFAULT_RL_LOSS: RLLossName = "importance_sampling"


def losses_markdown() -> str:
    """The loss table as Markdown (for the docs)."""
    rows = []
    for loss in LOSSES:
        config = "; ".join(
            f"`{key.name}` ({key.default:g}, {key.range}"
            + (", required by Tinker's API" if key.tinker_requires else "")
            + (")" if key.train_field else "; not settable through Train)")
            for key in loss.config
        )
        trains = "trajectory groups (RL)" if loss.rl else "supervised examples"
        rows.append(
            (
                f"`{loss.name}`",
                f"`{loss.proto_enum}`",
                ", ".join(loss.inputs),
                config or "none",
                trains,
                loss.objective,
            )
        )
    header = ("loss", "proto LossFunction", "loss_fn_inputs besides target_tokens", "config (default, range)")
    return markdown_table((*header, "trains", "objective"), rows)
