"""Every layer's defaults and bounds are the contract's (tinkerrpc.contract): the loss table against the
proto enum, the SDK, the service's Train, the engine's torch losses and the service's numpy fallback;
the fixed bounds, defaults and constants against the service's validation, advantages, watch backlog and
sample cache, the SDK's checks and GetServerInfo (test_contract_sidecar.py: the sidecar's request models
and the sampling-options table). A layer that kept a value of its own fails here once the two differ
(test_contract_sources.py checks the source text: no value defined twice)."""

from __future__ import annotations

import inspect
import math
import re
from types import SimpleNamespace
from typing import Any, get_args

import numpy as np
import pytest
import tinker

import tinkerrpc
from tinkerrpc import _calls as calls
from tinkerrpc import _convert as convert
from tinkerrpc.contract import estimators, limits
from tinkerrpc.contract.losses import LOSSES, TRAIN_CONFIG_KEYS, LossName, RLLossName
from tinkerrpc.v1 import trainer_service_pb2 as service_pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.bounded_json import BoundedJsonError, parse_json_object
from tinkerrpc_server.engine import losses as engine_losses
from tinkerrpc_server.service import servicer, step_loss, train_options, validation
from tinkerrpc_server.service.datums import group_advantages
from tinkerrpc_server.service.errors import ServiceError, Violations
from tinkerrpc_server.service.events import Subscription
from tinkerrpc_server.service.limits import Limits, add_limit_arguments
from tinkerrpc_server.service.sample_cache import SampleCache

pytestmark = pytest.mark.unit

RL = [loss for loss in LOSSES if loss.rl]


# ---------------------------------------------------------------- the loss table


def test_every_proto_loss_has_one_row_and_every_row_a_proto_value() -> None:
    proto = set(types_pb2.LossFunction.keys()) - {"LOSS_FUNCTION_UNSPECIFIED"}
    assert sorted(loss.proto_enum for loss in LOSSES) == sorted(proto)


def test_the_type_checkers_names_are_the_tables() -> None:
    assert get_args(LossName) == tuple(loss.name for loss in LOSSES)
    assert get_args(RLLossName) == tuple(loss.name for loss in RL)
    assert set(get_args(LossName)) <= set(get_args(tinker.types.LossFnType))


def test_every_loss_has_its_math_in_torch_and_numpy() -> None:
    names = [loss.name for loss in LOSSES]
    assert sorted(engine_losses.LOSS_FUNCTIONS) == sorted(names)
    assert sorted(step_loss.LOSS_OF_DATUM) == sorted(names)
    assert {name: spec.float_inputs for name, spec in engine_losses.LOSSES.items()} == {
        loss.name: loss.inputs for loss in LOSSES
    }


def test_the_sdk_sends_each_loss_as_its_proto_value() -> None:
    assert {loss.name: types_pb2.LossFunction.Value(loss.proto_enum) for loss in LOSSES} == convert.LOSS_TO_PB
    assert inspect.signature(calls.train).parameters["loss"].default == "importance_sampling"


def _train_request(loss_enum: int, *, examples: bool = False, **config: float) -> service_pb.TrainRequest:
    request = service_pb.TrainRequest(loss=types_pb2.LossConfig(function=loss_enum, **config))  # type: ignore[arg-type]
    if examples:
        request.examples.add()
    else:
        request.groups.add()
    return request


@pytest.mark.parametrize("loss", LOSSES, ids=lambda loss: loss.name)
def test_train_sends_the_tables_defaults_and_what_the_request_sets(loss: Any) -> None:
    enum = types_pb2.LossFunction.Value(loss.proto_enum)
    request = _train_request(enum, examples=not loss.rl)
    assert train_options.loss_name(request) == loss.name
    set_by_train = {key.name: key.default for key in loss.config if key.train_field}
    assert train_options.loss_config(request) == (set_by_train or None)
    chosen = {key.train_field: (key.range.low or 0) + 0.5 for key in loss.config if key.train_field}
    assert train_options.loss_config(_train_request(enum, **chosen)) == (
        {key.name: chosen[key.train_field] for key in loss.config if key.train_field} or None
    )


def test_train_picks_the_default_loss_for_groups_and_examples() -> None:
    unset = types_pb2.LOSS_FUNCTION_UNSPECIFIED
    assert train_options.loss_name(_train_request(unset)) == "importance_sampling"
    assert train_options.loss_name(_train_request(unset, examples=True)) == "cross_entropy"


def test_every_loss_config_field_is_a_table_key() -> None:
    fields = {f.name for f in types_pb2.LossConfig.DESCRIPTOR.fields} - {"function", "aggregation"}
    assert sorted(key.train_field for key in TRAIN_CONFIG_KEYS if key.train_field) == sorted(fields)


def _just_outside(key: Any) -> list[float]:
    rng = key.range
    outside = [math.nan, math.inf]
    if rng.low is not None:
        outside.append(rng.low if rng.low_open else rng.low - 1e-9)
    if rng.high is not None:
        outside.append(rng.high if rng.high_open else rng.high * (1 + 1e-9) + 1e-9)
    return outside


@pytest.mark.parametrize("key", TRAIN_CONFIG_KEYS, ids=lambda key: key.name)
def test_train_validation_takes_exactly_the_tables_range(key: Any) -> None:
    assert key.default in key.range
    for bad in _just_outside(key):
        violations = Violations()
        train_options.check_loss(
            violations, _train_request(types_pb2.LOSS_FUNCTION_PPO, **{key.train_field: bad})
        )
        with pytest.raises(ServiceError) as refused:
            violations.raise_if_any()
        assert f"loss.{key.train_field}" in str(refused.value.details)
    for good in (key.default, key.range.low, key.range.high):
        if good is not None and good in key.range:
            violations = Violations()
            train_options.check_loss(
                violations, _train_request(types_pb2.LOSS_FUNCTION_PPO, **{key.train_field: good})
            )
            violations.raise_if_any()


@pytest.mark.parametrize("loss", LOSSES, ids=lambda loss: loss.name)
def test_the_engine_fills_the_tables_defaults_and_refuses_outside_its_ranges(loss: Any) -> None:
    required = {key.name: key.default for key in loss.config if key.tinker_requires}
    if required:
        with pytest.raises(ValueError, match="needs loss_fn_config"):
            engine_losses.resolve_config(loss.name, {})
    assert engine_losses.resolve_config(loss.name, required) == loss.defaults()
    for key in loss.config:
        for bad in _just_outside(key):
            with pytest.raises(ValueError):
                engine_losses.resolve_config(loss.name, {**required, key.name: bad})


def _datums(loss: Any) -> tuple[list[tinker.types.Datum], list[dict[str, tinker.types.TensorData]]]:
    rng = np.random.default_rng(7)
    length = 6
    learner = -rng.uniform(0.1, 2.0, length)
    values = {
        "target_tokens": np.arange(length, dtype=np.float64),
        "weights": np.ones(length),
        "logprobs": learner + rng.normal(0, 0.5, length),
        "advantages": rng.normal(0, 1, length),
        "sequence_ratio_mask": np.r_[0.0, np.ones(length - 1)],
    }
    used = ("target_tokens", *loss.inputs)
    datum = tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints(list(range(length))),
        loss_fn_inputs={
            k: tinker.types.TensorData(data=v.tolist(), dtype="float32", shape=[length])
            for k, v in values.items()
            if k in used
        },
    )
    output = {"logprobs": tinker.types.TensorData(data=learner.tolist(), dtype="float32", shape=[length])}
    return [datum], [output]


@pytest.mark.parametrize("loss", [loss for loss in LOSSES if loss.config], ids=lambda loss: loss.name)
def test_the_numpy_fallback_fills_the_tables_defaults(loss: Any) -> None:
    datums, outputs = _datums(loss)
    with_defaults = step_loss.loss_from_logprobs(loss.name, loss.defaults(), datums, outputs)
    assert step_loss.loss_from_logprobs(loss.name, None, datums, outputs) == with_defaults
    other = {key.name: key.default + 0.1 for key in loss.config}
    assert step_loss.loss_from_logprobs(loss.name, other, datums, outputs) != pytest.approx(with_defaults)


# ---------------------------------------------------------------- estimators and aggregations


def test_every_proto_estimator_and_aggregation_has_one_row_and_a_type_checker_name() -> None:
    for rows, enum, names in (
        (estimators.ADVANTAGE_ESTIMATORS, types_pb2.AdvantageEstimator, estimators.AdvantageEstimatorName),
        (estimators.LOSS_AGGREGATIONS, types_pb2.LossAggregation, estimators.LossAggregationName),
    ):
        proto = {name for name in enum.keys() if not name.endswith("_UNSPECIFIED")}  # noqa: SIM118
        assert sorted(row.proto_enum for row in rows) == sorted(proto)
        assert get_args(names) == tuple(row.name for row in rows)


def _one_group() -> list[tinkerrpc.TrajectoryGroup]:
    turn = tinkerrpc.SampledTurn((1, 2), (3,), (-0.5,), 0)
    return [tinkerrpc.TrajectoryGroup([tinkerrpc.Trajectory(turns=[turn], reward=r) for r in (0.0, 1.0)])]


def test_the_sdk_sends_each_estimator_and_aggregation_and_the_tables_defaults() -> None:
    assert {
        e.name: types_pb2.AdvantageEstimator.Value(e.proto_enum) for e in estimators.ADVANTAGE_ESTIMATORS
    } == convert.ESTIMATOR_TO_PB
    assert {
        a.name: types_pb2.LossAggregation.Value(a.proto_enum) for a in estimators.LOSS_AGGREGATIONS
    } == convert.AGGREGATION_TO_PB
    parameters = inspect.signature(calls.train).parameters
    # None: the server's defaults, the table's.
    assert parameters["loss_aggregation"].default is None
    assert parameters["advantage_estimator"].default is None
    for name in convert.ESTIMATOR_TO_PB:
        request = calls.train("m", _one_group(), advantage_estimator=name).request  # type: ignore[arg-type]
        assert train_options.advantage_estimator(request) == name
    for name in convert.AGGREGATION_TO_PB:
        request = calls.train("m", _one_group(), loss_aggregation=name).request  # type: ignore[arg-type]
        assert train_options.loss_aggregation(request) == name
    with pytest.raises(ValueError, match="advantage_estimator"):
        calls.train("m", _one_group(), advantage_estimator="grpo")  # type: ignore[arg-type]
    with pytest.raises(ValueError, match="loss_aggregation"):
        calls.train("m", _one_group(), loss_aggregation="mean")  # type: ignore[arg-type]


def test_train_uses_the_tables_default_estimator_and_aggregation() -> None:
    request = _train_request(types_pb2.LOSS_FUNCTION_IMPORTANCE_SAMPLING)
    assert train_options.advantage_estimator(request) == estimators.DEFAULT_ADVANTAGE_ESTIMATOR
    assert train_options.loss_aggregation(request) == estimators.DEFAULT_LOSS_AGGREGATION
    request.advantages.normalize_std = True
    assert train_options.advantage_estimator(request) == estimators.NORMALIZE_STD_ESTIMATOR
    # Every loss but the token_sum-only one is linear in a positive scale of its advantages.
    assert estimators.TOKEN_SUM_ONLY_LOSS in {loss.name for loss in RL}


# ---------------------------------------------------------------- fixed bounds


def test_every_bound_and_default_has_a_row_and_each_row_its_constants_value() -> None:
    wire = {"MAX_INT32", "MIN_INT64", "MAX_INT64"}
    named = {n for n in vars(limits) if re.fullmatch(r"(SIDECAR_)?(MAX|MIN|DEFAULT)_[A-Z0-9_]+", n)} - wire
    rows = [row.name for row in limits.LIMITS]
    assert len(rows) == len(set(rows))
    # Every MAX_/MIN_/DEFAULT_ constant has a row; the rows beyond them are the named constants.
    constants = sorted(row.name for row in limits.LIMITS if row.kind == "constant")
    assert "ADVANTAGE_STD_EPSILON" in constants
    assert sorted(named.symmetric_difference(rows)) == constants
    kinds = {"MAX": "at most", "MIN": "at least", "DEFAULT": "default"}
    for row in limits.LIMITS:
        assert row.kind == kinds.get(row.name.removeprefix("SIDECAR_").split("_")[0], "constant"), row.name
        assert getattr(limits, row.name) == row.value


def test_the_services_advantages_watch_backlog_and_sample_cache_are_the_contracts() -> None:
    # rewards 0 and 1: centred -0.5 and 0.5, population std 0.5.
    scale = 0.5 + limits.ADVANTAGE_STD_EPSILON
    assert group_advantages([0.0, 1.0], "group_mean_std") == [-0.5 / scale, 0.5 / scale]
    subscription = Subscription()
    event = service_pb.WatchModelResponse()
    for _ in range(limits.MAX_WATCH_BACKLOG_EVENTS):
        subscription.offer(event)
    assert (len(subscription.pending), subscription.overflowed) == (limits.MAX_WATCH_BACKLOG_EVENTS, False)
    subscription.offer(event)
    assert (len(subscription.pending), subscription.overflowed) == (limits.MAX_WATCH_BACKLOG_EVENTS, True)
    cache = inspect.signature(SampleCache).parameters
    assert (cache["ttl_seconds"].default, cache["max_entries"].default, cache["max_bytes"].default) == (
        limits.MAX_SAMPLE_KEY_AGE_SECONDS,
        limits.MAX_CACHED_SAMPLES,
        limits.MAX_SAMPLE_CACHE_BYTES,
    )


def test_tinkers_adam_defaults_are_the_contracts() -> None:
    fields = tinker.types.AdamParams.model_fields
    assert [fields[name].default for name in ("learning_rate", "beta1", "beta2", "eps")] == [
        limits.DEFAULT_LEARNING_RATE,
        limits.DEFAULT_ADAM_BETA1,
        limits.DEFAULT_ADAM_BETA2,
        limits.DEFAULT_ADAM_EPS,
    ]
    for train in (calls.train, calls.train_supervised):
        assert inspect.signature(train).parameters["learning_rate"].default == limits.DEFAULT_LEARNING_RATE


def _sampling(**fields: Any) -> types_pb2.SamplingParams:
    return types_pb2.SamplingParams(max_tokens=4, **fields)


def _refused(check: Any, *args: Any) -> str:
    """The fields `check(*args)` refuses ("" when it takes them)."""
    try:
        check(*args)
    except ServiceError as error:
        return str(error.details)
    return ""


# (field, a value at the bound, a value past it) for check_sampling_params.
SAMPLING_BOUNDS = [
    (
        "top_logprobs",
        {"top_logprobs": limits.MAX_TOP_LOGPROBS},
        {"top_logprobs": limits.MAX_TOP_LOGPROBS + 1},
    ),
    (
        "prompt_top_logprobs",
        {"prompt_top_logprobs": limits.MAX_TOP_LOGPROBS},
        {"prompt_top_logprobs": limits.MAX_TOP_LOGPROBS + 1},
    ),
    ("stop", {"stop": ["x"] * limits.MAX_STOP_STRINGS}, {"stop": ["x"] * (limits.MAX_STOP_STRINGS + 1)}),
    (
        "stop",
        {"stop": ["x" * limits.MAX_STOP_STRING_BYTES]},
        {"stop": ["x" * (limits.MAX_STOP_STRING_BYTES + 1)]},
    ),
    (
        "stop_token_ids",
        {"stop_token_ids": [0] * limits.MAX_STOP_TOKEN_IDS},
        {"stop_token_ids": [0] * (limits.MAX_STOP_TOKEN_IDS + 1)},
    ),
    ("temperature", {"temperature": limits.MAX_TEMPERATURE}, {"temperature": limits.MAX_TEMPERATURE * 1.01}),
    ("temperature", {"temperature": limits.MIN_TEMPERATURE}, {"temperature": limits.MIN_TEMPERATURE / 2}),
]


@pytest.mark.parametrize(("field", "at", "past"), SAMPLING_BOUNDS)
def test_sample_validation_bounds_are_the_contracts(
    field: str, at: dict[str, Any], past: dict[str, Any]
) -> None:
    context = (1, 1000, 4096, Limits())
    assert _refused(validation.check_sampling_params, _sampling(**at), *context) == ""
    assert f"params.{field}" in _refused(validation.check_sampling_params, _sampling(**past), *context)


def _adam_request(**adam: float) -> service_pb.TrainRequest:
    request = _train_request(types_pb2.LOSS_FUNCTION_IMPORTANCE_SAMPLING)
    request.adam.CopyFrom(types_pb2.AdamParams(**{"learning_rate": 1e-4, **adam}))  # type: ignore[arg-type]
    return request


TRAIN_BOUNDS = [
    (
        "adam.learning_rate",
        {"learning_rate": limits.MAX_LEARNING_RATE},
        {"learning_rate": limits.MAX_LEARNING_RATE * 1.01},
    ),
    ("adam.eps", {"eps": limits.MIN_ADAM_EPS}, {"eps": limits.MIN_ADAM_EPS / 2}),
    (
        "adam.weight_decay",
        {"weight_decay": limits.MAX_WEIGHT_DECAY},
        {"weight_decay": limits.MAX_WEIGHT_DECAY * 1.01},
    ),
]


@pytest.mark.parametrize(("field", "at", "past"), TRAIN_BOUNDS)
def test_train_validation_bounds_are_the_contracts(
    field: str, at: dict[str, float], past: dict[str, float]
) -> None:
    def check(request: service_pb.TrainRequest) -> None:
        violations = Violations()
        train_options.check_adam(violations, request.adam)
        violations.raise_if_any()

    assert _refused(check, _adam_request(**at)) == ""
    assert field in _refused(check, _adam_request(**past))


def test_stored_and_named_bounds_are_the_contracts() -> None:
    def create(name: str, rank: int) -> None:
        validation.check_create_model(
            service_pb.CreateModelRequest(name=name, base_model="m", lora=types_pb2.LoraConfig(rank=rank))
        )

    assert _refused(create, "n" * limits.MAX_NAME_CHARS, limits.MAX_LORA_RANK) == ""
    assert "name" in _refused(create, "n" * (limits.MAX_NAME_CHARS + 1), 1)
    assert "lora.rank" in _refused(create, "n", limits.MAX_LORA_RANK + 1)
    pages = [
        service_pb.GetRunHistoryRequest(page_size=size) for size in (0, limits.MAX_HISTORY_PAGE_SIZE + 1)
    ]
    assert _refused(validation.check_history_request, pages[0]) == ""
    assert "page_size" in _refused(validation.check_history_request, pages[1])
    rank = inspect.signature(tinker.ServiceClient.create_lora_training_client).parameters["rank"]
    assert rank.default == limits.DEFAULT_LORA_RANK


def test_the_json_bounds_are_the_contracts() -> None:
    nested = "[" * (limits.MAX_JSON_DEPTH - 1) + "]" * (limits.MAX_JSON_DEPTH - 1)
    assert parse_json_object('{"a": ' + nested + "}") == {
        "a": parse_json_object('{"b": ' + nested + "}")["b"]
    }
    with pytest.raises(BoundedJsonError):
        parse_json_object('{"a": [' + nested + "]}")
    with pytest.raises(BoundedJsonError):
        parse_json_object('{"a": 1' + "0" * limits.MAX_JSON_NUMBER_CHARS + "}")


def test_the_sdk_checks_the_contracts_bounds() -> None:
    calls.history("m", page_size=limits.MAX_HISTORY_PAGE_SIZE)
    with pytest.raises(ValueError, match="page_size"):
        calls.history("m", page_size=limits.MAX_HISTORY_PAGE_SIZE + 1)
    assert inspect.signature(calls.create_model).parameters["lora_rank"].default == limits.DEFAULT_LORA_RANK


def test_the_servers_limits_and_flags_are_the_contracts() -> None:
    defaults = {flag.attribute: flag.default for flag in limits.SERVER_FLAGS}
    assert vars(Limits()) == defaults
    import argparse

    parser = argparse.ArgumentParser()
    add_limit_arguments(parser)
    parsed = vars(parser.parse_args([]))
    assert {attribute: parsed[attribute] for attribute in defaults} == defaults
    info = servicer._server_info(
        SimpleNamespace(embedded=True),  # type: ignore[arg-type]
        Limits(),
        SimpleNamespace(sidecar_url=None, sidecar_requires_api_key=False, max_message_bytes=1),  # type: ignore[arg-type]
    )
    assert (info.limits.max_top_logprobs, info.limits.max_stop_strings) == (
        limits.MAX_TOP_LOGPROBS,
        limits.MAX_STOP_STRINGS,
    )
    assert (info.limits.max_stop_string_bytes, info.limits.max_stop_token_ids) == (
        limits.MAX_STOP_STRING_BYTES,
        limits.MAX_STOP_TOKEN_IDS,
    )
    assert info.limits.max_sample_n == defaults["max_sample_n"]
