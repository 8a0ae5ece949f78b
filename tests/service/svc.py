"""Helpers for the service tests: a real `tinkerrpc serve` (with its embedded engine child), stubs,
decoded error details, and the probes the tests compare (prompt logprobs at a policy version)."""

from __future__ import annotations

import os
import re
import sys
import time
from collections.abc import Callable
from pathlib import Path

import grpc
from google.protobuf.message import Message as ProtoMessage
from google.rpc import error_details_pb2
from grpc_status import rpc_status

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import trainer_service_pb2_grpc, types_pb2
from tinkerrpc_server.local.stack import LocalStack

TINY = "tinkerrpc/tiny-chat"
START_TIMEOUT = 240.0
CALL_TIMEOUT = 120.0


class Server:
    """A `tinkerrpc serve` process on 127.0.0.1 and a channel to it. With `crash_at` it is
    crashing_server.py instead: the same server, which exits 137 when a Train step reaches that point."""

    def __init__(
        self,
        data_dir: Path,
        model_dir: Path,
        log_path: Path,
        env: dict[str, str] | None = None,
        *extra: str,
        crash_at: str = "",
    ) -> None:
        stack = LocalStack(data_dir, log_path, ("--model-dir", str(model_dir), *extra), START_TIMEOUT, env)
        if crash_at:
            stack.cmd = [sys.executable, "-m", "crashing_server", *stack.cmd[3:], "--crash-at", crash_at]
            search_path = [str(Path(__file__).parent), stack.env.get("PYTHONPATH", "")]
            stack.env["PYTHONPATH"] = os.pathsep.join(filter(None, search_path))
        self.proc = stack.start()
        self.port = self.proc.port
        self.channel = grpc.insecure_channel(self.proc.target)
        self.stub = trainer_service_pb2_grpc.TrainerServiceStub(self.channel)

    def engine_pid(self) -> int:
        match = re.search(r"embedded engine starting \(pid (\d+)\)", self.proc.log())
        assert match, "the server log names its engine child"
        return int(match.group(1))

    def engine_url(self) -> str:
        """Where the engine child serving now listens (the last one started, after any restart)."""
        urls = re.findall(r"embedded engine healthy on (http://\S+)", self.proc.log())
        assert urls, "the server log names its engine's URL"
        return urls[-1]

    def close(self) -> int | None:
        self.channel.close()
        return self.proc.stop()


def poll_until(condition: Callable[[], bool], seconds: float, interval: float = 0.1) -> bool:
    """Whether `condition` holds within `seconds`, checked every `interval`: for states of another process
    that no event announces (its log, an engine's counters); anything awaitable is awaited instead."""
    deadline = time.monotonic() + seconds
    while not condition():
        if time.monotonic() >= deadline:
            return False
        time.sleep(interval)
    return True


def create_model(
    stub: trainer_service_pb2_grpc.TrainerServiceStub, name: str, rank: int = 8
) -> types_pb2.ModelInfo:
    response = stub.CreateModel(
        pb.CreateModelRequest(name=name, base_model=TINY, lora=types_pb2.LoraConfig(rank=rank), seed=7),
        timeout=CALL_TIMEOUT,
    )
    return response.model


def user(text: str) -> types_pb2.Message:
    return types_pb2.Message(role=types_pb2.ROLE_USER, content=text)


def assistant(text: str) -> types_pb2.Message:
    return types_pb2.Message(role=types_pb2.ROLE_ASSISTANT, content=text)


def yes_no_sft_request(model: str, learning_rate: float) -> pb.TrainRequest:
    """A supervised Train of two examples: "respond with yes" answered yes, "respond with no" no."""
    request = pb.TrainRequest(model=model, adam=types_pb2.AdamParams(learning_rate=learning_rate))
    request.examples.add(messages=[user("respond with yes"), assistant("yes")])
    request.examples.add(messages=[user("respond with no"), assistant("no")])
    return request


def sample_chat(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
    model: str,
    text: str,
    n: int = 4,
    max_tokens: int = 4,
    seed: int | None = 1,
    version: int | None = None,
) -> pb.SampleResponse:
    params = types_pb2.SamplingParams(n=n, max_tokens=max_tokens)
    if seed is not None:
        params.seed = seed
    request = pb.SampleRequest(model=model, chat=pb.ChatPrompt(messages=[user(text)]), params=params)
    if version is not None:
        request.policy_version = version
    return stub.Sample(request, timeout=CALL_TIMEOUT)


def prompt_logprobs(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
    model: str,
    tokens: list[int],
    version: int | None = None,
) -> list[float]:
    """The policy's log-probabilities of `tokens` (position 0 excluded): a fingerprint of its weights."""
    request = pb.SampleRequest(
        model=model,
        tokens=pb.TokenPrompt(token_ids=tokens),
        params=types_pb2.SamplingParams(max_tokens=1, seed=0, include_prompt_logprobs=True),
    )
    if version is not None:
        request.policy_version = version
    return list(stub.Sample(request, timeout=CALL_TIMEOUT).prompt_logprobs)[1:]


def rl_request(
    model: str,
    sample: pb.SampleResponse,
    rewards: list[float],
    learning_rate: float = 1e-2,
    idempotency_key: str = "",
) -> pb.TrainRequest:
    """One group: the sampled sequences as single-turn trajectories with the given rewards."""
    request = pb.TrainRequest(
        model=model, adam=types_pb2.AdamParams(learning_rate=learning_rate), idempotency_key=idempotency_key
    )
    group = request.groups.add()
    for sequence, reward in zip(sample.sequences, rewards, strict=True):
        trajectory = group.trajectories.add(reward=reward)
        trajectory.turns.add(
            prompt_token_ids=sample.prompt_token_ids,
            completion_token_ids=sequence.token_ids,
            completion_logprobs=sequence.logprobs,
            policy_version=sequence.policy_version,
        )
    return request


def error_details(err: grpc.RpcError) -> list[ProtoMessage]:
    status = rpc_status.from_call(err)  # type: ignore[arg-type]
    assert status is not None, f"{err.code()} carries no google.rpc status details"
    details: list[ProtoMessage] = []
    for packed in status.details:
        for detail_type in (
            error_details_pb2.BadRequest,
            error_details_pb2.ErrorInfo,
            error_details_pb2.ResourceInfo,
            error_details_pb2.QuotaFailure,
        ):
            if packed.Is(detail_type.DESCRIPTOR):
                detail = detail_type()
                packed.Unpack(detail)
                details.append(detail)
    return details


def violated_fields(err: grpc.RpcError) -> list[str]:
    assert err.code() == grpc.StatusCode.INVALID_ARGUMENT, err.details()
    bad = [d for d in error_details(err) if isinstance(d, error_details_pb2.BadRequest)]
    assert bad, "INVALID_ARGUMENT carries a BadRequest"
    return [v.field for v in bad[0].field_violations]


def error_info(err: grpc.RpcError) -> error_details_pb2.ErrorInfo:
    infos = [d for d in error_details(err) if isinstance(d, error_details_pb2.ErrorInfo)]
    assert infos, f"{err.code()} carries an ErrorInfo"
    return infos[0]


def resource_info(err: grpc.RpcError) -> error_details_pb2.ResourceInfo:
    infos = [d for d in error_details(err) if isinstance(d, error_details_pb2.ResourceInfo)]
    assert infos, f"{err.code()} carries a ResourceInfo"
    return infos[0]
