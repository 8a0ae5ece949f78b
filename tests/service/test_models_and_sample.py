"""CreateModel / GetModel / ListModels / DeleteModel and Sample against a real server + engine."""

from __future__ import annotations

import grpc
import pytest
from svc import (
    CALL_TIMEOUT,
    TINY,
    Server,
    create_model,
    resource_info,
    sample_chat,
    user,
    violated_fields,
)

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2

pytestmark = pytest.mark.process


@pytest.fixture(scope="module")
def model(server: Server) -> types_pb2.ModelInfo:
    return create_model(server.stub, "sampling-model")


def test_created_model_is_at_version_zero_and_sampleable(server: Server, model: types_pb2.ModelInfo) -> None:
    assert model.policy_version == 0
    assert list(model.sampleable_versions) == [0]
    assert model.renderer == "qwen3"
    assert model.lora.rank == 8 and model.lora.train_unembed
    assert model.vocab_size > 256 and model.max_context_length > 0
    assert model.tinker_run_id
    fetched = server.stub.GetModel(pb.GetModelRequest(name="sampling-model")).model
    assert fetched == model
    names = [m.name for m in server.stub.ListModels(pb.ListModelsRequest()).models]
    assert "sampling-model" in names


def test_model_name_errors(server: Server, model: types_pb2.ModelInfo) -> None:
    with pytest.raises(grpc.RpcError) as err:
        create_model(server.stub, "sampling-model")
    assert err.value.code() == grpc.StatusCode.ALREADY_EXISTS
    with pytest.raises(grpc.RpcError) as err:
        server.stub.CreateModel(pb.CreateModelRequest(name="-bad name", base_model=TINY))
    assert violated_fields(err.value) == ["name"]
    with pytest.raises(grpc.RpcError) as err:
        server.stub.CreateModel(
            pb.CreateModelRequest(name="x", base_model="no/such-model"), timeout=CALL_TIMEOUT
        )
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert resource_info(err.value).resource_name == "no/such-model"
    with pytest.raises(grpc.RpcError) as err:
        server.stub.CreateModel(
            pb.CreateModelRequest(name="y", base_model=TINY, renderer="no_such_renderer"),
            timeout=CALL_TIMEOUT,
        )
    assert violated_fields(err.value) == ["renderer"]
    names = {m.name for m in server.stub.ListModels(pb.ListModelsRequest()).models}
    assert not names & {"x", "y", "-bad name"}
    for call in (
        lambda: server.stub.GetModel(pb.GetModelRequest(name="missing")),
        lambda: server.stub.DeleteModel(pb.DeleteModelRequest(name="missing")),
        lambda: sample_chat(server.stub, "missing", "hi"),
    ):
        with pytest.raises(grpc.RpcError) as err:
            call()
        assert err.value.code() == grpc.StatusCode.NOT_FOUND
        info = resource_info(err.value)
        assert info.resource_type == "tinkerrpc.v1.Model" and info.resource_name == "missing"


def test_delete_model_removes_it_and_frees_the_name(server: Server) -> None:
    create_model(server.stub, "short-lived")
    server.stub.DeleteModel(pb.DeleteModelRequest(name="short-lived"))
    with pytest.raises(grpc.RpcError) as err:
        server.stub.GetModel(pb.GetModelRequest(name="short-lived"))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert create_model(server.stub, "short-lived").policy_version == 0
    server.stub.DeleteModel(pb.DeleteModelRequest(name="short-lived"))


def test_sample_chat_returns_tokens_logprobs_text_message_and_version(
    server: Server, model: types_pb2.ModelInfo
) -> None:
    response = sample_chat(server.stub, model.name, "respond with yes", n=3, max_tokens=5)
    assert response.policy_version == 0 and response.model == model.name
    # The qwen3 renderer frames the prompt: it starts with <|im_start|>user and ends with the assistant header.
    assert len(response.prompt_token_ids) > 3
    assert len(response.sequences) == 3
    for sequence in response.sequences:
        assert 0 < len(sequence.token_ids) <= 5
        assert len(sequence.logprobs) == len(sequence.token_ids)
        assert all(lp <= 0 for lp in sequence.logprobs)
        assert sequence.policy_version == 0
        assert sequence.message.role == types_pb2.ROLE_ASSISTANT
        assert sequence.stop_reason in (types_pb2.STOP_REASON_STOP, types_pb2.STOP_REASON_LENGTH)
        if sequence.stop_reason == types_pb2.STOP_REASON_LENGTH:
            assert len(sequence.token_ids) == 5


def test_same_seed_same_tokens_and_token_prompt_matches_chat(
    server: Server, model: types_pb2.ModelInfo
) -> None:
    first = sample_chat(server.stub, model.name, "respond with no", n=2, max_tokens=6, seed=42)
    again = sample_chat(server.stub, model.name, "respond with no", n=2, max_tokens=6, seed=42)
    assert [list(s.token_ids) for s in first.sequences] == [list(s.token_ids) for s in again.sequences]
    by_tokens = server.stub.Sample(
        pb.SampleRequest(
            model=model.name,
            tokens=pb.TokenPrompt(token_ids=first.prompt_token_ids),
            params=types_pb2.SamplingParams(n=2, max_tokens=6, seed=42),
        )
    )
    assert list(by_tokens.prompt_token_ids) == list(first.prompt_token_ids)
    assert [list(s.token_ids) for s in by_tokens.sequences] == [list(s.token_ids) for s in first.sequences]


def test_text_prompt_has_no_template_and_token_texts_and_top_logprobs(
    server: Server, model: types_pb2.ModelInfo
) -> None:
    chat = sample_chat(server.stub, model.name, "hello world", n=1, max_tokens=1)
    response = server.stub.Sample(
        pb.SampleRequest(
            model=model.name,
            text="hello world",
            params=types_pb2.SamplingParams(
                max_tokens=3,
                seed=3,
                include_prompt_logprobs=True,
                top_logprobs=3,
                return_token_texts=True,
                ignore_default_stops=True,
            ),
        )
    )
    assert len(response.prompt_token_ids) < len(chat.prompt_token_ids)
    assert len(response.prompt_logprobs) == len(response.prompt_token_ids)
    assert response.prompt_logprobs[0] != response.prompt_logprobs[0]  # NaN: position 0 has no context
    (sequence,) = response.sequences
    assert len(sequence.token_ids) == 3 and sequence.stop_reason == types_pb2.STOP_REASON_LENGTH
    assert "".join(sequence.token_texts) == sequence.text
    assert len(sequence.top_logprobs) == 3
    for top, lp in zip(sequence.top_logprobs, sequence.logprobs, strict=True):
        assert len(top.token_ids) == 3 and len(top.token_texts) == 3
        assert list(top.logprobs) == sorted(top.logprobs, reverse=True)
        # The sampled token is at most as likely as the best alternative.
        assert lp <= top.logprobs[0] + 1e-4


def test_stop_token_ids_end_the_completion(server: Server, model: types_pb2.ModelInfo) -> None:
    free = sample_chat(server.stub, model.name, "say something", n=1, max_tokens=8, seed=5)
    tokens = list(free.sequences[0].token_ids)
    stop_at = tokens[2]
    stopped = server.stub.Sample(
        pb.SampleRequest(
            model=model.name,
            chat=pb.ChatPrompt(messages=[user("say something")]),
            params=types_pb2.SamplingParams(n=1, max_tokens=8, seed=5, stop_token_ids=[stop_at]),
        )
    )
    cut = list(stopped.sequences[0].token_ids)
    assert cut == tokens[: tokens.index(stop_at) + 1]
    assert stopped.sequences[0].stop_reason == types_pb2.STOP_REASON_STOP


def test_sample_rejects_bad_input(server: Server, model: types_pb2.ModelInfo) -> None:
    cases = [
        (types_pb2.SamplingParams(max_tokens=0), "params.max_tokens"),
        (types_pb2.SamplingParams(max_tokens=2, top_p=1.5), "params.top_p"),
        (types_pb2.SamplingParams(max_tokens=2, temperature=-1), "params.temperature"),
        (types_pb2.SamplingParams(max_tokens=2, top_k=-2), "params.top_k"),
        (types_pb2.SamplingParams(max_tokens=10**6), "params.max_tokens"),
    ]
    for params, field in cases:
        with pytest.raises(grpc.RpcError) as err:
            server.stub.Sample(pb.SampleRequest(model=model.name, text="hi", params=params))
        assert violated_fields(err.value) == [field]
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Sample(
            pb.SampleRequest(
                model=model.name,
                tokens=pb.TokenPrompt(token_ids=[1, model.vocab_size]),
                params=types_pb2.SamplingParams(max_tokens=1),
            )
        )
    assert violated_fields(err.value) == ["tokens.token_ids"]
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Sample(pb.SampleRequest(model=model.name, params=types_pb2.SamplingParams(max_tokens=1)))
    assert violated_fields(err.value) == ["prompt"]
    with pytest.raises(grpc.RpcError) as err:
        sample_chat(server.stub, model.name, "hi", version=99)
    assert err.value.code() == grpc.StatusCode.NOT_FOUND
    assert resource_info(err.value).resource_name == f"{model.name}@99"


def test_tool_calls_in_history_render_and_bad_tool_json_is_rejected(
    server: Server, model: types_pb2.ModelInfo
) -> None:
    call = types_pb2.ToolCall(id="c1", name="lookup", arguments_json='{"q": "x"}')
    messages = [
        user("find x"),
        types_pb2.Message(role=types_pb2.ROLE_ASSISTANT, tool_calls=[call]),
        types_pb2.Message(role=types_pb2.ROLE_TOOL, content="x is 1", tool_call_id="c1"),
    ]
    tool = types_pb2.Tool(name="lookup", description="look up", parameters_json='{"type": "object"}')
    with_tools = server.stub.Sample(
        pb.SampleRequest(
            model=model.name,
            chat=pb.ChatPrompt(messages=messages, tools=[tool]),
            params=types_pb2.SamplingParams(max_tokens=2, seed=1),
        )
    )
    plain = sample_chat(server.stub, model.name, "find x", n=1, max_tokens=1)
    assert len(with_tools.prompt_token_ids) > len(plain.prompt_token_ids) + 10
    bad = types_pb2.ToolCall(id="c1", name="lookup", arguments_json="{not json")
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Sample(
            pb.SampleRequest(
                model=model.name,
                chat=pb.ChatPrompt(
                    messages=[user("a"), types_pb2.Message(role=types_pb2.ROLE_ASSISTANT, tool_calls=[bad])]
                ),
                params=types_pb2.SamplingParams(max_tokens=1),
            )
        )
    assert violated_fields(err.value) == ["chat.messages[1].tool_calls[0].arguments_json"]
    with pytest.raises(grpc.RpcError) as err:
        server.stub.Sample(
            pb.SampleRequest(
                model=model.name,
                chat=pb.ChatPrompt(messages=[types_pb2.Message(content="no role")]),
                params=types_pb2.SamplingParams(max_tokens=1),
            )
        )
    assert violated_fields(err.value) == ["chat.messages[0].role"]
