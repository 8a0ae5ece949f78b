"""Every request check of service/validation.py in-process: each malformed field is a field violation
naming it (and only it), size limits are RESOURCE_EXHAUSTED naming the flag, a wrong expected version is
FAILED_PRECONDITION (test_validation_sample.py: Sample's prompts, tool JSON and sampling parameters). The
live bad-input campaign (tests/hardening) sends such requests end to end."""

from __future__ import annotations

import math
from collections.abc import Callable

import grpc
import pytest
from google.rpc import error_details_pb2  # type: ignore[import-untyped]
from validation_support import (
    CONTEXT,
    LIMITS,
    LONG_INTEGER_JSON,
    TOO_MUCH_TEXT,
    UNKNOWN_ROLE,
    VOCAB,
    message,
    violated,
)

from tinkerrpc.contract import limits
from tinkerrpc.contract.limits import MAX_JSON_DEPTH
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service import errors, validation
from tinkerrpc_server.service.errors import ServiceError
from tinkerrpc_server.service.store import ModelRow

pytestmark = pytest.mark.unit

VERSION = 3
# Tool JSON past the JSON depth bound, well within the context's text bound.
TOO_DEEP_JSON = '{"a": ' * MAX_JSON_DEPTH + "[]" + "}" * MAX_JSON_DEPTH


def _rl() -> pb.TrainRequest:
    request = pb.TrainRequest(
        model="m",
        adam=types_pb2.AdamParams(learning_rate=1e-3),
        loss=types_pb2.LossConfig(function=types_pb2.LOSS_FUNCTION_IMPORTANCE_SAMPLING),
    )
    trajectory = request.groups.add().trajectories.add(reward=1.0)
    trajectory.turns.add(
        prompt_token_ids=[1, 2],
        completion_token_ids=[3, 4],
        completion_logprobs=[-0.5, -0.1],
        policy_version=3,
    )
    return request


def _sft() -> pb.TrainRequest:
    request = pb.TrainRequest(model="m", adam=types_pb2.AdamParams(learning_rate=1e-3))
    request.examples.add(messages=[message(types_pb2.ROLE_USER), message(types_pb2.ROLE_ASSISTANT)])
    return request


TRAJECTORY = "groups[0].trajectories[0]"
TURN = f"{TRAJECTORY}.turns[0]"


def _trajectory(request: pb.TrainRequest) -> types_pb2.Trajectory:
    return request.groups[0].trajectories[0]


def _turn(request: pb.TrainRequest) -> types_pb2.SampledTurn:
    return request.groups[0].trajectories[0].turns[0]


LONG_METRIC_NAME = "n" * (limits.MAX_METRIC_NAME_BYTES + 1)


def _spread_metric_names(request: pb.TrainRequest) -> None:
    """Distinct metric names past the per-Train bound, each trajectory within its own."""
    group = request.groups[0]
    per_trajectory = limits.MAX_TRAJECTORY_METRICS
    while len(group.trajectories) * per_trajectory <= limits.MAX_TRAIN_METRIC_NAMES:
        group.trajectories.add().CopyFrom(group.trajectories[0])
    for t, trajectory in enumerate(group.trajectories):
        trajectory.metrics.update({f"t{t}m{i}": 1.0 for i in range(per_trajectory)})


def _extend(values: object, *items: object) -> None:
    values.extend(items)  # type: ignore[attr-defined]


TRAIN_CASES: list[tuple[str, Callable[[], pb.TrainRequest], Callable[[pb.TrainRequest], object], list[str]]] = [
    ("empty batch", _rl, lambda r: r.ClearField("groups"), ["groups"]),
    ("groups and examples", _rl, lambda r: r.examples.add().CopyFrom(_sft().examples[0]), ["groups", "loss.function"]),
    ("no learning rate", _rl, lambda r: r.adam.ClearField("learning_rate"), ["adam.learning_rate"]),
    ("learning rate too high", _rl, lambda r: setattr(r.adam, "learning_rate", 11), ["adam.learning_rate"]),
    ("learning rate nan", _rl, lambda r: setattr(r.adam, "learning_rate", float("nan")), ["adam.learning_rate"]),
    ("beta1 of 1", _rl, lambda r: setattr(r.adam, "beta1", 1.0), ["adam.beta1"]),
    ("beta2 negative", _rl, lambda r: setattr(r.adam, "beta2", -0.1), ["adam.beta2"]),
    ("eps 0", _rl, lambda r: setattr(r.adam, "eps", 0.0), ["adam.eps"]),
    ("weight decay over 1", _rl, lambda r: setattr(r.adam, "weight_decay", 2.0), ["adam.weight_decay"]),
    ("grad clip negative", _rl, lambda r: setattr(r.adam, "grad_clip_norm", -1.0), ["adam.grad_clip_norm"]),
    ("unknown loss", _rl, lambda r: setattr(r.loss, "function", 99), ["loss.function"]),
    ("examples with ppo", _sft, lambda r: setattr(r.loss, "function", types_pb2.LOSS_FUNCTION_PPO), ["loss.function"]),
    (
        "groups with cross-entropy", _rl,
        lambda r: setattr(r.loss, "function", types_pb2.LOSS_FUNCTION_CROSS_ENTROPY), ["loss.function"],
    ),
    ("clip low 0", _rl, lambda r: setattr(r.loss, "clip_low_threshold", 0.0), ["loss.clip_low_threshold"]),
    ("clip high under 1", _rl, lambda r: setattr(r.loss, "clip_high_threshold", 0.5), ["loss.clip_high_threshold"]),
    ("beta too large", _rl, lambda r: setattr(r.loss, "beta", 1e4), ["loss.beta"]),
    ("negative max staleness", _rl, lambda r: setattr(r, "max_staleness", -1), ["max_staleness"]),
    ("strict without max", _rl, lambda r: setattr(r, "strict_staleness", True), ["strict_staleness"]),
    ("negative expected version", _rl, lambda r: setattr(r, "expected_policy_version", -1), ["expected_policy_version"]),
    ("empty group", _rl, lambda r: r.groups.add(), ["groups[1].trajectories"]),
    ("infinite reward", _rl, lambda r: setattr(_trajectory(r), "reward", float("inf")), [f"{TRAJECTORY}.reward"]),
    ("reward too large", _rl, lambda r: setattr(_trajectory(r), "reward", 1e7), [f"{TRAJECTORY}.reward"]),
    (
        "nan metric", _rl, lambda r: _trajectory(r).metrics.__setitem__("score", float("nan")),
        [f"{TRAJECTORY}.metrics[score]"],
    ),
    (
        "idempotency key too long", _rl, lambda r: setattr(r, "idempotency_key", "k" * (limits.MAX_IDEMPOTENCY_KEY_BYTES + 1)),
        ["idempotency_key"],
    ),
    (
        "idempotency key too long in UTF-8", _sft, lambda r: setattr(r, "idempotency_key", "\u20ac" * 86),
        ["idempotency_key"],
    ),
    (
        "too many metrics", _rl,
        lambda r: _trajectory(r).metrics.update({f"m{i}": 1.0 for i in range(limits.MAX_TRAJECTORY_METRICS + 1)}),
        [f"{TRAJECTORY}.metrics"],
    ),
    (
        "metric name too long", _rl, lambda r: _trajectory(r).metrics.__setitem__(LONG_METRIC_NAME, 1.0),
        [f"{TRAJECTORY}.metrics[{errors.shown(LONG_METRIC_NAME)}]"],
    ),
    ("infinite metric", _rl, lambda r: _trajectory(r).metrics.__setitem__("score", -float("inf")), [f"{TRAJECTORY}.metrics[score]"]),
    ("too many metric names over the batch", _rl, _spread_metric_names, ["groups"]),
    ("no turns", _rl, lambda r: _trajectory(r).ClearField("turns"), [f"{TRAJECTORY}.turns"]),
    (
        "empty completion", _rl, lambda r: _turn(r).ClearField("completion_token_ids"),
        [f"{TURN}.completion_token_ids", f"{TURN}.completion_logprobs"],
    ),
    ("logprob count", _rl, lambda r: _extend(_turn(r).completion_logprobs, -1.0), [f"{TURN}.completion_logprobs"]),
    ("positive logprob", _rl, lambda r: _turn(r).completion_logprobs.__setitem__(0, 0.5), [f"{TURN}.completion_logprobs"]),
    ("logprob too low", _rl, lambda r: _turn(r).completion_logprobs.__setitem__(0, -1e5), [f"{TURN}.completion_logprobs"]),
    ("nan logprob", _rl, lambda r: _turn(r).completion_logprobs.__setitem__(1, math.nan), [f"{TURN}.completion_logprobs"]),
    ("infinite logprob", _rl, lambda r: _turn(r).completion_logprobs.__setitem__(1, -math.inf), [f"{TURN}.completion_logprobs"]),
    ("nan advantage", _rl, lambda r: _extend(_turn(r).advantages, 0.5, math.nan), [f"{TURN}.advantages"]),
    ("advantage too large", _rl, lambda r: _extend(_turn(r).advantages, -1e9, 0.5), [f"{TURN}.advantages"]),
    (
        "completion token outside the vocabulary", _rl, lambda r: _turn(r).completion_token_ids.__setitem__(0, VOCAB),
        [f"{TURN}.completion_token_ids"],
    ),
    (
        "negative prompt token", _rl, lambda r: _turn(r).prompt_token_ids.__setitem__(1, -1),
        [f"{TURN}.prompt_token_ids"],
    ),
    (
        "no prompt and no assistant message", _rl, lambda r: _turn(r).ClearField("prompt_token_ids"),
        [f"{TURN}.prompt_token_ids"],
    ),
    ("future policy version", _rl, lambda r: setattr(_turn(r), "policy_version", VERSION + 1), [f"{TURN}.policy_version"]),
    ("negative policy version", _rl, lambda r: setattr(_turn(r), "policy_version", -1), [f"{TURN}.policy_version"]),
    (
        "unknown role", _rl, lambda r: _trajectory(r).messages.add(role=UNKNOWN_ROLE, content="x"),
        [f"{TRAJECTORY}.messages[0].role"],
    ),
    (
        "tool call arguments not an object", _rl,
        lambda r: _trajectory(r).messages.add(role=types_pb2.ROLE_ASSISTANT).tool_calls.add(arguments_json="[1]"),
        [f"{TRAJECTORY}.messages[0].tool_calls[0].arguments_json"],
    ),
    (
        "tool without a name", _rl, lambda r: _trajectory(r).tools.add(parameters_json="{}"),
        [f"{TRAJECTORY}.tools[0].name"],
    ),
    (
        "tool parameters not JSON", _rl, lambda r: _trajectory(r).tools.add(name="f", parameters_json="{"),
        [f"{TRAJECTORY}.tools[0].parameters_json"],
    ),
    (
        "tool parameters with an integer past the number bound", _rl,
        lambda r: _trajectory(r).tools.add(name="f", parameters_json=LONG_INTEGER_JSON),
        [f"{TRAJECTORY}.tools[0].parameters_json"],
    ),
    (
        "tool parameters with NaN", _rl, lambda r: _trajectory(r).tools.add(name="f", parameters_json='{"a": NaN}'),
        [f"{TRAJECTORY}.tools[0].parameters_json"],
    ),
    (
        "tool parameters nested past the depth bound", _rl,
        lambda r: _trajectory(r).tools.add(name="f", parameters_json=TOO_DEEP_JSON),
        [f"{TRAJECTORY}.tools[0].parameters_json"],
    ),
    (
        "tool call arguments with an integer past the number bound", _rl,
        lambda r: _trajectory(r).messages.add(role=types_pb2.ROLE_ASSISTANT).tool_calls.add(
            arguments_json=LONG_INTEGER_JSON
        ),
        [f"{TRAJECTORY}.messages[0].tool_calls[0].arguments_json"],
    ),
    (
        "trajectory text over the context", _rl,
        lambda r: _trajectory(r).messages.add(role=types_pb2.ROLE_USER, content=TOO_MUCH_TEXT),
        [f"{TRAJECTORY}.messages"],
    ),
    (
        "example text over the context", _sft, lambda r: setattr(r.examples[0].messages[0], "content", TOO_MUCH_TEXT),
        ["examples[0].messages"],
    ),
    ("example without assistant", _sft, lambda r: r.examples[0].messages.pop(), ["examples[0].messages"]),
    ("unknown train_on", _sft, lambda r: setattr(r.examples[0], "train_on", 99), ["examples[0].train_on"]),
    ("example role", _sft, lambda r: setattr(r.examples[0].messages[0], "role", 99), ["examples[0].messages[0].role"]),
    (
        "example tool call arguments with Infinity", _sft,
        lambda r: r.examples[0].messages[1].tool_calls.add(name="f", arguments_json='{"a": -Infinity}'),
        ["examples[0].messages[1].tool_calls[0].arguments_json"],
    ),
    (
        "example tool parameters with a float past the number bound", _sft,
        lambda r: r.examples[0].tools.add(name="f", parameters_json='{"a": 1.' + "5" * 200 + "}"),
        ["examples[0].tools[0].parameters_json"],
    ),
    ("example tool", _sft, lambda r: r.examples[0].tools.add(parameters_json="1"), [
        "examples[0].tools[0].name", "examples[0].tools[0].parameters_json",
    ]),
    ("minibatches of RL groups", _rl, lambda r: setattr(r, "minibatch_size", 1), ["minibatch_size"]),
    ("minibatch size 0", _sft, lambda r: setattr(r, "minibatch_size", 0), ["minibatch_size"]),
    ("negative minibatch size", _sft, lambda r: setattr(r, "minibatch_size", -3), ["minibatch_size"]),
    ("minibatch rates without a size", _sft, lambda r: r.minibatch_learning_rates.append(1e-3), [
        "minibatch_learning_rates",
    ]),
    ("a rate per example, not per minibatch", _sft,
     lambda r: (r.examples.append(r.examples[0]), setattr(r, "minibatch_size", 2), _extend(r.minibatch_learning_rates, 1e-3, 1e-3)),
     ["minibatch_learning_rates"]),
    ("minibatch rates out of range", _sft,
     lambda r: (r.examples.append(r.examples[0]), setattr(r, "minibatch_size", 1), _extend(r.minibatch_learning_rates, 0.0, math.inf)),
     ["minibatch_learning_rates[0]", "minibatch_learning_rates[1]"]),
    ("a wrong count of bad rates is one violation, however many", _sft,
     lambda r: (setattr(r, "minibatch_size", 1), _extend(r.minibatch_learning_rates, *[math.nan] * 1000)),
     ["minibatch_learning_rates"]),
    ("a minibatch rate past the bound", _sft,
     lambda r: (setattr(r, "minibatch_size", 5), r.minibatch_learning_rates.append(limits.MAX_LEARNING_RATE * 2)),
     ["minibatch_learning_rates[0]"]),
]  # fmt: skip


@pytest.mark.parametrize(
    ("base", "mutate", "fields"), [c[1:] for c in TRAIN_CASES], ids=[c[0] for c in TRAIN_CASES]
)
def test_train_request_violations(
    base: Callable[[], pb.TrainRequest], mutate: Callable[[pb.TrainRequest], object], fields: list[str]
) -> None:
    validation.check_train_request(base(), VERSION, VOCAB, CONTEXT)  # the unchanged request is valid
    request = base()
    mutate(request)
    assert violated(lambda: validation.check_train_request(request, VERSION, VOCAB, CONTEXT)) == fields


def test_stored_fields_at_their_bounds_pass() -> None:
    request = _rl()
    request.idempotency_key = "k" * limits.MAX_IDEMPOTENCY_KEY_BYTES
    _trajectory(request).metrics.update(
        {
            f"{i:03d}".ljust(limits.MAX_METRIC_NAME_BYTES, "x"): float(i)
            for i in range(limits.MAX_TRAJECTORY_METRICS)
        }
    )
    validation.check_train_request(request, VERSION, VOCAB, CONTEXT)


def test_every_violation_of_a_request_is_reported_at_once() -> None:
    request = _rl()
    request.adam.learning_rate = 0
    _turn(request).policy_version = 9
    request.groups.add()
    assert violated(lambda: validation.check_train_request(request, VERSION, VOCAB, CONTEXT)) == [
        "adam.learning_rate",
        f"{TURN}.policy_version",
        "groups[1].trajectories",
    ]


def _create(**fields: object) -> pb.CreateModelRequest:
    request = pb.CreateModelRequest(name="m", base_model="tinkerrpc/tiny-chat")
    for name, value in fields.items():
        target = request.lora if name == "rank" or name in validation.LORA_MODULE_FLAGS else request
        setattr(target, name, value)
    return request


@pytest.mark.parametrize(
    ("request_", "fields"),
    [
        (_create(name=""), ["name"]),
        (_create(name="-starts-with-a-dash"), ["name"]),
        (_create(name="has/slash"), ["name"]),
        (_create(name="x" * 65), ["name"]),
        (_create(base_model=""), ["base_model"]),
        (_create(rank=-1), ["lora.rank"]),
        (_create(rank=limits.MAX_LORA_RANK + 1), ["lora.rank"]),
        (_create(rank=2**31 - 1), ["lora.rank"]),
        (_create(train_mlp=False, train_attn=False, train_unembed=False), ["lora"]),
        (_create(keep_sampler_versions=0), ["keep_sampler_versions"]),
        (_create(keep_state_checkpoints=0), ["keep_state_checkpoints"]),
        (_create(name="", base_model="", rank=-2), ["name", "base_model", "lora.rank"]),
    ],
)
def test_create_model_violations(request_: pb.CreateModelRequest, fields: list[str]) -> None:
    assert violated(lambda: validation.check_create_model(request_)) == fields


def test_valid_create_model_and_checkpoint_names_pass() -> None:
    validation.check_create_model(_create(name="a.b_c-1", rank=4, keep_sampler_versions=1))
    validation.check_checkpoint_name("")  # the automatic name
    validation.check_checkpoint_name("mark-1")
    validation.check_checkpoint_kind(types_pb2.CHECKPOINT_KIND_STATE)
    validation.check_checkpoint_kind(types_pb2.CHECKPOINT_KIND_SAMPLER)


def test_lora_modules_and_rank_within_bounds_pass() -> None:
    validation.check_create_model(_create(rank=limits.MAX_LORA_RANK, train_mlp=False, train_attn=False))
    validation.check_create_model(_create(train_mlp=False, train_attn=False, train_unembed=True))
    validation.check_lora_rank(64, "tinkerrpc/tiny-chat", 64)
    validation.check_lora_rank(limits.MAX_LORA_RANK, "remote/model", None)  # width unknown: the cap applies
    validation.check_lora_rank(limits.MAX_LORA_RANK, "wide/model", 4096)


@pytest.mark.parametrize(
    ("rank", "hidden_size", "maximum"), [(65, 64, 64), (limits.MAX_LORA_RANK + 1, 4096, limits.MAX_LORA_RANK)]
)
def test_lora_rank_over_the_base_models_maximum_states_it(rank: int, hidden_size: int, maximum: int) -> None:
    assert violated(lambda: validation.check_lora_rank(rank, "org/base", hidden_size)) == ["lora.rank"]
    with pytest.raises(ServiceError) as err:
        validation.check_lora_rank(rank, "org/base", hidden_size)
    stated = (
        f"lora.rank: {rank} is over the maximum of {maximum} for 'org/base' (its hidden size {hidden_size}"
    )
    assert stated in err.value.message


def test_checkpoint_name_and_kind_violations() -> None:
    assert violated(lambda: validation.check_checkpoint_name("../escape")) == ["name"]
    assert violated(lambda: validation.check_checkpoint_kind(0)) == ["kind"]


def test_export_history_and_watch_violations() -> None:
    export = pb.ExportWeightsRequest(model="m", expected_policy_version=-1, policy_version=-1)
    assert violated(lambda: validation.check_export_request(export)) == [
        "expected_policy_version",
        "policy_version",
    ]
    history = pb.GetRunHistoryRequest
    assert violated(lambda: validation.check_history_request(history(model="m", from_version=-1))) == [
        "from_version"
    ]
    assert violated(
        lambda: validation.check_history_request(history(model="m", from_version=5, to_version=4))
    ) == ["to_version"]
    assert violated(lambda: validation.check_history_request(history(model="m", page_size=1001))) == [
        "page_size"
    ]
    assert violated(lambda: validation.check_history_request(history(model="m", page_token="abc"))) == [
        "page_token"
    ]
    assert violated(
        lambda: validation.check_history_request(history(model="m", from_version=7, page_token="7"))
    ) == ["page_token"]
    assert validation.check_history_request(history(model="m", from_version=2, page_token="9")) == 9
    assert validation.check_history_request(history(model="m")) == 0
    watch = pb.WatchModelRequest(model="m", from_version=-1)
    assert violated(lambda: validation.check_watch_request(watch)) == ["from_version"]


def test_size_limits_are_resource_exhausted_naming_the_flag() -> None:
    request = _rl()
    request.groups[0].trajectories.add().CopyFrom(request.groups[0].trajectories[0])
    validation.check_train_size(request, LIMITS)
    request.groups[0].trajectories.add().CopyFrom(request.groups[0].trajectories[0])
    checks: list[tuple[Callable[[], None], str]] = [
        (lambda: validation.check_train_size(request, LIMITS), "--max-train-trajectories"),
        (lambda: validation.check_train_tokens(LIMITS.max_train_tokens + 1, LIMITS), "--max-train-tokens"),
    ]
    for check, flag in checks:
        with pytest.raises(ServiceError) as err:
            check()
        assert err.value.code == grpc.StatusCode.RESOURCE_EXHAUSTED
        (quota,) = err.value.details
        assert isinstance(quota, error_details_pb2.QuotaFailure)
        assert [v.subject for v in quota.violations] == [flag]
    validation.check_train_tokens(LIMITS.max_train_tokens, LIMITS)


def test_an_unexpected_version_is_failed_precondition() -> None:
    row = ModelRow(
        "m", "b", 1, True, True, True, "r", 0, VOCAB, CONTEXT, 0.0, "run", VERSION, VERSION, "tinker://s"
    )
    validation.check_expected_version(row, pb.TrainRequest(model="m"))
    validation.check_expected_version(row, pb.TrainRequest(model="m", expected_policy_version=VERSION))
    with pytest.raises(ServiceError) as err:
        validation.check_expected_version(row, pb.ExportWeightsRequest(model="m", expected_policy_version=1))
    assert err.value.code == grpc.StatusCode.FAILED_PRECONDITION
    (info,) = err.value.details
    assert isinstance(info, error_details_pb2.ErrorInfo)
    assert info.reason == "VERSION_MISMATCH"
    assert dict(info.metadata) == {"current_version": str(VERSION), "expected_version": "1"}
