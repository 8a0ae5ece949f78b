"""Sample's request checks of service/validation.py in-process: each malformed prompt, tool JSON or
sampling parameter is a field violation naming it (and only it), and values within their bounds pass
(test_validation.py: the other requests)."""

from __future__ import annotations

import pytest
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

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server import bounded_json
from tinkerrpc_server.service import validation

pytestmark = pytest.mark.unit


def _chat(*messages: types_pb2.Message, tools: tuple[str, ...] = ()) -> pb.SampleRequest:
    request = pb.SampleRequest(model="m", chat=pb.ChatPrompt(messages=messages))
    for name in tools:
        request.chat.tools.add(name=name, parameters_json="{}")
    return request


def _forced(request: pb.SampleRequest, name: str) -> pb.SampleRequest:
    request.chat.forced_tool_call.function_name = name
    return request


USER = message(types_pb2.ROLE_USER)


def _calling(arguments_json: str) -> types_pb2.Message:
    return types_pb2.Message(
        role=types_pb2.ROLE_ASSISTANT,
        tool_calls=[types_pb2.ToolCall(name="f", arguments_json=arguments_json)],
    )


def _with_tool(request: pb.SampleRequest, parameters_json: str) -> pb.SampleRequest:
    request.chat.tools.add(name="f", parameters_json=parameters_json)
    return request


@pytest.mark.parametrize(
    ("text", "reason"),
    [
        ('{"a": 1' + "0" * 5000 + "}", "a number of 5001 characters: at most 100"),
        ('{"a": -1' + "0" * 99 + "}", "a number of 101 characters: at most 100"),
        ('{"a": 0.' + "1" * 200 + "}", "a number of 202 characters: at most 100"),
        ('{"a": 1e400}', "1e400 is out of the range of a double"),
        ('{"a": NaN}', "NaN is not a JSON number"),
        ('{"a": [Infinity]}', "Infinity is not a JSON number"),
        ('{"a": -Infinity}', "-Infinity is not a JSON number"),
        ("[" * 20_000, "nested too deeply: more than 64 levels"),
        ('{"a": ' * 65 + "1" + "}" * 65, "nested too deeply: more than 64 levels"),
        ("[" * 64 + "]" * 64, "got an array"),  # 64 levels are within the bound
        ("{", "invalid JSON at character 1"),
        ("[1]", "got an array"),
        ("null", "got null"),
    ],
)
def test_tool_json_is_refused_with_its_reason(text: str, reason: str) -> None:
    with pytest.raises(bounded_json.BoundedJsonError) as err:
        bounded_json.parse_json_object(text)
    assert str(err.value) == reason


def test_tool_json_within_its_bounds_parses() -> None:
    assert bounded_json.parse_json_object("") == {}
    deepest = '{"a": ' * 63 + "[]" + "}" * 63  # 64 levels, the innermost array included
    assert bounded_json.parse_json_object(deepest)
    assert bounded_json.parse_json_object('{"n": -1' + "0" * 98 + ', "x": 1.5e308}') == {
        "n": -(10**98),
        "x": 1.5e308,
    }


@pytest.mark.parametrize(
    ("request_", "fields"),
    [
        (pb.SampleRequest(model="m"), ["prompt"]),
        (pb.SampleRequest(model="m", text=TOO_MUCH_TEXT), ["text"]),
        (_chat(), ["chat.messages"]),
        (_chat(message(types_pb2.ROLE_USER, TOO_MUCH_TEXT)), ["chat.messages"]),
        (_chat(types_pb2.Message(role=UNKNOWN_ROLE)), ["chat.messages[0].role"]),
        (_chat(USER, tools=("",)), ["chat.tools[0].name"]),
        (_chat(USER, _calling('{"a": NaN}')), ["chat.messages[1].tool_calls[0].arguments_json"]),
        (_chat(USER, _calling(LONG_INTEGER_JSON)), ["chat.messages[1].tool_calls[0].arguments_json"]),
        (_with_tool(_chat(USER), '{"minimum": 1e999}'), ["chat.tools[0].parameters_json"]),
        (_with_tool(_chat(USER), LONG_INTEGER_JSON), ["chat.tools[0].parameters_json"]),
        (_forced(_chat(USER), ""), ["chat.forced_tool_call"]),
        (_forced(_chat(USER, tools=("search",)), "other"), ["chat.forced_tool_call.function_name"]),
    ],
)
def test_prompt_violations(request_: pb.SampleRequest, fields: list[str]) -> None:
    assert violated(lambda: validation.check_prompt(request_, CONTEXT)) == fields


def test_prompt_token_violations() -> None:
    tokens = pb.SampleRequest(model="m", tokens=pb.TokenPrompt(token_ids=[1, VOCAB]))
    validation.check_prompt(tokens, CONTEXT)
    assert violated(lambda: validation.check_prompt_tokens(tokens, [1, VOCAB], VOCAB)) == ["tokens.token_ids"]
    assert violated(lambda: validation.check_prompt_tokens(_chat(USER), [], VOCAB)) == ["chat"]
    validation.check_prompt(_forced(_chat(USER, tools=("search",)), "search"), CONTEXT)
    validation.check_prompt_tokens(tokens, [1, 2], VOCAB)


def _params(**fields: object) -> types_pb2.SamplingParams:
    params = types_pb2.SamplingParams(max_tokens=8)
    for name, value in fields.items():
        if isinstance(value, list):
            getattr(params, name).extend(value)
        else:
            setattr(params, name, value)
    return params


@pytest.mark.parametrize(
    ("params", "prompt_length", "fields"),
    [
        (_params(n=-1), 4, ["params.n"]),
        (_params(n=LIMITS.max_sample_n + 1), 4, ["params.n"]),
        (_params(), CONTEXT, ["prompt", "params.max_tokens"]),
        (_params(max_tokens=0), 4, ["params.max_tokens"]),
        (_params(max_tokens=LIMITS.max_sample_tokens + 1), 4, ["params.max_tokens"]),
        (_params(max_tokens=30), CONTEXT - 20, ["params.max_tokens"]),
        (_params(temperature=1e-4), 4, ["params.temperature"]),
        (_params(temperature=101.0), 4, ["params.temperature"]),
        (_params(top_p=0.0), 4, ["params.top_p"]),
        (_params(top_p=1.5), 4, ["params.top_p"]),
        (_params(top_k=-1), 4, ["params.top_k"]),
        (_params(top_logprobs=validation.MAX_TOP_LOGPROBS + 1), 4, ["params.top_logprobs"]),
        (_params(stop_token_ids=[0] * (validation.MAX_STOP_TOKEN_IDS + 1)), 4, ["params.stop_token_ids"]),
        (_params(stop_token_ids=[VOCAB]), 4, ["params.stop_token_ids"]),
        (_params(stop=["x"] * (validation.MAX_STOP_STRINGS + 1)), 4, ["params.stop"]),
        (_params(stop=[""]), 4, ["params.stop"]),
        (_params(stop=["é" * validation.MAX_STOP_STRING_BYTES]), 4, ["params.stop"]),
        (_params(min_tokens=-1), 4, ["params.min_tokens"]),
        (_params(min_tokens=9), 4, ["params.min_tokens"]),
    ],
)
def test_sampling_param_violations(
    params: types_pb2.SamplingParams, prompt_length: int, fields: list[str]
) -> None:
    check = lambda: validation.check_sampling_params(params, prompt_length, VOCAB, CONTEXT, LIMITS)  # noqa: E731
    assert violated(check) == fields


def test_valid_sampling_params_pass() -> None:
    greedy = _params(n=LIMITS.max_sample_n, temperature=0.0, top_p=1.0, top_k=5, stop=["\n"], min_tokens=8)
    validation.check_sampling_params(greedy, CONTEXT - 8, VOCAB, CONTEXT, LIMITS)
