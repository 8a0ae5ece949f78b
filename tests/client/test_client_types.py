"""Dataclasses <-> protobuf, trajectories built from samples and from sidecar chat completions, error decoding."""

from __future__ import annotations

import inspect
import math
from datetime import datetime, timezone
from typing import Any

import grpc
import pytest
import server_side_convert as server_side
from google.protobuf import any_pb2
from google.rpc import error_details_pb2, status_pb2
from openai.types.chat import ChatCompletion

import tinkerrpc
from tinkerrpc import _calls as calls
from tinkerrpc import _convert as convert
from tinkerrpc._errors import STATUS_DETAILS_KEY, decode_details, error_from_status
from tinkerrpc.v1 import trainer_service_pb2 as service_pb
from tinkerrpc.v1 import types_pb2 as pb
from tinkerrpc_server.service import errors as service_errors

pytestmark = pytest.mark.unit

WHEN = datetime(2025, 5, 17, 12, 30, 15, 250000, tzinfo=timezone.utc)
WEATHER_TOOL = tinkerrpc.Tool(
    name="get_weather",
    description="Current weather in a city",
    parameters={"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
)
CALL = tinkerrpc.ToolCall(id="call_1", name="get_weather", arguments='{"city": "Paris"}')


def full_trajectory() -> tinkerrpc.Trajectory:
    return tinkerrpc.Trajectory(
        messages=[
            tinkerrpc.Message.system("be brief"),
            tinkerrpc.Message.user("weather in Paris?"),
            tinkerrpc.Message.assistant("", [CALL]),
            tinkerrpc.Message.tool('{"temp": 21}', tool_call_id="call_1", name="get_weather"),
            tinkerrpc.Message.assistant("21 degrees"),
        ],
        turns=[
            tinkerrpc.SampledTurn((1, 2, 3), (4, 5), (-0.5, -0.25), 3),
            tinkerrpc.SampledTurn((1, 2, 3, 4, 5, 6), (7,), (-1.5,), 4),
        ],
        reward=0.75,
        metrics={"turns": 2.0},
        metadata={"task": "weather-17"},
        tools=[WEATHER_TOOL],
    )


def test_trajectory_round_trips_through_protobuf_bytes() -> None:
    traj = full_trajectory()
    wire = convert.trajectory_to_proto(traj).SerializeToString()
    back = server_side.trajectory_from_proto(pb.Trajectory.FromString(wire))
    assert back == traj
    assert back.messages[2].tool_calls[0].parsed_arguments() == {"city": "Paris"}
    group = tinkerrpc.TrajectoryGroup([traj, full_trajectory()])
    assert server_side.group_from_proto(convert.group_to_proto(group)) == group


def test_every_other_dataclass_round_trips() -> None:
    example = tinkerrpc.SupervisedExample(full_trajectory().messages, tools=(WEATHER_TOOL,), train_on="last")
    assert server_side.example_from_proto(convert.example_to_proto(example)) == example

    checkpoint = tinkerrpc.CheckpointInfo(
        model="run",
        name="step_000004",
        policy_version=4,
        kind="sampler",
        tinker_path="tinker://x",
        create_time=WHEN,
    )
    assert convert.checkpoint_from_proto(server_side.checkpoint_to_proto(checkpoint)) == checkpoint

    info = tinkerrpc.ModelInfo(
        name="run",
        base_model="tinkerrpc/tiny-chat",
        policy_version=7,
        lora_rank=8,
        train_mlp=False,
        renderer="role_colon",
        sampleable_versions=(5, 6, 7),
        create_time=WHEN,
        seed=3,
        tinker_run_id="s:train:0",
        vocab_size=471,
        max_context_length=512,
    )
    assert convert.model_info_from_proto(server_side.model_info_to_proto(info)) == info

    result = tinkerrpc.TrainResult(
        policy_version=5,
        metrics=tinkerrpc.TrainMetrics(
            loss=1.5,
            mean_reward=0.5,
            trained_tokens=10,
            staleness_histogram={0: 3, 1: 1},
            extra={"env/turns": 2.0},
        ),
        sampler_checkpoint=checkpoint,
        state_checkpoint=None,
        replayed=True,
    )
    assert convert.train_result_from_proto(server_side.train_result_to_proto(result)) == result

    sample = tinkerrpc.Sample(
        tokens=(4, 5),
        logprobs=(-0.5, -0.25),
        text="hi",
        message=tinkerrpc.Message.assistant("hi"),
        stop_reason="length",
        policy_version=2,
        prompt_token_ids=(1, 2, 3),
        top_logprobs=((tinkerrpc.TopLogprob(4, -0.5, "h"), tinkerrpc.TopLogprob(9, -1.0, "x")),) * 2,
        token_texts=("h", "i"),
        prompt_logprobs=(math.nan, -1.0, -2.0),
    )
    response = service_pb.SampleResponse(
        sequences=[server_side.sample_to_proto(sample)],
        prompt_token_ids=sample.prompt_token_ids,
        prompt_logprobs=sample.prompt_logprobs,
        policy_version=2,
    )
    [back] = convert.samples_from_proto(service_pb.SampleResponse.FromString(response.SerializeToString()))
    assert back.prompt_logprobs[1:] == sample.prompt_logprobs[1:] and math.isnan(back.prompt_logprobs[0])
    assert back.tokens == sample.tokens and back.top_logprobs == sample.top_logprobs
    assert (back.message, back.stop_reason, back.token_texts) == (
        sample.message,
        "length",
        sample.token_texts,
    )


def test_unset_proto_fields_map_to_documented_defaults() -> None:
    info = convert.model_info_from_proto(pb.ModelInfo(name="m", lora=pb.LoraConfig(rank=4)))
    assert (info.train_mlp, info.train_attn, info.train_unembed, info.create_time) == (True, True, True, None)
    assert server_side.example_from_proto(pb.SupervisedExample()).train_on == "all"
    with pytest.raises(ValueError, match="role"):
        convert.message_from_proto(pb.Message(content="no role"))


def test_messages_convert_to_and_from_openai_dicts() -> None:
    message = tinkerrpc.Message.assistant("", [CALL])
    as_dict = message.to_openai()
    assert as_dict["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}
    assert tinkerrpc.Message.from_openai(as_dict) == message
    assert tinkerrpc.Tool.from_openai(WEATHER_TOOL.to_openai()) == WEATHER_TOOL
    with pytest.raises(ValueError, match="role"):
        tinkerrpc.Message("robot", "hi")  # type: ignore[arg-type]


def make_sample(version: int, tokens: tuple[int, ...] = (40, 41), text: str = "maybe") -> tinkerrpc.Sample:
    return tinkerrpc.Sample(
        tokens=tokens,
        logprobs=tuple(-0.1 * (i + 1) for i in range(len(tokens))),
        text=text,
        message=tinkerrpc.Message.assistant(text),
        stop_reason="stop",
        policy_version=version,
        prompt_token_ids=(1, 2, 3),
    )


def test_trajectory_from_samples_across_turns() -> None:
    prompt = [{"role": "user", "content": "yes or no?"}]
    traj = tinkerrpc.Trajectory.from_sample(prompt, make_sample(3), reward=1.0)
    assert [m.role for m in traj.messages] == ["user", "assistant"]
    assert traj.messages[1].content == "maybe"
    assert traj.turns == [tinkerrpc.SampledTurn((1, 2, 3), (40, 41), (-0.1, -0.2), 3)]

    traj.add_messages(tinkerrpc.Message.user("are you sure?")).add_sample(make_sample(5, (42,), "yes"))
    assert [m.role for m in traj.messages] == ["user", "assistant", "user", "assistant"]
    assert len(traj.turns) == 2
    assert (traj.min_policy_version, traj.max_policy_version) == (3, 5)
    assert tinkerrpc.Trajectory().min_policy_version is None


def sidecar_completion(
    content: str | None, token_ids: list[int], version: int, tool_calls: list[dict[str, Any]] | None = None
) -> ChatCompletion:
    """A ChatCompletion exactly as the openai client parses the sidecar's JSON (extensions kept as extras)."""
    return ChatCompletion.model_validate(
        {
            "id": "chatcmpl-1",
            "object": "chat.completion",
            "created": 1,
            "model": "run",
            "prompt_token_ids": [1, 2, 3, 4],
            "choices": [
                {
                    "index": 0,
                    "finish_reason": "tool_calls" if tool_calls else "stop",
                    "message": {"role": "assistant", "content": content, "tool_calls": tool_calls},
                    "token_ids": token_ids,
                    "policy_version": version,
                    "logprobs": {
                        "content": [
                            {"token": str(t), "logprob": -0.5 * (i + 1), "bytes": None, "top_logprobs": []}
                            for i, t in enumerate(token_ids)
                        ]
                    },
                }
            ],
        }
    )


def test_multi_turn_tool_conversation_from_openai_is_one_trajectory() -> None:
    call = {
        "id": "call_1",
        "type": "function",
        "function": {"name": "get_weather", "arguments": '{"city": "Paris"}'},
    }
    messages = [{"role": "user", "content": "weather in Paris?"}]
    first = sidecar_completion(None, [10, 11, 12], 2, [call])
    traj = tinkerrpc.Trajectory.from_openai(messages, first, reward=0.0, tools=[WEATHER_TOOL.to_openai()])
    traj.add_messages({"role": "tool", "content": '{"temp": 21}', "tool_call_id": "call_1"})
    traj.add_openai(sidecar_completion("21 degrees", [13, 14], 3).model_dump())  # the dict form works too
    traj.reward = 1.0

    assert [m.role for m in traj.messages] == ["user", "assistant", "tool", "assistant"]
    assert traj.messages[1].tool_calls == (CALL,)
    assert traj.messages[3].content == "21 degrees"
    assert traj.turns[0] == tinkerrpc.SampledTurn((1, 2, 3, 4), (10, 11, 12), (-0.5, -1.0, -1.5), 2)
    assert traj.turns[1].completion_token_ids == (13, 14) and traj.turns[1].policy_version == 3
    assert traj.tools == [WEATHER_TOOL]
    calls.train("run", [[traj]])  # trainable as built


def test_openai_completion_without_rl_extensions_is_refused() -> None:
    plain = sidecar_completion("hi", [5], 1).model_dump()
    del plain["choices"][0]["token_ids"]
    with pytest.raises(ValueError, match="token_ids"):
        tinkerrpc.Trajectory.from_openai([], plain)
    no_logprobs = sidecar_completion("hi", [5], 1).model_dump()
    no_logprobs["choices"][0]["logprobs"] = None
    with pytest.raises(ValueError, match="logprobs=True"):
        tinkerrpc.Trajectory.from_openai([], no_logprobs)
    with pytest.raises(ValueError, match="choice_index 1"):
        tinkerrpc.Trajectory.from_openai([], sidecar_completion("hi", [5], 1), choice_index=1)


@pytest.mark.parametrize("holder", ["choice", "message"])
def test_rl_fields_litellm_moved_into_provider_specific_fields_are_found(holder: str) -> None:
    """litellm keeps non-standard choice fields in `provider_specific_fields`, on the choice or on its
    message; from_openai reads them there as if they were in place."""
    completion = sidecar_completion("hi", [5, 6], 4).model_dump()
    choice = completion["choices"][0]
    moved = {name: choice.pop(name) for name in ("token_ids", "policy_version")}
    choice["token_ids"] = None  # litellm's Choices may keep the name, unset
    target = choice if holder == "choice" else choice["message"]
    target["provider_specific_fields"] = {**moved, "sample_key": "nonce.mac"}
    traj = tinkerrpc.Trajectory.from_openai([], completion)
    assert traj.turns == [tinkerrpc.SampledTurn((1, 2, 3, 4), (5, 6), (-0.5, -1.0), 4, "nonce.mac")]
    assert traj.messages[0].content == "hi"


def test_a_choice_without_logprobs_trains_by_its_sample_key() -> None:
    keyed = sidecar_completion("hi", [5, 6], 1).model_dump()
    keyed["choices"][0]["logprobs"] = None
    keyed["choices"][0]["sample_key"] = "nonce.mac"
    traj = tinkerrpc.Trajectory.from_openai([], keyed, reward=1.0)
    assert traj.turns == [tinkerrpc.SampledTurn((1, 2, 3, 4), (5, 6), (), 1, "nonce.mac")]
    turn = calls.train("run", [[traj]]).request.groups[0].trajectories[0].turns[0]
    assert turn.sample_key == "nonce.mac" and not turn.completion_logprobs

    sample = tinkerrpc.Sample(
        (40,), (-0.1,), "x", None, "stop", 3, (1,), sample_key="k.m"
    )  # from a Sample response: the key travels with the logprobs
    assert tinkerrpc.Trajectory.from_sample([], sample).turns[0].sample_key == "k.m"
    response = service_pb.SampleResponse(
        sequences=[pb.SampledSequence(token_ids=[40], logprobs=[-0.1], sample_key="k.m")]
    )
    assert convert.samples_from_proto(response)[0].sample_key == "k.m"
    assert convert.metrics_from_proto(pb.TrainMetrics(scored_tokens=7)).scored_tokens == 7


def test_sampler_mismatch_is_read_when_set_and_none_for_a_supervised_step() -> None:
    figures = {"kl": 0.02, "mean_ratio": 1.01, "max_ratio": 2.5, "outside_fraction": 0.125, "tokens": 8}
    reported = pb.TrainMetrics(sampler_mismatch=pb.SamplerMismatch(**figures))
    wire = pb.TrainMetrics.FromString(reported.SerializeToString())
    assert convert.metrics_from_proto(wire).sampler_mismatch == tinkerrpc.SamplerMismatch(**figures)
    assert convert.metrics_from_proto(pb.TrainMetrics(trained_tokens=8)).sampler_mismatch is None


def test_train_request_carries_a_fresh_idempotency_key_and_all_options() -> None:
    group = [tinkerrpc.Trajectory.from_sample([], make_sample(1), reward=1.0)]
    options: dict[str, Any] = {"loss": "ppo", "clip_low_threshold": 0.7, "max_staleness": 2}
    first = calls.train("run", [group], **options).request
    second = calls.train("run", [group], **options).request
    assert first.idempotency_key and first.idempotency_key != second.idempotency_key
    assert first.loss.function == pb.LOSS_FUNCTION_PPO and first.loss.clip_low_threshold == 0.7
    assert not first.loss.HasField("clip_high_threshold")
    assert first.max_staleness == 2 and first.adam.learning_rate == 1e-4
    assert calls.train("run", [group], **options, idempotency_key="k1").request.idempotency_key == "k1"


@pytest.mark.parametrize(
    ("change", "message"),
    [
        ({"learning_rate": 0.0}, "learning_rate"),
        ({"loss": "hinge"}, "loss must be one of"),
        ({"loss": "cross_entropy"}, "train_supervised"),
        ({"strict_staleness": True}, "needs max_staleness"),
        ({"max_staleness": -1}, "max_staleness"),
    ],
)
def test_bad_train_options_are_refused(change: dict[str, Any], message: str) -> None:
    group = [tinkerrpc.Trajectory.from_sample([], make_sample(1), reward=1.0)]
    with pytest.raises(ValueError, match=message):
        calls.train("run", [group], **change)


def test_sample_request_picks_the_prompt_kind() -> None:
    options: dict[str, Any] = dict(n=2, max_tokens=8, temperature=0.5, stop=["\n"], seed=7, policy_version=3)
    chat = calls.sample("run", [tinkerrpc.Message.user("hi")], **options, tools=[WEATHER_TOOL]).request
    assert chat.WhichOneof("prompt") == "chat" and chat.chat.tools[0].name == "get_weather"
    assert chat.params.seed == 7 and chat.policy_version == 3 and not chat.params.HasField("top_p")
    assert calls.sample("run", [5, 6], **options).request.tokens.token_ids == [5, 6]
    assert calls.sample("run", "once upon", **options).request.text == "once upon"
    with pytest.raises(ValueError, match="empty"):
        calls.sample("run", [], **options)
    with pytest.raises(TypeError, match="got int"):
        calls.sample("run", [tinkerrpc.Message.user("hi"), 5], **options)
    with pytest.raises(ValueError, match="max_tokens"):
        calls.sample("run", "x", **{**options, "max_tokens": 0})


@pytest.mark.parametrize(
    "method",
    [
        "sample",
        "train",
        "train_supervised",
        "save_checkpoint",
        "checkpoints",
        "restore",
        "delete_checkpoint",
        "export_weights",
    ],
)
def test_sync_and_async_handles_document_the_same_signature(method: str) -> None:
    blocking, awaitable = getattr(tinkerrpc.Model, method), getattr(tinkerrpc.AsyncModel, method)
    signature = inspect.signature(blocking)
    assert signature == inspect.signature(awaitable)
    assert next(iter(signature.parameters)) == "self" and "timeout" in signature.parameters
    assert not signature.return_annotation.startswith(("Call", "StreamCall"))
    assert blocking.__doc__ and blocking.__doc__ == awaitable.__doc__
    assert blocking.__qualname__ == f"Model.{method}" and awaitable.__qualname__ == f"AsyncModel.{method}"
    assert inspect.iscoroutinefunction(awaitable) and not inspect.iscoroutinefunction(blocking)


@pytest.mark.parametrize(
    "method",
    ["create_model", "get_model", "list_models", "delete_model", "server_info", "wait_until_serving"],
)
def test_sync_and_async_clients_document_the_same_signature(method: str) -> None:
    blocking, awaitable = getattr(tinkerrpc.Client, method), getattr(tinkerrpc.AsyncClient, method)
    signature, async_signature = inspect.signature(blocking), inspect.signature(awaitable)
    assert signature.parameters == async_signature.parameters
    assert next(iter(signature.parameters)) == "self"
    assert blocking.__doc__ and blocking.__doc__ == awaitable.__doc__
    assert blocking.__qualname__ == f"Client.{method}" and awaitable.__qualname__ == f"AsyncClient.{method}"
    assert inspect.iscoroutinefunction(awaitable) and not inspect.iscoroutinefunction(blocking)


def test_client_methods_return_their_own_handles_and_streams() -> None:
    assert inspect.signature(tinkerrpc.Client.create_model).return_annotation == "Model"
    assert inspect.signature(tinkerrpc.AsyncClient.create_model).return_annotation == "AsyncModel"
    assert inspect.signature(tinkerrpc.Model.watch).return_annotation == "EventStream[ModelEvent]"
    assert inspect.signature(tinkerrpc.AsyncModel.watch).return_annotation == "AsyncEventStream[ModelEvent]"
    assert not inspect.iscoroutinefunction(tinkerrpc.AsyncModel.watch)
    assert inspect.iscoroutinefunction(tinkerrpc.AsyncModel.openai_client)


def test_handle_signatures_keep_their_defaults_and_return_types() -> None:
    sample = inspect.signature(tinkerrpc.Model.sample)
    assert sample.parameters["max_tokens"].default == 256 and sample.return_annotation == "list[Sample]"
    train = inspect.signature(tinkerrpc.AsyncModel.train)
    assert (
        train.parameters["loss"].default == "importance_sampling" and train.return_annotation == "TrainResult"
    )


def test_error_details_decode_from_a_real_status() -> None:
    status = status_pb2.Status(code=grpc.StatusCode.FAILED_PRECONDITION.value[0], message="too stale")
    status.details.add().Pack(
        error_details_pb2.ErrorInfo(
            reason="STALE_POLICY_VERSION", metadata={"current_version": "9", "sampled_version": "4"}
        )
    )
    status.details.add().Pack(error_details_pb2.DebugInfo(detail="trace"))
    status.details.add().Pack(pb.Tool(name="not a google.rpc type"))
    details = decode_details(status.SerializeToString())
    error = error_from_status(grpc.StatusCode.FAILED_PRECONDITION, "too stale", details)
    assert isinstance(error, tinkerrpc.StalePolicyError)
    assert isinstance(error, tinkerrpc.FailedPreconditionError)
    assert (error.current_version, error.sampled_version) == (9, 4)
    assert isinstance(error.details[1], error_details_pb2.DebugInfo)
    assert isinstance(error.details[2], any_pb2.Any) and error.details[2].TypeName() == "tinkerrpc.v1.Tool"
    assert decode_details(b"\xff\xff not a status") == []

    bad = status_pb2.Status()
    bad.details.add().Pack(
        error_details_pb2.BadRequest(
            field_violations=[
                error_details_pb2.BadRequest.FieldViolation(field="groups[0]", description="empty")
            ]
        )
    )
    invalid = error_from_status(
        grpc.StatusCode.INVALID_ARGUMENT, "bad", decode_details(bad.SerializeToString())
    )
    assert isinstance(invalid, tinkerrpc.InvalidArgumentError)
    assert invalid.field_violations == [("groups[0]", "empty")]
    plain = error_from_status(grpc.StatusCode.FAILED_PRECONDITION, "other", [])
    assert type(plain) is tinkerrpc.FailedPreconditionError
    assert type(error_from_status(grpc.StatusCode.INTERNAL, "boom", [])) is tinkerrpc.RPCError


# The wire strings clients saw before ErrorReason existed; they must never change.
WIRE_REASONS = {
    "STALE_POLICY_VERSION": service_errors.STALE_POLICY_VERSION,
    "VERSION_MISMATCH": service_errors.VERSION_MISMATCH,
    "NO_CURRENT_STATE": service_errors.NO_CURRENT_STATE,
    "IDEMPOTENCY_KEY_REUSED": service_errors.IDEMPOTENCY_KEY_REUSED,
    "NOTHING_TO_TRAIN": service_errors.NOTHING_TO_TRAIN,
    "CURRENT_SAMPLER_CHECKPOINT": service_errors.CURRENT_SAMPLER_CHECKPOINT,
    "RECOVERY_CHECKPOINT": service_errors.RECOVERY_CHECKPOINT,
    "NON_FINITE_UPDATE": service_errors.NON_FINITE_UPDATE,
    "REFERENCE_NOT_KEPT": service_errors.REFERENCE_NOT_KEPT,
    "TOO_MANY_REFERENCE_PINS": service_errors.TOO_MANY_REFERENCE_PINS,
}


def test_every_error_reason_goes_from_the_server_to_the_sdk_as_its_wire_string() -> None:
    reasons = set(tinkerrpc.ErrorReason.values()) - {tinkerrpc.ErrorReason.ERROR_REASON_UNSPECIFIED}
    assert set(WIRE_REASONS.values()) == reasons, "every ErrorReason is one of the server's reasons"
    for wire, reason in WIRE_REASONS.items():
        status = service_errors.failed_precondition(reason, "refused", {"policy_version": 3}).to_status()
        trailers = dict(status.trailing_metadata)
        details = decode_details(trailers[STATUS_DETAILS_KEY])
        error = error_from_status(status.code, status.details, details)
        assert isinstance(error, tinkerrpc.FailedPreconditionError)
        assert error.error_info is not None
        assert (error.error_info.reason, error.error_info.domain) == (wire, "tinkerrpc")
        assert error.error_info.metadata == {"policy_version": "3"}
        assert error.reason == reason
        assert tinkerrpc.ErrorReason.Name(reason) == f"ERROR_REASON_{wire}"


def test_error_reason_is_unspecified_when_unknown_and_none_without_error_info() -> None:
    newer = [error_details_pb2.ErrorInfo(reason="ADDED_BY_A_NEWER_SERVER", domain="tinkerrpc")]
    error = error_from_status(grpc.StatusCode.FAILED_PRECONDITION, "refused", newer)
    assert type(error) is tinkerrpc.FailedPreconditionError
    assert error.reason == tinkerrpc.ErrorReason.ERROR_REASON_UNSPECIFIED
    assert error_from_status(grpc.StatusCode.NOT_FOUND, "gone", []).reason is None
