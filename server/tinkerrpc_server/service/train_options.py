"""A Train request's loss, advantage and optimizer options: their checks, and what they become for Tinker
(the loss name, its loss_fn_config, the advantage estimator and loss aggregation, the AdamParams). The
losses, their config keys' defaults and ranges, the estimators, the aggregations and the bounds are the
contract's (`tinkerrpc.contract`)."""

from __future__ import annotations

import math

import tinker
from tinker.types import LossFnType

from tinkerrpc.contract.estimators import (
    ADVANTAGE_ESTIMATORS,
    DEFAULT_ADVANTAGE_ESTIMATOR,
    DEFAULT_LOSS_AGGREGATION,
    LOSS_AGGREGATIONS,
    NORMALIZE_STD_ESTIMATOR,
    TOKEN_SUM_ONLY_LOSS,
    AdvantageEstimatorName,
    LossAggregationName,
)
from tinkerrpc.contract.limits import (
    MAX_LEARNING_RATE,
    MAX_WEIGHT_DECAY,
    MIN_ADAM_EPS,
    TRUNCATED_IS_CLIP_LOW,
)
from tinkerrpc.contract.losses import (
    DEFAULT_RL_LOSS,
    DEFAULT_SUPERVISED_LOSS,
    LOSS_BY_NAME,
    LOSSES,
    RL_LOSS_NAMES,
    TRAIN_CONFIG_KEYS,
    Loss,
)
from tinkerrpc.contract.train_terms import CAPPABLE_LOSSES, IMPORTANCE_RATIO_CAP_RANGE, KL_COEFFICIENT_RANGE
from tinkerrpc.v1 import trainer_service_pb2, types_pb2
from tinkerrpc_server.service.errors import Violations

_LOSS_BY_ENUM = {types_pb2.LossFunction.Value(loss.proto_enum): loss for loss in LOSSES}
_ESTIMATOR_BY_ENUM: dict[int, AdvantageEstimatorName] = {
    types_pb2.AdvantageEstimator.Value(e.proto_enum): e.name for e in ADVANTAGE_ESTIMATORS
}
_AGGREGATION_BY_ENUM: dict[int, LossAggregationName] = {
    types_pb2.LossAggregation.Value(a.proto_enum): a.name for a in LOSS_AGGREGATIONS
}


def train_loss(request: trainer_service_pb2.TrainRequest) -> Loss:
    """The loss of a validated request (unset: cross-entropy for examples, importance sampling for groups)."""
    if request.loss.function == types_pb2.LOSS_FUNCTION_UNSPECIFIED:
        return LOSS_BY_NAME[DEFAULT_SUPERVISED_LOSS if request.examples else DEFAULT_RL_LOSS]
    return _LOSS_BY_ENUM[request.loss.function]


def _truncates_importance_sampling(request: trainer_service_pb2.TrainRequest) -> bool:
    return request.HasField("importance_ratio_cap") and train_loss(request).name == "importance_sampling"


def loss_name(request: trainer_service_pb2.TrainRequest) -> LossFnType:
    """The loss Tinker runs: the request's, but cispo for importance_sampling with a ratio cap (cispo's
    −Σ sg(clip(r))·lp·A has truncated importance sampling's gradient min(r, cap)·A·∇lp)."""
    return "cispo" if _truncates_importance_sampling(request) else train_loss(request).name


def loss_config(request: trainer_service_pb2.TrainRequest) -> dict[str, float] | None:
    """The loss_fn_config a validated request sends: each key of its loss that Train sets, as given or its
    default; a key only the engine's Tinker API takes is left to the backend, whose default is the same.
    A ratio cap is cispo's clip_high_threshold (at most the one given)."""
    if _truncates_importance_sampling(request):
        return {
            "clip_low_threshold": TRUNCATED_IS_CLIP_LOW,
            "clip_high_threshold": request.importance_ratio_cap,
        }
    given = {field.name: value for field, value in request.loss.ListFields()}
    config = {
        key.name: float(given.get(key.train_field, key.default))
        for key in train_loss(request).config
        if key.train_field is not None
    }
    if request.HasField("importance_ratio_cap"):
        config["clip_high_threshold"] = min(config["clip_high_threshold"], request.importance_ratio_cap)
    return config or None


def advantage_estimator(request: trainer_service_pb2.TrainRequest) -> AdvantageEstimatorName:
    """The estimator of a validated request; unset: normalize_std's (its older spelling) or the default."""
    estimator = request.advantages.estimator
    if estimator == types_pb2.ADVANTAGE_ESTIMATOR_UNSPECIFIED:
        return NORMALIZE_STD_ESTIMATOR if request.advantages.normalize_std else DEFAULT_ADVANTAGE_ESTIMATOR
    return _ESTIMATOR_BY_ENUM[estimator]


def loss_aggregation(request: trainer_service_pb2.TrainRequest) -> LossAggregationName:
    """The loss aggregation of a validated request (unset: the default)."""
    aggregation = request.loss.aggregation
    if aggregation == types_pb2.LOSS_AGGREGATION_UNSPECIFIED:
        return DEFAULT_LOSS_AGGREGATION
    return _AGGREGATION_BY_ENUM[aggregation]


def check_advantages(v: Violations, request: trainer_service_pb2.TrainRequest) -> None:
    """The estimator and aggregation options: known values, a consistent normalize_std, and RL only."""
    options = request.advantages
    if options.estimator not in types_pb2.AdvantageEstimator.values():
        v.add("advantages.estimator", f"unknown advantage estimator {options.estimator}")
    elif options.normalize_std and options.estimator not in (
        types_pb2.ADVANTAGE_ESTIMATOR_UNSPECIFIED,
        types_pb2.AdvantageEstimator.Value(f"ADVANTAGE_ESTIMATOR_{NORMALIZE_STD_ESTIMATOR.upper()}"),
    ):
        v.add(
            "advantages.normalize_std",
            f"normalize_std is the {NORMALIZE_STD_ESTIMATOR} estimator: leave it unset with another estimator",
        )
    aggregation = request.loss.aggregation
    if aggregation not in types_pb2.LossAggregation.values():
        v.add("loss.aggregation", f"unknown loss aggregation {aggregation}")
    elif aggregation not in (types_pb2.LOSS_AGGREGATION_UNSPECIFIED, types_pb2.LOSS_AGGREGATION_TOKEN_SUM):
        if request.examples:
            v.add("loss.aggregation", "supervised examples train with token_sum (their weights) only")
        elif request.loss.function in _LOSS_BY_ENUM and train_loss(request).name == TOKEN_SUM_ONLY_LOSS:
            v.add(
                "loss.aggregation",
                f"{TOKEN_SUM_ONLY_LOSS} trains with token_sum only (its drift term carries no advantage)",
            )
    if request.examples and options.estimator:
        v.add("advantages.estimator", "supervised examples have no advantages")


def check_loss(v: Violations, request: trainer_service_pb2.TrainRequest) -> None:
    function = request.loss.function
    if function not in types_pb2.LossFunction.values():
        v.add("loss.function", f"unknown loss function {function}")
        return
    loss = train_loss(request)
    if request.examples and loss.rl:
        v.add("loss.function", "supervised examples train with cross-entropy only")
    if request.groups and not loss.rl:
        v.add("loss.function", f"trajectory groups need a policy-gradient loss ({', '.join(RL_LOSS_NAMES)})")
    given = {field.name: value for field, value in request.loss.ListFields()}
    for key in TRAIN_CONFIG_KEYS:
        assert key.train_field is not None
        if key.train_field in given and given[key.train_field] not in key.range:
            v.add(f"loss.{key.train_field}", f"must be a finite number {key.range.rule()}")


def check_train_terms(v: Violations, request: trainer_service_pb2.TrainRequest) -> None:
    """The KL penalty, distillation and ratio cap: RL only, coefficients and the cap in the contract's
    ranges, every reference naming a policy (whether it exists is known once the model's row is read)."""
    if request.examples:
        for name in ("kl_penalty", "distillation", "importance_ratio_cap"):
            if request.HasField(name):
                v.add(name, "supervised examples have no sampled tokens: an RL option")
    if request.HasField("kl_penalty"):
        penalty = request.kl_penalty
        if penalty.coefficient not in KL_COEFFICIENT_RANGE:
            v.add(
                "kl_penalty.coefficient",
                f"must be a finite number {KL_COEFFICIENT_RANGE.rule()} (it is required), got {penalty.coefficient}",
            )
        if penalty.HasField("reference"):
            _check_reference(v, "kl_penalty.reference", penalty.reference)
    if request.HasField("distillation"):
        distillation = request.distillation
        if not distillation.HasField("teacher"):
            v.add("distillation.teacher", "required: the policy that scores the sampled tokens")
        else:
            _check_reference(v, "distillation.teacher", distillation.teacher)
        if distillation.HasField("coefficient") and distillation.coefficient not in KL_COEFFICIENT_RANGE:
            v.add(
                "distillation.coefficient",
                f"must be a finite number {KL_COEFFICIENT_RANGE.rule()}, got {distillation.coefficient}",
            )
    if request.HasField("importance_ratio_cap"):
        cap = request.importance_ratio_cap
        if cap not in IMPORTANCE_RATIO_CAP_RANGE:
            v.add(
                "importance_ratio_cap",
                f"must be a finite number {IMPORTANCE_RATIO_CAP_RANGE.rule()}, got {cap}",
            )
        if request.loss.function in _LOSS_BY_ENUM and train_loss(request).name not in CAPPABLE_LOSSES:
            v.add(
                "importance_ratio_cap",
                f"applies to {' and '.join(CAPPABLE_LOSSES)} only ({train_loss(request).name} has its own clip "
                "or drift term)",
            )


def _check_reference(v: Violations, field: str, reference: types_pb2.PolicyReference) -> None:
    kind = reference.WhichOneof("policy")
    if kind is None:
        v.add(field, "give base_model, version or checkpoint")
    elif kind == "base_model" and not reference.base_model:
        v.add(f"{field}.base_model", "must not be empty")
    elif kind == "version" and reference.version.policy_version < 0:
        v.add(f"{field}.version.policy_version", f"must be >= 0, got {reference.version.policy_version}")
    elif kind == "checkpoint" and not reference.checkpoint.name:
        v.add(f"{field}.checkpoint.name", "must not be empty")


def learning_rate_problem(rate: float) -> str | None:
    if math.isfinite(rate) and 0 < rate <= MAX_LEARNING_RATE:
        return None
    return f"must be a finite number in (0, {MAX_LEARNING_RATE:g}], got {rate}"


def check_adam(v: Violations, adam: types_pb2.AdamParams) -> None:
    problem = learning_rate_problem(adam.learning_rate)
    if problem is not None:
        v.add("adam.learning_rate", f"{problem} (it is required)")
    for name in ("beta1", "beta2"):
        if adam.HasField(name):
            value = getattr(adam, name)
            if not (math.isfinite(value) and 0 <= value < 1):
                v.add(f"adam.{name}", f"must be in [0, 1), got {value}")
    if adam.HasField("eps") and not (math.isfinite(adam.eps) and adam.eps >= MIN_ADAM_EPS):
        v.add("adam.eps", f"must be a finite number >= {MIN_ADAM_EPS:g}, got {adam.eps}")
    if not (math.isfinite(adam.weight_decay) and 0 <= adam.weight_decay <= MAX_WEIGHT_DECAY):
        v.add(
            "adam.weight_decay",
            f"must be a finite number in [0, {MAX_WEIGHT_DECAY:g}], got {adam.weight_decay}",
        )
    if not (math.isfinite(adam.grad_clip_norm) and adam.grad_clip_norm >= 0):
        v.add("adam.grad_clip_norm", "must be a finite number >= 0 (0 disables clipping)")


def adam_params(adam: types_pb2.AdamParams) -> tinker.types.AdamParams:
    """Unset optional fields keep Tinker's own defaults (the contract's DEFAULT_ADAM_*)."""
    optional = {name: getattr(adam, name) for name in ("beta1", "beta2", "eps") if adam.HasField(name)}
    return tinker.types.AdamParams(
        learning_rate=adam.learning_rate,
        weight_decay=adam.weight_decay,
        grad_clip_norm=adam.grad_clip_norm,
        **optional,
    )
