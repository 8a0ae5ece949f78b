"""Bad-input campaign: malformed requests to every RPC and to the hosted OpenAI sidecar, one table row each
(request, expected status, a substring of the error naming the problem). After the whole table the
model's state (policy version, sampleable versions, a weights checksum and its checkpoints) is exactly what
it was before. One `tinkerrpc serve --sidecar-port` (conftest.hosted_server) serves the campaign."""

from __future__ import annotations

import math
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
import pytest
from google.protobuf.message import Message as ProtoMessage
from hardening_support import (
    BIG_TOKEN,
    CHAT,
    COMPLETIONS,
    GENERATE,
    HI,
    MAX_SAMPLE_N,
    MAX_TRAIN_TRAJECTORIES,
    HostedServer,
    HttpRow,
    http_outcome,
)
from service.svc import CALL_TIMEOUT, TINY, Server, assistant, create_model, prompt_logprobs, rl_request, user

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2

pytestmark = pytest.mark.process

MODEL = "campaign"
Code = grpc.StatusCode


@dataclass(frozen=True)
class Setup:
    server: Server
    sidecar: str
    sample: pb.SampleResponse
    first_train: pb.TrainRequest


@pytest.fixture(scope="module")
def setup(hosted_server: HostedServer) -> Setup:
    server = hosted_server.server
    create_model(server.stub, MODEL)
    sample = server.stub.Sample(
        pb.SampleRequest(
            model=MODEL,
            chat=pb.ChatPrompt(messages=[user("respond with yes")]),
            params=types_pb2.SamplingParams(n=2, max_tokens=4, seed=5),
        ),
        timeout=CALL_TIMEOUT,
    )
    first_train = rl_request(MODEL, sample, [1.0, 0.0], idempotency_key="first")
    server.stub.Train(first_train, timeout=CALL_TIMEOUT)
    server.stub.SaveCheckpoint(pb.SaveCheckpointRequest(model=MODEL, name="saved"), timeout=CALL_TIMEOUT)
    return Setup(server, hosted_server.sidecar_url, sample, first_train)


# ---- the gRPC table


@dataclass(frozen=True)
class GrpcRow:
    rpc: str
    request: ProtoMessage | bytes  # bytes: sent as they are, for requests no valid message encodes
    code: grpc.StatusCode
    needle: str


def _train(s: Setup, edit: Callable[[pb.TrainRequest], None] | None = None) -> pb.TrainRequest:
    """A valid RL Train request on the campaign model (a fresh copy), changed by `edit`."""
    request = rl_request(MODEL, s.sample, [1.0, 0.0])
    if edit is not None:
        edit(request)
    return request


def _turn(request: pb.TrainRequest) -> types_pb2.SampledTurn:
    return request.groups[0].trajectories[0].turns[0]


def _sft(
    messages: list[types_pb2.Message], loss: int = types_pb2.LOSS_FUNCTION_UNSPECIFIED
) -> pb.TrainRequest:
    request = pb.TrainRequest(
        model=MODEL, adam=types_pb2.AdamParams(learning_rate=1e-3), loss=types_pb2.LossConfig(function=loss)
    )
    request.examples.add(messages=messages)
    return request


def _sample(params: types_pb2.SamplingParams | None = None, **prompt: Any) -> pb.SampleRequest:
    if not prompt:
        prompt = {"text": "hello"}
    return pb.SampleRequest(model=MODEL, params=params or types_pb2.SamplingParams(max_tokens=2), **prompt)


def _bad_utf8(request: ProtoMessage, text: str) -> bytes:
    """`request` encoded, with `text` in one of its string fields replaced by bytes that are not UTF-8."""
    encoded = request.SerializeToString()
    assert encoded.count(text.encode()) == 1
    return encoded.replace(text.encode(), b"\xff" * len(text.encode()))


def _tool(parameters_json: str) -> types_pb2.Tool:
    return types_pb2.Tool(name="f", parameters_json=parameters_json)


def _call(arguments_json: str) -> types_pb2.Message:
    """An assistant message calling tool f with `arguments_json`."""
    return types_pb2.Message(
        role=types_pb2.ROLE_ASSISTANT,
        tool_calls=[types_pb2.ToolCall(id="c1", name="f", arguments_json=arguments_json)],
    )


def _sft_with_tools(messages: list[types_pb2.Message], tools: list[types_pb2.Tool]) -> pb.TrainRequest:
    request = _sft(messages)
    request.examples[0].tools.extend(tools)
    return request


# An integer of 5000 digits: past the 4300 Python's int() converts from a string.
HUGE_INTEGER_JSON = '{"a": 1' + "0" * 5000 + "}"


def _params(**fields: Any) -> types_pb2.SamplingParams:
    return types_pb2.SamplingParams(**{"max_tokens": 2, **fields})


def grpc_rows(s: Setup) -> list[GrpcRow]:
    def set_field(path: str, value: Any) -> Callable[[pb.TrainRequest], None]:
        def edit(request: pb.TrainRequest) -> None:
            *parents, last = path.split(".")
            target: Any = request
            for part in parents:
                target = getattr(target, part)
            setattr(target, last, value)

        return edit

    def drop_turns(request: pb.TrainRequest) -> None:
        del request.groups[0].trajectories[0].turns[:]

    def short_logprobs(request: pb.TrainRequest) -> None:
        del _turn(request).completion_logprobs[-1:]

    def foreign_token(request: pb.TrainRequest) -> None:
        _turn(request).completion_token_ids[0] = BIG_TOKEN

    def future_version(request: pb.TrainRequest) -> None:
        _turn(request).policy_version = 99

    def nan_reward(request: pb.TrainRequest) -> None:
        request.groups[0].trajectories[0].reward = math.nan

    def too_many(request: pb.TrainRequest) -> None:
        group = request.groups[0]
        while len(group.trajectories) <= MAX_TRAIN_TRAJECTORIES:
            group.trajectories.add().CopyFrom(group.trajectories[0])

    def equal_rewards(request: pb.TrainRequest) -> None:
        for trajectory in request.groups[0].trajectories:
            trajectory.reward = 0.5

    def with_example(request: pb.TrainRequest) -> None:
        request.examples.add(messages=[user("q"), assistant("a")])

    def empty_group(request: pb.TrainRequest) -> None:
        request.groups.add()

    def spread_metric_names(request: pb.TrainRequest) -> None:
        """5 trajectories of 64 metrics each (each within its own bound), 320 distinct names in all."""
        group = request.groups[0]
        while len(group.trajectories) < 5:
            group.trajectories.add().CopyFrom(group.trajectories[0])
        for t, trajectory in enumerate(group.trajectories):
            trajectory.metrics.update({f"t{t}m{i}": 1.0 for i in range(64)})

    reused_key = _train(s, set_field("idempotency_key", "first"))
    reused_key.adam.learning_rate = 0.5

    return [
        # CreateModel
        GrpcRow("CreateModel", pb.CreateModelRequest(name="", base_model=TINY), Code.INVALID_ARGUMENT, "name"),
        GrpcRow("CreateModel", pb.CreateModelRequest(name="bad name!", base_model=TINY), Code.INVALID_ARGUMENT, "name"),
        GrpcRow("CreateModel", pb.CreateModelRequest(name="fresh"), Code.INVALID_ARGUMENT, "base_model"),
        GrpcRow("CreateModel", pb.CreateModelRequest(name="fresh", base_model="no/such-model"), Code.NOT_FOUND, "unknown base model"),
        GrpcRow("CreateModel", pb.CreateModelRequest(name="fresh", base_model=TINY, lora=types_pb2.LoraConfig(rank=-1)), Code.INVALID_ARGUMENT, "lora.rank"),
        # The LoRA rank's honest maximum and an adapter with something to train (issue 28 item 2)
        GrpcRow("CreateModel", pb.CreateModelRequest(name="fresh", base_model=TINY, lora=types_pb2.LoraConfig(rank=2_147_483_647)), Code.INVALID_ARGUMENT, "lora.rank: 2147483647 is over the maximum of 512"),
        GrpcRow("CreateModel", pb.CreateModelRequest(name="fresh", base_model=TINY, lora=types_pb2.LoraConfig(rank=513)), Code.INVALID_ARGUMENT, "lora.rank: 513 is over the maximum of 512"),
        GrpcRow("CreateModel", pb.CreateModelRequest(name="fresh", base_model=TINY, lora=types_pb2.LoraConfig(rank=65)), Code.INVALID_ARGUMENT, f"lora.rank: 65 is over the maximum of 64 for '{TINY}' (its hidden size 64, and at most 512)"),
        GrpcRow("CreateModel", pb.CreateModelRequest(name="fresh", base_model=TINY, lora=types_pb2.LoraConfig(train_mlp=False, train_attn=False, train_unembed=False)), Code.INVALID_ARGUMENT, "lora: nothing to train: at least one of train_mlp, train_attn, train_unembed must be true"),
        GrpcRow("CreateModel", pb.CreateModelRequest(name="fresh", base_model=TINY, renderer="no-such-renderer"), Code.INVALID_ARGUMENT, "renderer"),
        GrpcRow("CreateModel", pb.CreateModelRequest(name=MODEL, base_model=TINY), Code.ALREADY_EXISTS, MODEL),
        # base_model is a model name, never a path: the model store knows none (issue 16: any folder
        # holding a config.json was loaded)
        GrpcRow("CreateModel", pb.CreateModelRequest(name="fresh", base_model="../x"), Code.NOT_FOUND, "not a model name"),
        GrpcRow("CreateModel", pb.CreateModelRequest(name="fresh", base_model=str(s.server.proc.data_dir.parent / "models" / TINY)), Code.NOT_FOUND, "not a model name"),
        GrpcRow("CreateModel", pb.CreateModelRequest(name="fresh", base_model=f"{TINY}/../../{TINY}"), Code.NOT_FOUND, "not a model name"),
        # GetModel, DeleteModel
        GrpcRow("GetModel", pb.GetModelRequest(name="ghost"), Code.NOT_FOUND, "ghost"),
        GrpcRow("GetModel", pb.GetModelRequest(name=""), Code.NOT_FOUND, "model '' not found"),
        GrpcRow("DeleteModel", pb.DeleteModelRequest(name="ghost"), Code.NOT_FOUND, "ghost"),
        # Train (RL)
        GrpcRow("Train", _train(s, set_field("model", "ghost")), Code.NOT_FOUND, "ghost"),
        GrpcRow("Train", pb.TrainRequest(model=MODEL, adam=types_pb2.AdamParams(learning_rate=1e-3)), Code.INVALID_ARGUMENT, "groups"),
        GrpcRow("Train", _train(s, with_example), Code.INVALID_ARGUMENT, "not both"),
        GrpcRow("Train", _train(s, set_field("adam.learning_rate", 0.0)), Code.INVALID_ARGUMENT, "adam.learning_rate"),
        GrpcRow("Train", _train(s, set_field("adam.learning_rate", math.nan)), Code.INVALID_ARGUMENT, "adam.learning_rate"),
        GrpcRow("Train", _train(s, set_field("adam.beta1", 1.5)), Code.INVALID_ARGUMENT, "adam.beta1"),
        GrpcRow("Train", _train(s, set_field("adam.grad_clip_norm", -1.0)), Code.INVALID_ARGUMENT, "adam.grad_clip_norm"),
        GrpcRow("Train", _train(s, drop_turns), Code.INVALID_ARGUMENT, "trajectories[0].turns"),
        GrpcRow("Train", _train(s, short_logprobs), Code.INVALID_ARGUMENT, "completion_logprobs"),
        GrpcRow("Train", _train(s, foreign_token), Code.INVALID_ARGUMENT, "completion_token_ids"),
        GrpcRow("Train", _train(s, future_version), Code.INVALID_ARGUMENT, "policy_version"),
        GrpcRow("Train", _train(s, nan_reward), Code.INVALID_ARGUMENT, "reward"),
        GrpcRow("Train", _train(s, empty_group), Code.INVALID_ARGUMENT, "groups[1].trajectories"),
        GrpcRow("Train", _train(s, set_field("loss.function", types_pb2.LOSS_FUNCTION_CROSS_ENTROPY)), Code.INVALID_ARGUMENT, "loss.function"),
        GrpcRow("Train", _train(s, set_field("loss.function", 77)), Code.INVALID_ARGUMENT, "loss.function"),
        GrpcRow("Train", _train(s, set_field("loss.clip_low_threshold", -1.0)), Code.INVALID_ARGUMENT, "loss.clip_low_threshold"),
        GrpcRow("Train", _train(s, set_field("max_staleness", -1)), Code.INVALID_ARGUMENT, "max_staleness"),
        GrpcRow("Train", _train(s, set_field("strict_staleness", True)), Code.INVALID_ARGUMENT, "strict_staleness"),
        GrpcRow("Train", _train(s, set_field("expected_policy_version", 5)), Code.FAILED_PRECONDITION, "expected 5"),
        # Validation before the version check, and bounds on what a step stores (issue 28 item 4)
        GrpcRow("Train", _train(s, set_field("expected_policy_version", -1)), Code.INVALID_ARGUMENT, "expected_policy_version: must be >= 0"),
        GrpcRow("Train", _train(s, set_field("idempotency_key", "k" * 1_000_000)), Code.INVALID_ARGUMENT, "idempotency_key: 1000000 bytes: at most 256"),
        GrpcRow("Train", _train(s, set_field("idempotency_key", "k" * 257)), Code.INVALID_ARGUMENT, "idempotency_key: 257 bytes: at most 256"),
        GrpcRow("Train", _train(s, lambda r: r.groups[0].trajectories[0].metrics.update({f"m{i}": 1.0 for i in range(20_000)})), Code.INVALID_ARGUMENT, "groups[0].trajectories[0].metrics: 20000 metrics: at most 64 per trajectory"),
        GrpcRow("Train", _train(s, lambda r: r.groups[0].trajectories[0].metrics.__setitem__("n" * 129, 1.0)), Code.INVALID_ARGUMENT, "a name of 129 bytes: at most 128"),
        GrpcRow("Train", _train(s, lambda r: r.groups[0].trajectories[0].metrics.__setitem__("score", math.inf)), Code.INVALID_ARGUMENT, "groups[0].trajectories[0].metrics[score]: must be finite"),
        GrpcRow("Train", _train(s, spread_metric_names), Code.INVALID_ARGUMENT, "groups: 320 distinct trajectory metric names: at most 256 per Train"),
        GrpcRow("Train", reused_key, Code.FAILED_PRECONDITION, "idempotency key 'first'"),
        GrpcRow("Train", _train(s, equal_rewards), Code.FAILED_PRECONDITION, "nothing left to train"),
        GrpcRow("Train", _train(s, too_many), Code.RESOURCE_EXHAUSTED, "--max-train-trajectories"),
        # Values that poison a model (issue 16 item 4): each numeric field has a documented range
        # (types.proto), and names are echoed at most 64 characters long (item 7).
        GrpcRow("Train", _train(s, set_field("adam.learning_rate", 1e30)), Code.INVALID_ARGUMENT, "adam.learning_rate: must be a finite number in (0, 10]"),
        GrpcRow("Train", _train(s, set_field("adam.learning_rate", 11.0)), Code.INVALID_ARGUMENT, "adam.learning_rate"),
        GrpcRow("Train", _train(s, set_field("adam.learning_rate", math.inf)), Code.INVALID_ARGUMENT, "adam.learning_rate"),
        GrpcRow("Train", _train(s, set_field("adam.eps", 0.0)), Code.INVALID_ARGUMENT, "adam.eps: must be a finite number >= 1e-30"),
        GrpcRow("Train", _train(s, set_field("adam.eps", 1e-40)), Code.INVALID_ARGUMENT, "adam.eps"),
        GrpcRow("Train", _train(s, set_field("adam.eps", math.nan)), Code.INVALID_ARGUMENT, "adam.eps"),
        GrpcRow("Train", _train(s, set_field("adam.weight_decay", 1e30)), Code.INVALID_ARGUMENT, "adam.weight_decay: must be a finite number in [0, 1]"),
        GrpcRow("Train", _train(s, set_field("adam.weight_decay", -0.1)), Code.INVALID_ARGUMENT, "adam.weight_decay"),
        GrpcRow("Train", _train(s, set_field("adam.beta2", 1.0)), Code.INVALID_ARGUMENT, "adam.beta2"),
        GrpcRow("Train", _train(s, set_field("adam.grad_clip_norm", math.inf)), Code.INVALID_ARGUMENT, "adam.grad_clip_norm"),
        GrpcRow("Train", _train(s, lambda r: _turn(r).completion_logprobs.__setitem__(0, -1e30)), Code.INVALID_ARGUMENT, "completion_logprobs: must be finite numbers in [-10000, 0]"),
        GrpcRow("Train", _train(s, lambda r: _turn(r).completion_logprobs.__setitem__(0, 0.5)), Code.INVALID_ARGUMENT, "completion_logprobs"),
        GrpcRow("Train", _train(s, lambda r: _turn(r).completion_logprobs.__setitem__(0, -math.inf)), Code.INVALID_ARGUMENT, "completion_logprobs"),
        GrpcRow("Train", _train(s, lambda r: setattr(r.groups[0].trajectories[0], "reward", 1e7)), Code.INVALID_ARGUMENT, "reward: must be a finite number in [-1e+06, 1e+06]"),
        GrpcRow("Train", _train(s, lambda r: setattr(r.groups[0].trajectories[0], "reward", -math.inf)), Code.INVALID_ARGUMENT, "reward"),
        GrpcRow("Train", _train(s, lambda r: r.loss.CopyFrom(types_pb2.LossConfig(function=types_pb2.LOSS_FUNCTION_PPO, clip_high_threshold=1e9))), Code.INVALID_ARGUMENT, "loss.clip_high_threshold"),
        GrpcRow("Train", _train(s, lambda r: r.loss.CopyFrom(types_pb2.LossConfig(function=types_pb2.LOSS_FUNCTION_PPO, clip_low_threshold=1.5))), Code.INVALID_ARGUMENT, "loss.clip_low_threshold"),
        GrpcRow("Train", _train(s, lambda r: r.loss.CopyFrom(types_pb2.LossConfig(function=types_pb2.LOSS_FUNCTION_DRO, beta=1e9))), Code.INVALID_ARGUMENT, "loss.beta"),
        GrpcRow("Train", _train(s, lambda r: r.loss.CopyFrom(types_pb2.LossConfig(function=types_pb2.LOSS_FUNCTION_DRO, beta=math.nan))), Code.INVALID_ARGUMENT, "loss.beta"),
        GrpcRow("Sample", _sample(_params(temperature=1e-40)), Code.INVALID_ARGUMENT, "params.temperature: must be 0 (greedy) or in [0.001, 100]"),
        GrpcRow("Sample", _sample(_params(temperature=1e-4)), Code.INVALID_ARGUMENT, "params.temperature"),
        GrpcRow("Sample", _sample(_params(temperature=1000.0)), Code.INVALID_ARGUMENT, "params.temperature"),
        GrpcRow("Sample", _sample(_params(temperature=math.nan)), Code.INVALID_ARGUMENT, "params.temperature"),
        GrpcRow("Sample", _sample(_params(top_p=math.nan)), Code.INVALID_ARGUMENT, "params.top_p"),
        GrpcRow("GetModel", pb.GetModelRequest(name="g" * 500_000), Code.NOT_FOUND, "… (500000 characters) not found"),
        GrpcRow("Train", _train(s, set_field("model", "g" * 100_000)), Code.NOT_FOUND, "… (100000 characters) not found"),
        GrpcRow("CreateModel", pb.CreateModelRequest(name="n" * 100_000, base_model=TINY), Code.INVALID_ARGUMENT, "… (100000 characters): must be"),
        # Train (SFT)
        GrpcRow("Train", _sft([user("question only")]), Code.INVALID_ARGUMENT, "examples[0].messages"),
        GrpcRow("Train", _sft([user("q"), assistant("a")], types_pb2.LOSS_FUNCTION_PPO), Code.INVALID_ARGUMENT, "loss.function"),
        GrpcRow("Train", _sft([types_pb2.Message(content="no role"), assistant("a")]), Code.INVALID_ARGUMENT, "examples[0].messages[0]"),
        # Checkpoints
        GrpcRow("SaveCheckpoint", pb.SaveCheckpointRequest(model="ghost"), Code.NOT_FOUND, "ghost"),
        GrpcRow("SaveCheckpoint", pb.SaveCheckpointRequest(model=MODEL, name="bad name"), Code.INVALID_ARGUMENT, "name"),
        GrpcRow("SaveCheckpoint", pb.SaveCheckpointRequest(model=MODEL, name="saved"), Code.ALREADY_EXISTS, "saved"),
        GrpcRow("ListCheckpoints", pb.ListCheckpointsRequest(model="ghost"), Code.NOT_FOUND, "ghost"),
        GrpcRow("RestoreCheckpoint", pb.RestoreCheckpointRequest(model=MODEL, checkpoint="nope"), Code.NOT_FOUND, "nope"),
        GrpcRow("RestoreCheckpoint", pb.RestoreCheckpointRequest(model="ghost", checkpoint="saved"), Code.NOT_FOUND, "ghost"),
        GrpcRow("DeleteCheckpoint", pb.DeleteCheckpointRequest(model=MODEL, checkpoint="nope"), Code.NOT_FOUND, "nope"),
        GrpcRow("DeleteCheckpoint", pb.DeleteCheckpointRequest(model=MODEL, checkpoint="saved", kind=99), Code.INVALID_ARGUMENT, "kind"),  # type: ignore[arg-type]
        GrpcRow("DeleteCheckpoint", pb.DeleteCheckpointRequest(model=MODEL, checkpoint="v000001", kind=types_pb2.CHECKPOINT_KIND_SAMPLER), Code.FAILED_PRECONDITION, "current version"),
        GrpcRow("DeleteCheckpoint", pb.DeleteCheckpointRequest(model=MODEL, checkpoint="saved"), Code.FAILED_PRECONDITION, "recovers from"),
        # ExportWeights (a server stream: the error arrives when it is read)
        GrpcRow("ExportWeights", pb.ExportWeightsRequest(model="ghost"), Code.NOT_FOUND, "ghost"),
        GrpcRow("ExportWeights", pb.ExportWeightsRequest(model=MODEL, policy_version=-1), Code.INVALID_ARGUMENT, "policy_version"),
        GrpcRow("ExportWeights", pb.ExportWeightsRequest(model=MODEL, policy_version=9), Code.NOT_FOUND, "is at version 1"),
        GrpcRow("ExportWeights", pb.ExportWeightsRequest(model=MODEL, expected_policy_version=5), Code.FAILED_PRECONDITION, "expected 5"),
        # Sample
        GrpcRow("Sample", pb.SampleRequest(model="ghost", text="x", params=_params()), Code.NOT_FOUND, "ghost"),
        GrpcRow("Sample", pb.SampleRequest(model=MODEL, params=_params()), Code.INVALID_ARGUMENT, "prompt"),
        GrpcRow("Sample", _sample(text=""), Code.INVALID_ARGUMENT, "prompt"),
        GrpcRow("Sample", _sample(tokens=pb.TokenPrompt(token_ids=[1, BIG_TOKEN])), Code.INVALID_ARGUMENT, "tokens.token_ids"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt()), Code.INVALID_ARGUMENT, "chat.messages: give at least one"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[types_pb2.Message(content="no role")])), Code.INVALID_ARGUMENT, "chat.messages[0]"),
        GrpcRow("Sample", _sample(types_pb2.SamplingParams()), Code.INVALID_ARGUMENT, "params.max_tokens"),
        GrpcRow("Sample", _sample(_params(n=-1)), Code.INVALID_ARGUMENT, "params.n"),
        GrpcRow("Sample", _sample(_params(n=MAX_SAMPLE_N + 1)), Code.INVALID_ARGUMENT, "--max-sample-n"),
        GrpcRow("Sample", _sample(_params(max_tokens=10**6)), Code.INVALID_ARGUMENT, "params.max_tokens"),
        GrpcRow("Sample", _sample(_params(temperature=-1.0)), Code.INVALID_ARGUMENT, "params.temperature"),
        GrpcRow("Sample", _sample(_params(top_p=1.5)), Code.INVALID_ARGUMENT, "params.top_p"),
        GrpcRow("Sample", _sample(_params(top_k=-2)), Code.INVALID_ARGUMENT, "params.top_k"),
        GrpcRow("Sample", _sample(_params(top_logprobs=-1)), Code.INVALID_ARGUMENT, "params.top_logprobs"),
        GrpcRow("Sample", _sample(_params(stop=[""])), Code.INVALID_ARGUMENT, "params.stop"),
        GrpcRow("Sample", _sample(_params(stop_token_ids=[BIG_TOKEN])), Code.INVALID_ARGUMENT, "params.stop_token_ids"),
        GrpcRow("Sample", pb.SampleRequest(model=MODEL, text="x", params=_params(), policy_version=42), Code.NOT_FOUND, "no sampleable version 42"),
        # Over --max-message-mb 1: grpc's own "Received message larger than max (N vs. 1048576)".
        GrpcRow("Sample", _sample(text="x" * (2 * 1024 * 1024)), Code.RESOURCE_EXHAUSTED, "1048576"),
        # Starvation caps and control tokens (issue 16 items 5-6): text over 32 bytes per context token
        # (tiny-chat: 2048 x 32 = 65536) is refused before tokenising; top_logprobs, stop strings and stop
        # token ids are capped; renderers that cannot render with the model's tokenizer are refused.
        GrpcRow("Sample", _sample(text="x" * 100_000), Code.INVALID_ARGUMENT, "text: 100000 bytes of text cannot fit"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("x" * 100_000)])), Code.INVALID_ARGUMENT, "chat.messages: 1000"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi")], tools=[types_pb2.Tool(name="f", description="d" * 100_000)])), Code.INVALID_ARGUMENT, "chat.messages: 1000"),
        GrpcRow("Sample", _sample(_params(top_logprobs=21)), Code.INVALID_ARGUMENT, "params.top_logprobs: must be in [0, 20]"),
        GrpcRow("Sample", _sample(_params(top_logprobs=2_000_000)), Code.INVALID_ARGUMENT, "params.top_logprobs"),
        GrpcRow("Sample", _sample(_params(stop=["a"] * 17)), Code.INVALID_ARGUMENT, "params.stop: 17 stop strings: at most 16"),
        GrpcRow("Sample", _sample(_params(stop=[f"s{i}" for i in range(10_000)])), Code.INVALID_ARGUMENT, "params.stop: 10000 stop strings"),
        GrpcRow("Sample", _sample(_params(stop=["x" * 257])), Code.INVALID_ARGUMENT, "params.stop: a stop string of 257 bytes"),
        GrpcRow("Sample", _sample(_params(stop=["\u20ac" * 100])), Code.INVALID_ARGUMENT, "params.stop: a stop string of 300 bytes"),
        GrpcRow("Sample", _sample(_params(stop_token_ids=[1] * 129)), Code.INVALID_ARGUMENT, "params.stop_token_ids: 129 ids"),
        GrpcRow("Train", _sft([user("x" * 100_000), assistant("a")]), Code.INVALID_ARGUMENT, "examples[0].messages: 1000"),
        GrpcRow("Train", _train(s, lambda r: r.groups[0].trajectories[0].messages.append(user("x" * 100_000))), Code.INVALID_ARGUMENT, "groups[0].trajectories[0].messages: 1000"),
        GrpcRow("CreateModel", pb.CreateModelRequest(name="fresh", base_model=TINY, renderer="deepseekv3"), Code.INVALID_ARGUMENT, "renderer: renderer 'deepseekv3' cannot render"),
        GrpcRow("CreateModel", pb.CreateModelRequest(name="fresh", base_model=TINY, renderer="glm5_3_max_reasoning"), Code.INVALID_ARGUMENT, "renderer: renderer 'glm5_3_max_reasoning' does not work"),
        # JSON carried in strings: malformed, nested past the parser, or not an object
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi")], tools=[_tool("{")])), Code.INVALID_ARGUMENT, "chat.tools[0].parameters_json: must be a JSON Schema object (invalid JSON"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi")], tools=[_tool("[" * 20_000)])), Code.INVALID_ARGUMENT, "(nested too deeply: more than 64 levels)"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi")], tools=[_tool("[1, 2]")])), Code.INVALID_ARGUMENT, "(got an array)"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi")], tools=[_tool('"text"')])), Code.INVALID_ARGUMENT, "(got a string)"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi"), _call('{"a": ')])), Code.INVALID_ARGUMENT, "chat.messages[1].tool_calls[0].arguments_json: must be a JSON object (invalid JSON"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi"), _call("{\"a\": " * 5_000)])), Code.INVALID_ARGUMENT, "(nested too deeply: more than 64 levels)"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi"), _call("null")])), Code.INVALID_ARGUMENT, "(got null)"),
        GrpcRow("Train", _sft([user("hi"), _call("7"), assistant("a")]), Code.INVALID_ARGUMENT, "examples[0].messages[1].tool_calls[0].arguments_json: must be a JSON object (got a number)"),
        # Numbers Python's json cannot convert (past 4300 digits) or that are not JSON (issue 28 item 1),
        # and nesting past the bound every later walk of the value relies on
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi")], tools=[_tool(HUGE_INTEGER_JSON)])), Code.INVALID_ARGUMENT, "chat.tools[0].parameters_json: must be a JSON Schema object (a number of 5001 characters: at most 100)"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi"), _call(HUGE_INTEGER_JSON)])), Code.INVALID_ARGUMENT, "chat.messages[1].tool_calls[0].arguments_json: must be a JSON object (a number of 5001"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi")], tools=[_tool('{"a": 1.' + "5" * 5000 + "}")])), Code.INVALID_ARGUMENT, "(a number of 5002 characters: at most 100)"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi")], tools=[_tool('{"minimum": NaN}')])), Code.INVALID_ARGUMENT, "chat.tools[0].parameters_json: must be a JSON Schema object (NaN is not a JSON number)"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi")], tools=[_tool('{"maximum": Infinity}')])), Code.INVALID_ARGUMENT, "(Infinity is not a JSON number)"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi")], tools=[_tool('{"minimum": -Infinity}')])), Code.INVALID_ARGUMENT, "(-Infinity is not a JSON number)"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi"), _call('{"x": 1e999}')])), Code.INVALID_ARGUMENT, "(1e999 is out of the range of a double)"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi")], tools=[_tool('{"a": ' * 600 + "1" + "}" * 600)])), Code.INVALID_ARGUMENT, "chat.tools[0].parameters_json: must be a JSON Schema object (nested too deeply: more than 64 levels)"),
        GrpcRow("Train", _train(s, lambda r: r.groups[0].trajectories[0].tools.append(_tool(HUGE_INTEGER_JSON))), Code.INVALID_ARGUMENT, "groups[0].trajectories[0].tools[0].parameters_json: must be a JSON Schema object (a number of 5001"),
        GrpcRow("Train", _train(s, lambda r: r.groups[0].trajectories[0].messages.extend([user("hi"), _call(HUGE_INTEGER_JSON)])), Code.INVALID_ARGUMENT, "groups[0].trajectories[0].messages[1].tool_calls[0].arguments_json: must be a JSON object (a number of 5001"),
        GrpcRow("Train", _train(s, lambda r: r.groups[0].trajectories[0].tools.append(_tool('{"a": NaN}'))), Code.INVALID_ARGUMENT, "(NaN is not a JSON number)"),
        GrpcRow("Train", _sft_with_tools([user("hi"), assistant("a")], [_tool(HUGE_INTEGER_JSON)]), Code.INVALID_ARGUMENT, "examples[0].tools[0].parameters_json: must be a JSON Schema object (a number of 5001"),
        GrpcRow("Train", _sft([user("hi"), _call(HUGE_INTEGER_JSON), assistant("a")]), Code.INVALID_ARGUMENT, "examples[0].messages[1].tool_calls[0].arguments_json: must be a JSON object (a number of 5001"),
        GrpcRow("Train", _sft([user("hi"), _call('{"a": [-Infinity]}'), assistant("a")]), Code.INVALID_ARGUMENT, "(-Infinity is not a JSON number)"),
        # Bytes no valid message encodes: invalid UTF-8 in a string field, a truncated field
        GrpcRow("GetModel", _bad_utf8(pb.GetModelRequest(name=MODEL), MODEL), Code.INVALID_ARGUMENT, "request: not a valid /tinkerrpc.v1.TrainerService/GetModel request"),
        GrpcRow("Sample", _bad_utf8(_sample(text="say hello"), "hello"), Code.INVALID_ARGUMENT, "bad UTF-8"),
        GrpcRow("Train", _bad_utf8(_sft([user("pick one"), assistant("a")]), "pick"), Code.INVALID_ARGUMENT, "request: not a valid"),
        GrpcRow("ExportWeights", _bad_utf8(pb.ExportWeightsRequest(model=MODEL), MODEL), Code.INVALID_ARGUMENT, "request: not a valid"),
        GrpcRow("ListCheckpoints", pb.ListCheckpointsRequest(model=MODEL).SerializeToString()[:-3], Code.INVALID_ARGUMENT, "request: not a valid"),
        # vLLM's extras and forced tool calls on Sample (issue 13)
        GrpcRow("Sample", _sample(_params(min_tokens=-1), text="x"), Code.INVALID_ARGUMENT, "params.min_tokens: must be >= 0"),
        GrpcRow("Sample", _sample(_params(min_tokens=3), text="x"), Code.INVALID_ARGUMENT, "params.min_tokens: 3 is over max_tokens (2)"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi")], forced_tool_call=pb.ForcedToolCall())), Code.INVALID_ARGUMENT, "chat.forced_tool_call: forcing a tool call needs chat.tools"),
        GrpcRow("Sample", _sample(chat=pb.ChatPrompt(messages=[user("hi")], tools=[_tool("{}")], forced_tool_call=pb.ForcedToolCall(function_name="g"))), Code.INVALID_ARGUMENT, "chat.forced_tool_call.function_name: 'g' is not the name of one of chat.tools"),
    ]  # fmt: skip


# ---- the HTTP table (the hosted sidecar)


def _generate(**sampling: Any) -> dict[str, Any]:
    return {"model": MODEL, "token_ids": [1, 2], "sampling_params": {"max_tokens": 1, **sampling}}


def http_rows() -> list[HttpRow]:
    return [
        HttpRow("no key", CHAT, {"model": MODEL, "messages": HI}, 401, "api key", key=None),
        HttpRow("wrong key", CHAT, {"model": MODEL, "messages": HI}, 401, "api key", key="sk-wrong"),
        HttpRow("wrong key, models", "/v1/models", None, 401, "api key", key="sk-wrong", method="GET"),
        HttpRow("not JSON", CHAT, b"{nope", 400, "not valid JSON"),
        HttpRow("no model", CHAT, {"messages": HI}, 400, "model"),
        HttpRow("unknown model", CHAT, {"model": "ghost", "messages": HI}, 404, "ghost"),
        HttpRow("malformed model id", CHAT, {"model": f"{MODEL}@latest", "messages": HI}, 404, "policy version"),
        HttpRow("unknown version", CHAT, {"model": f"{MODEL}@42", "messages": HI}, 404, "42"),
        HttpRow("no messages", CHAT, {"model": MODEL, "messages": []}, 400, "messages"),
        HttpRow("bad role", CHAT, {"model": MODEL, "messages": [{"role": "robot", "content": "x"}]}, 400, "role"),
        HttpRow("n = 0", CHAT, {"model": MODEL, "messages": HI, "n": 0}, 400, "n"),
        HttpRow("temperature 5", CHAT, {"model": MODEL, "messages": HI, "temperature": 5}, 400, "temperature"),
        HttpRow("top_p 0", CHAT, {"model": MODEL, "messages": HI, "top_p": 0}, 400, "top_p"),
        HttpRow("max_tokens 0", CHAT, {"model": MODEL, "messages": HI, "max_tokens": 0}, 400, "max_tokens"),
        HttpRow("max_tokens huge", CHAT, {"model": MODEL, "messages": HI, "max_tokens": 10**6}, 400, "max_tokens"),
        HttpRow("presence_penalty", CHAT, {"model": MODEL, "messages": HI, "presence_penalty": 1}, 400, "presence_penalty"),
        HttpRow("unknown field in a message", CHAT, {"model": MODEL, "messages": [{"role": "user", "content": "x", "mystery_knob": 1}]}, 400, "messages[0].mystery_knob"),
        HttpRow("top_logprobs alone", CHAT, {"model": MODEL, "messages": HI, "top_logprobs": 2}, 400, "top_logprobs"),
        HttpRow("tool_choice required", CHAT, {"model": MODEL, "messages": HI, "tool_choice": "required"}, 400, "tool_choice"),
        HttpRow("stop empty", CHAT, {"model": MODEL, "messages": HI, "stop": [""]}, 400, "stop"),
        HttpRow("completions: no prompt", COMPLETIONS, {"model": MODEL}, 400, "prompt"),
        HttpRow("completions: echo with logprobs", COMPLETIONS, {"model": MODEL, "prompt": "x", "echo": True, "logprobs": 1}, 400, "echo"),
        HttpRow("completions: logprobs 99", COMPLETIONS, {"model": MODEL, "prompt": "x", "logprobs": 99}, 400, "logprobs"),
        HttpRow("completions: foreign token", COMPLETIONS, {"model": MODEL, "prompt": [1, BIG_TOKEN]}, 400, "vocabulary"),
        HttpRow("completions: unknown model", COMPLETIONS, {"model": "ghost", "prompt": "x"}, 404, "ghost"),
        HttpRow("unknown model card", "/v1/models/ghost", None, 404, "ghost", method="GET"),
        # vLLM's extras and forced tool calls (issue 13)
        HttpRow("chat_template_kwargs: enable_thinking not a bool", CHAT, {"model": MODEL, "messages": HI, "chat_template_kwargs": {"enable_thinking": "no"}}, 400, "[param chat_template_kwargs.enable_thinking]"),
        HttpRow("tool_choice: unknown function", CHAT, {"model": MODEL, "messages": HI, "tools": [{"type": "function", "function": {"name": "f"}}], "tool_choice": {"type": "function", "function": {"name": "g"}}}, 400, "names function 'g', which is not one of the tools"),
        HttpRow("tool_choice: unknown form", CHAT, {"model": MODEL, "messages": HI, "tool_choice": "always"}, 400, "tool_choice must be"),
        HttpRow("response_format json", CHAT, {"model": MODEL, "messages": HI, "response_format": {"type": "json_object"}}, 400, "no constrained decoding"),
        HttpRow("min_tokens over max_tokens", CHAT, {"model": MODEL, "messages": HI, "max_tokens": 2, "min_tokens": 3}, 400, "[param min_tokens]"),
        HttpRow("min_tokens negative", COMPLETIONS, {"model": MODEL, "prompt": "x", "min_tokens": -1}, 400, "[param min_tokens]"),
        # vLLM's tokens-in, tokens-out route (issue 27): the same key, the server's limits named as it names them
        HttpRow("generate: no key", GENERATE, _generate(), 401, "api key", key=None),
        HttpRow("generate: wrong key", GENERATE, _generate(), 401, "api key", key="sk-wrong"),
        HttpRow("generate: foreign token", GENERATE, {**_generate(), "token_ids": [1, BIG_TOKEN]}, 400, "outside the vocabulary"),
        HttpRow("generate: foreign token, named", GENERATE, {**_generate(), "token_ids": [BIG_TOKEN]}, 400, "(gRPC INVALID_ARGUMENT) [param token_ids]"),
        HttpRow("generate: n over the server's limit", GENERATE, _generate(n=MAX_SAMPLE_N + 1), 400, "(--max-sample-n) (gRPC INVALID_ARGUMENT) [param sampling_params.n]"),
        HttpRow("generate: max_tokens over the server's limit", GENERATE, _generate(max_tokens=10**4), 400, "(--max-sample-tokens) (gRPC INVALID_ARGUMENT) [param sampling_params.max_tokens]"),
        HttpRow("generate: unknown version", GENERATE, {**_generate(), "model": f"{MODEL}@42"}, 404, "42"),
    ]  # fmt: skip


# ---- state and the campaign


def _state(s: Setup, probe: list[int]) -> dict[str, Any]:
    stub = s.server.stub
    info = stub.GetModel(pb.GetModelRequest(name=MODEL), timeout=CALL_TIMEOUT).model
    checkpoints = stub.ListCheckpoints(
        pb.ListCheckpointsRequest(model=MODEL), timeout=CALL_TIMEOUT
    ).checkpoints
    return {
        "version": info.policy_version,
        "sampleable": list(info.sampleable_versions),
        "weights": prompt_logprobs(stub, MODEL, probe),
        "checkpoints": sorted((c.kind, c.name, c.policy_version, c.tinker_path) for c in checkpoints),
        "models": [m.name for m in stub.ListModels(pb.ListModelsRequest(), timeout=CALL_TIMEOUT).models],
    }


def _grpc_outcome(s: Setup, row: GrpcRow) -> tuple[grpc.StatusCode, str]:
    streams = pb.DESCRIPTOR.services_by_name["TrainerService"].methods_by_name[row.rpc].server_streaming
    if isinstance(row.request, bytes):
        path = f"/tinkerrpc.v1.TrainerService/{row.rpc}"
        call = s.server.channel.unary_stream(path) if streams else s.server.channel.unary_unary(path)
    else:
        call = getattr(s.server.stub, row.rpc)
    try:
        answer = call(row.request, timeout=CALL_TIMEOUT)
        if streams:
            list(answer)
    except grpc.RpcError as err:
        return err.code(), err.details() or ""
    return grpc.StatusCode.OK, ""


def test_bad_input_campaign_gets_named_errors_and_changes_nothing(setup: Setup) -> None:
    probe = list(setup.sample.prompt_token_ids)
    before = _state(setup, probe)
    assert before["version"] == 1 and before["checkpoints"]

    failures: list[str] = []
    grpc_table = grpc_rows(setup)
    for row in grpc_table:
        code, details = _grpc_outcome(setup, row)
        if code != row.code or row.needle not in details:
            failures.append(
                f"{row.rpc} expected {row.code.name} with {row.needle!r}: got {code.name}: {details}"
            )
    http_table = http_rows()
    for http_row in http_table:
        status, message = http_outcome(setup.sidecar, http_row)
        if status != http_row.status or http_row.needle.lower() not in message.lower():
            failures.append(
                f"{http_row.label} expected {http_row.status} with {http_row.needle!r}: got {status}: {message}"
            )
    print(
        f"\nbad inputs tried: {len(grpc_table)} gRPC + {len(http_table)} HTTP = {len(grpc_table) + len(http_table)}"
    )
    assert not failures, "\n".join(failures)
    # Rows are only ever added: with the sidecar table (tests/sidecar/test_sidecar_bad_input.py) >= 280.
    assert len(grpc_table) + len(http_table) >= 186

    assert _state(setup, probe) == before
    # The idempotent replay of the first step is still the recorded one, not re-applied.
    replay = setup.server.stub.Train(setup.first_train, timeout=CALL_TIMEOUT)
    assert replay.replayed and replay.policy_version == 1
    assert _state(setup, probe) == before
