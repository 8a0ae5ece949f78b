"""The sidecar's request models and the sampling-options table against the contract
(tinkerrpc.contract): each endpoint's bounds and defaults are the contract's, and each sampling option
is the SDK's sample() keyword with its default, a real gRPC field and real sidecar fields
(test_contract.py checks the other layers' defaults and bounds)."""

from __future__ import annotations

import inspect
from typing import Any

import pytest
from pydantic import BaseModel

from tinkerrpc import _calls as calls
from tinkerrpc.contract import limits
from tinkerrpc.contract.sampling import (
    SAMPLING_OPTIONS,
    SIDECAR_CHAT_MAX_TOKENS,
    SIDECAR_COMPLETION_MAX_TOKENS,
)
from tinkerrpc.v1 import trainer_service_pb2 as service_pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.sidecar import (
    chat,
    chat_protocol,
    completions_protocol,
    generate,
    generate_protocol,
    responses,
    responses_protocol,
    sampling_args,
)
from tinkerrpc_server.sidecar.errors import OpenAIError
from tinkerrpc_server.sidecar.models import parse_model_id

pytestmark = pytest.mark.unit

# ---------------------------------------------------------------- the sidecar's request models

ENDPOINTS: dict[str, type[BaseModel]] = {
    "chat": chat_protocol.ChatCompletionRequest,
    "completions": completions_protocol.CompletionRequest,
    "responses": responses_protocol.ResponseRequest,
    "generate": generate_protocol.GenerateSamplingParams,
}


def _constraint(model: type[BaseModel], field: str, name: str) -> Any:
    found = [getattr(m, name) for m in model.model_fields[field].metadata if hasattr(m, name)]
    assert len(found) == 1, f"{model.__name__}.{field} has no {name} constraint"
    return found[0]


def test_the_sidecars_request_models_bound_fields_as_the_contract() -> None:
    for model in (
        chat_protocol.ChatCompletionRequest,
        completions_protocol.CompletionRequest,
        generate_protocol.GenerateSamplingParams,
    ):
        assert _constraint(model, "n", "le") == limits.SIDECAR_MAX_N
    assert _constraint(completions_protocol.CompletionRequest, "best_of", "le") == limits.SIDECAR_MAX_N
    for model in ENDPOINTS.values():
        assert _constraint(model, "temperature", "le") == limits.SIDECAR_MAX_TEMPERATURE
    for model, field in [
        (chat_protocol.ChatCompletionRequest, "top_logprobs"),
        (completions_protocol.CompletionRequest, "logprobs"),
        (responses_protocol.ResponseRequest, "top_logprobs"),
        (generate_protocol.GenerateSamplingParams, "logprobs"),
        (generate_protocol.GenerateSamplingParams, "prompt_logprobs"),
    ]:
        assert _constraint(model, field, "le") == limits.MAX_TOP_LOGPROBS
    assert (
        _constraint(generate_protocol.GenerateSamplingParams, "stop_token_ids", "max_length")
        == limits.MAX_STOP_TOKEN_IDS
    )
    for field in ("request_id", "cache_salt"):
        assert (
            _constraint(generate_protocol.GenerateRequest, field, "max_length")
            == limits.SIDECAR_MAX_TAG_CHARS
        )
    assert (
        completions_protocol.CompletionRequest.model_fields["max_tokens"].default
        == SIDECAR_COMPLETION_MAX_TOKENS
    )
    ref = parse_model_id("run")
    unset = [
        chat.chat_sample_args(
            chat_protocol.ChatCompletionRequest.model_validate(
                {"model": "run", "messages": [{"role": "user", "content": "hi"}]}
            ),
            ref,
        ),
        responses.sample_args(
            responses_protocol.ResponseRequest.model_validate({"model": "run", "input": "hi"}), ref
        ),
        generate.generate_sample_args(
            generate_protocol.GenerateRequest.model_validate(
                {"model": "run", "token_ids": [1], "sampling_params": {}}
            ),
            ref,
        ),
    ]
    assert [args.max_tokens for args in unset] == [SIDECAR_CHAT_MAX_TOKENS] * 3
    assert len(sampling_args.stop_list(["x"] * limits.MAX_STOP_STRINGS)) == limits.MAX_STOP_STRINGS
    with pytest.raises(OpenAIError):
        sampling_args.stop_list(["x"] * (limits.MAX_STOP_STRINGS + 1))


# ---------------------------------------------------------------- sampling options


def test_the_sdks_sample_defaults_are_the_tables() -> None:
    parameters = inspect.signature(calls.sample).parameters
    options = {name for name in parameters if name not in ("model", "prompt", "options", "timeout")}
    assert sorted(option.name for option in SAMPLING_OPTIONS) == sorted(options)
    assert {o.name: parameters[o.name].default for o in SAMPLING_OPTIONS} == {
        o.name: o.default for o in SAMPLING_OPTIONS
    }


def test_each_option_names_real_grpc_and_sidecar_fields() -> None:
    messages = {
        "SamplingParams": types_pb2.SamplingParams,
        "SampleRequest": service_pb.SampleRequest,
        "ChatPrompt": service_pb.ChatPrompt,
    }
    for option in SAMPLING_OPTIONS:
        message, field = option.grpc.split(".")
        assert field in messages[message].DESCRIPTOR.fields_by_name, option.grpc
        for place in option.sidecar:
            endpoint, *path = place.split(".")
            assert path[-1] in ENDPOINTS[endpoint].model_fields, place
    sampled = {f.name for f in types_pb2.SamplingParams.DESCRIPTOR.fields}
    assert sampled <= {option.grpc.split(".")[1] for option in SAMPLING_OPTIONS}
