"""The advantage-estimator and loss-aggregation tables: the Train options that turn a group's rewards into
advantages and the per-token losses into the step's loss. A row names the option as the SDK does (its
`advantage_estimator` / `loss_aggregation` value; upper-cased, the proto's enum value), what it computes
and what the field calls it. The math is the service's (`tinkerrpc_server.service.datums`).

Aggregation is applied as a weight on each token's advantage, because Tinker's losses are sums over
tokens (the engine's and Tinker's alike): token_mean multiplies every advantage by 1 / (the step's trained
tokens), sequence_mean by 1 / (trajectories × the trajectory's sampled tokens). Every RL loss but DRO is
linear in a positive scale of the advantage (PPO's and GSPO's clipped min and CISPO's clip included), so
the weighted sum is the aggregated loss; DRO's drift term carries no advantage, so DRO trains with
token_sum only. The weight is fixed per trajectory, so turns merged into one datum train as before.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Literal

from tinkerrpc.contract.limits import markdown_table

# The tables' names, for the type checker (tests/foundation/test_contract.py keeps them equal to the rows').
AdvantageEstimatorName = Literal["group_mean", "group_mean_std", "leave_one_out"]
LossAggregationName = Literal["token_sum", "token_mean", "sequence_mean"]


@dataclass(frozen=True)
class AdvantageEstimator:
    """One estimator: `advantage` is trajectory i's advantage from its group's rewards r (n of them,
    mean m, population std s); `known_as` the method it is."""

    name: AdvantageEstimatorName
    advantage: str
    known_as: str

    @property
    def proto_enum(self) -> str:
        """Its `tinkerrpc.v1.AdvantageEstimator` value's name."""
        return f"ADVANTAGE_ESTIMATOR_{self.name.upper()}"


@dataclass(frozen=True)
class LossAggregation:
    """One aggregation: `weight` is what each token's advantage is multiplied by; `loss` the step's loss
    it makes of the per-token losses ℓ."""

    name: LossAggregationName
    weight: str
    loss: str

    @property
    def proto_enum(self) -> str:
        """Its `tinkerrpc.v1.LossAggregation` value's name."""
        return f"LOSS_AGGREGATION_{self.name.upper()}"


ADVANTAGE_ESTIMATORS: tuple[AdvantageEstimator, ...] = (
    AdvantageEstimator("group_mean", "r_i − m", "Dr. GRPO (mean-centred, no std)"),
    AdvantageEstimator("group_mean_std", "(r_i − m) / (s + ADVANTAGE_STD_EPSILON)", "GRPO"),
    AdvantageEstimator(
        "leave_one_out",
        "r_i − (Σ_j r_j − r_i) / (n − 1) = n/(n − 1)·(r_i − m); a group of one trains nothing",
        "RLOO",
    ),
)
LOSS_AGGREGATIONS: tuple[LossAggregation, ...] = (
    LossAggregation("token_sum", "1", "Σ over trained tokens of ℓ (Tinker's own sum)"),
    LossAggregation("token_mean", "1 / T, T the step's trained tokens", "Σ ℓ / T"),
    LossAggregation(
        "sequence_mean",
        "1 / (N·T_i), N the trajectories trained, T_i trajectory i's sampled tokens",
        "(1/N)·Σ_i (Σ over trajectory i's tokens of ℓ) / T_i",
    ),
)

ADVANTAGE_ESTIMATOR_BY_NAME: Mapping[str, AdvantageEstimator] = {e.name: e for e in ADVANTAGE_ESTIMATORS}
LOSS_AGGREGATION_BY_NAME: Mapping[str, LossAggregation] = {a.name: a for a in LOSS_AGGREGATIONS}
# Unset estimator: group_mean_std when AdvantageOptions.normalize_std (its older spelling) is set,
# DEFAULT_ADVANTAGE_ESTIMATOR otherwise, as Train has always computed advantages.
DEFAULT_ADVANTAGE_ESTIMATOR: AdvantageEstimatorName = "group_mean"
NORMALIZE_STD_ESTIMATOR: AdvantageEstimatorName = "group_mean_std"
DEFAULT_LOSS_AGGREGATION: LossAggregationName = "token_sum"
# The one loss whose objective has a term without the advantage (see above).
TOKEN_SUM_ONLY_LOSS = "dro"


def estimators_markdown() -> str:
    """The estimator and aggregation tables as Markdown (for the docs)."""
    estimators = markdown_table(
        ("advantage_estimator", "proto AdvantageEstimator", "advantage of trajectory i", "known as"),
        [
            (
                f"`{e.name}`" + (" (default)" if e.name == DEFAULT_ADVANTAGE_ESTIMATOR else ""),
                f"`{e.proto_enum}`",
                e.advantage,
                e.known_as,
            )
            for e in ADVANTAGE_ESTIMATORS
        ],
    )
    aggregations = markdown_table(
        ("loss_aggregation", "proto LossAggregation", "weight on each token's advantage", "step loss"),
        [
            (
                f"`{a.name}`" + (" (default)" if a.name == DEFAULT_LOSS_AGGREGATION else ""),
                f"`{a.proto_enum}`",
                a.weight,
                a.loss,
            )
            for a in LOSS_AGGREGATIONS
        ],
    )
    return f"{estimators}\n{aggregations}"
