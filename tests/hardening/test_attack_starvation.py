"""One request must not starve the others (issue 16, item 5). Before the fix a 16 MiB text prompt was
tokenised on the server's event loop (every RPC, health included, froze ~21 s), and gRPC took unbounded
top_logprobs and stop-string lists. Now text over 32 UTF-8 bytes per token of the model's context is
INVALID_ARGUMENT naming its field before anything tokenises it, rendering runs off the event loop, and
top_logprobs (<= 20), stop strings (<= 16, <= 256 bytes each) and stop token ids (<= 128) are capped.

Outcomes, not timings: huge requests are sent first, then a health check and a Sample on another model
with modest deadlines must succeed, and each huge request must be refused naming its field. The server
here takes 64 MiB messages so that the 16 MiB requests reach the service instead of gRPC's size limit."""

from __future__ import annotations

from collections.abc import Iterator
from typing import Any

import grpc
import pytest
from grpc_health.v1 import health_pb2, health_pb2_grpc
from service.svc import CALL_TIMEOUT, Server, assistant, create_model, sample_chat, user, violated_fields

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import trainer_service_pb2_grpc, types_pb2

pytestmark = pytest.mark.process

BIG = 16 * 1024 * 1024
HUGE_MODEL = "huge"
OTHER_MODEL = "other"
# Generous for an idle server, far below the ~21 s one 16 MiB prompt used to freeze it per request.
HEALTH_DEADLINE = 10.0
SAMPLE_DEADLINE = 30.0


@pytest.fixture(scope="module")
def server(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Server]:
    tmp = tmp_path_factory.mktemp("starvation")
    running = Server(tmp / "data", tmp / "models", tmp / "serve.log", None, "--max-message-mb", "64")
    create_model(running.stub, HUGE_MODEL)
    create_model(running.stub, OTHER_MODEL)
    yield running
    assert running.close() == 0, running.proc.log()[-3000:]


def _params(**fields: Any) -> types_pb2.SamplingParams:
    return types_pb2.SamplingParams(max_tokens=2, **fields)


def _huge_requests() -> list[tuple[str, pb.SampleRequest | pb.TrainRequest, str]]:
    """(rpc, request, the field its refusal names): a raw text prompt, a chat prompt and an SFT example."""
    text = "x" * BIG
    sft = pb.TrainRequest(model=HUGE_MODEL, adam=types_pb2.AdamParams(learning_rate=1e-3))
    sft.examples.add(messages=[user(text), assistant("a")])
    return [
        ("Sample", pb.SampleRequest(model=HUGE_MODEL, text=text, params=_params()), "text"),
        (
            "Sample",
            pb.SampleRequest(model=HUGE_MODEL, chat=pb.ChatPrompt(messages=[user(text)]), params=_params()),
            "chat.messages",
        ),
        ("Train", sft, "examples[0].messages"),
    ]


def test_health_and_another_model_answer_while_16_mib_requests_are_refused(server: Server) -> None:
    huge = _huge_requests()
    in_flight = [
        (getattr(server.stub, rpc).future(request, timeout=CALL_TIMEOUT), field)
        for rpc, request, field in huge
    ]
    # Their own channel, as another client would have: nothing queues behind the huge uploads client-side.
    with grpc.insecure_channel(server.proc.target) as channel:
        health = health_pb2_grpc.HealthStub(channel).Check(
            health_pb2.HealthCheckRequest(service=""), timeout=HEALTH_DEADLINE
        )
        assert health.status == health_pb2.HealthCheckResponse.SERVING
        other = trainer_service_pb2_grpc.TrainerServiceStub(channel).Sample(
            pb.SampleRequest(
                model=OTHER_MODEL,
                chat=pb.ChatPrompt(messages=[user("respond with yes")]),
                params=_params(seed=1),
            ),
            timeout=SAMPLE_DEADLINE,
        )
        assert other.sequences and other.sequences[0].token_ids
    for future, field in in_flight:
        with pytest.raises(grpc.RpcError) as refused:
            future.result()
        assert violated_fields(refused.value) == [field], refused.value.details()
        assert "cannot fit the model's context" in (refused.value.details() or "")
    # The refused model is untouched and serves normally.
    assert sample_chat(server.stub, HUGE_MODEL, "respond with yes", n=1).sequences


@pytest.mark.parametrize(
    ("params", "field"),
    [
        (_params(top_logprobs=21), "params.top_logprobs"),
        (_params(top_logprobs=2_000_000), "params.top_logprobs"),
        (_params(stop=[f"stop {i}" for i in range(10_000)]), "params.stop"),
        (_params(stop=["x" * 257]), "params.stop"),
        (_params(stop_token_ids=[1] * 10_000), "params.stop_token_ids"),
    ],
    ids=["top_logprobs_21", "top_logprobs_2M", "10k_stop_strings", "long_stop_string", "10k_stop_token_ids"],
)
def test_unbounded_sampling_lists_are_refused(
    server: Server, params: types_pb2.SamplingParams, field: str
) -> None:
    with pytest.raises(grpc.RpcError) as refused:
        server.stub.Sample(
            pb.SampleRequest(model=OTHER_MODEL, text="hello", params=params), timeout=CALL_TIMEOUT
        )
    assert violated_fields(refused.value) == [field], refused.value.details()


def test_the_caps_themselves_are_accepted(server: Server) -> None:
    """At the caps a Sample works: 20 top logprobs, 16 stop strings of 256 bytes."""
    response = server.stub.Sample(
        pb.SampleRequest(
            model=OTHER_MODEL,
            text="hello",
            params=_params(top_logprobs=20, stop=[f"{i:03d}" + "z" * 253 for i in range(16)], seed=3),
        ),
        timeout=CALL_TIMEOUT,
    )
    (sequence,) = response.sequences
    assert [len(top.token_ids) for top in sequence.top_logprobs] == [20] * len(sequence.token_ids)
