"""The per-token terms of an RL Train: what a KL penalty, on-policy distillation and given per-token
advantages add to each sampled token's advantage, and how truncated importance sampling caps its ratio.
A row names the option as the SDK's `train()` does, its gRPC field, the values it takes and what it does;
the math is the service's (`tinkerrpc_server.service.train_terms`, `train_options`, `mismatch`).

Per sampled token t of a trajectory: q_t is the sampler's logprob, A the trajectory's group advantage,
w the loss aggregation's weight (contract/estimators.py). The advantage the loss sees is
w·(A + a_t + c_kl·(m − d_t) + c_d·(p_t − q_t)), a_t the given per-token advantage, d_t = q_t − ref_t
with ref_t the reference's logprob and m the mean of d over the step's sampled tokens, p_t the teacher's
logprob. Each term reads only the sampler's and the scorer's logprobs, so the datums Train sends are
Tinker's own (advantages per token) and any Tinker backend trains them. A group whose rewards are all
equal has A = 0 and trains when a per-token term is on (it carries that term's signal), instead of being
skipped.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass

from tinkerrpc.contract.limits import (
    DEFAULT_DISTILLATION_COEFFICIENT,
    MAX_ABS_TOKEN_ADVANTAGE,
    MAX_KL_COEFFICIENT,
    TRUNCATED_IS_CLIP_LOW,
    markdown_table,
    number,
)
from tinkerrpc.contract.losses import CLIP_HIGH, Range

# The coefficients' range (KLPenalty.coefficient, Distillation.coefficient).
KL_COEFFICIENT_RANGE = Range(0.0, MAX_KL_COEFFICIENT, low_open=True)
# The cap becomes cispo's clip_high_threshold, so it takes that key's range; below 1 it would damp the
# tokens the learner and sampler agree on.
IMPORTANCE_RATIO_CAP_RANGE = CLIP_HIGH.range
# The losses a cap applies to: importance_sampling trains as cispo, cispo lowers its clip_high to it.
# ppo and gspo clip their ratio already; dro and stable_reinforce regularise the drift themselves.
CAPPABLE_LOSSES = ("importance_sampling", "cispo")


@dataclass(frozen=True)
class TrainTerm:
    """One option: `name` is the SDK's train() keyword (or the SampledTurn field), `grpc` its field,
    `values` what it takes, `per_token` what it does to each sampled token, `reported` where its figure
    is read."""

    name: str
    grpc: str
    values: str
    per_token: str
    reported: str


TRAIN_TERMS: tuple[TrainTerm, ...] = (
    TrainTerm(
        "kl_penalty",
        "TrainRequest.kl_penalty (KLPenalty)",
        f"coefficient c_kl in {KL_COEFFICIENT_RANGE}; reference: a base model, a model's version or a "
        "named checkpoint (PolicyReference; unset: the trained model's base model), same tokenizer; a "
        "version named is pinned against retention while named (version 0 is the base model)",
        "advantage += c_kl·(m − d_t), d_t = q_t − ref_t, m = mean of d over the step's sampled tokens "
        "(tinker-cookbook's incorporate_kl_penalty and ART's Tinker backend, no discount)",
        "TrainMetrics.reference_kl = m (k1 estimate of KL(policy ‖ reference)); the run history",
    ),
    TrainTerm(
        "distillation",
        "TrainRequest.distillation (Distillation)",
        "teacher (PolicyReference, required, same tokenizer; a version pinned as the KL reference's is); "
        f"coefficient c_d in {KL_COEFFICIENT_RANGE}, "
        f"default {number(DEFAULT_DISTILLATION_COEFFICIENT)}",
        "advantage += c_d·(p_t − q_t), the teacher's logprob minus the student's sampled one "
        "(tinker-cookbook's on-policy distillation); rewards may all be equal",
        "TrainMetrics.teacher_kl = mean of q_t − p_t (reverse KL(student ‖ teacher)); the run history",
    ),
    TrainTerm(
        "SampledTurn.advantages",
        "SampledTurn.advantages",
        f"one finite value per completion token, |a_t| <= {number(MAX_ABS_TOKEN_ADVANTAGE)}; empty: none",
        "advantage += a_t (process rewards, a critic's or an outside teacher's advantages)",
        "the step's loss",
    ),
    TrainTerm(
        "importance_ratio_cap",
        "TrainRequest.importance_ratio_cap",
        f"C in {IMPORTANCE_RATIO_CAP_RANGE}; unset: no cap; losses {', '.join(CAPPABLE_LOSSES)} only",
        "gradient weight min(r_t, C) with r_t = exp(lp_t − q_t) (truncated importance sampling): "
        f"importance_sampling trains as cispo with clip [{number(TRUNCATED_IS_CLIP_LOW)}, C], whose "
        "−Σ sg(clip(r))·lp·A has that gradient; cispo's clip_high_threshold becomes min(it, C)",
        "SamplerMismatch.capped_fraction (tokens with r_t > C) and ratio_cap",
    ),
)

TRAIN_TERM_BY_NAME: Mapping[str, TrainTerm] = {term.name: term for term in TRAIN_TERMS}


def train_terms_markdown() -> str:
    """The table as Markdown (for the docs)."""
    return markdown_table(
        ("option", "gRPC field", "values", "per sampled token t", "reported in"),
        [(f"`{t.name}`", f"`{t.grpc}`", t.values, t.per_token, t.reported) for t in TRAIN_TERMS],
    )
