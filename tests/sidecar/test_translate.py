"""The sidecar's protocol layer as plain functions: request checks, response and chunk shapes."""

from __future__ import annotations

import json
from typing import Any

import grpc
import pytest
from google.rpc import error_details_pb2
from pydantic import ValidationError
from stream_replay import collected, replayed

from tinkerrpc import (
    InvalidArgumentError,
    Message,
    NotFoundError,
    Sample,
    SamplingOptions,
    ToolCall,
    TopLogprob,
    UnavailableError,
)
from tinkerrpc.contract.sampling import SIDECAR_CHAT_MAX_TOKENS
from tinkerrpc_server.sidecar import chat, completions, generate, models, sample_output
from tinkerrpc_server.sidecar.chat_protocol import ChatCompletionRequest
from tinkerrpc_server.sidecar.completions_protocol import CompletionRequest
from tinkerrpc_server.sidecar.errors import OpenAIError, from_rpc_error, param_from_loc
from tinkerrpc_server.sidecar.generate_protocol import GenerateRequest
from tinkerrpc_server.sidecar.metrics import SidecarMetrics

pytestmark = pytest.mark.unit


def chat_request(**fields: Any) -> ChatCompletionRequest:
    body: dict[str, Any] = {"model": "run", "messages": [{"role": "user", "content": "hi"}], **fields}
    return ChatCompletionRequest.model_validate(body)


def refused_param(request: ChatCompletionRequest) -> str | None:
    with pytest.raises(OpenAIError) as caught:
        chat.chat_sample_args(request, models.parse_model_id(request.model))
    assert caught.value.status == 400
    return caught.value.param


def make_sample(
    texts: list[str],
    *,
    content: str | None = None,
    tool_calls: tuple[ToolCall, ...] = (),
    stop_reason: str = "stop",
    version: int = 3,
) -> Sample:
    tokens = tuple(100 + i for i in range(len(texts)))
    return Sample(
        tokens=tokens,
        logprobs=tuple(-0.5 * (i + 1) for i in range(len(texts))),
        text="".join(texts),
        message=Message.assistant(content if content is not None else "".join(texts), tool_calls),
        stop_reason=stop_reason,  # type: ignore[arg-type]
        policy_version=version,
        prompt_token_ids=(1, 2, 3),
        top_logprobs=tuple((TopLogprob(t, -0.1, f"alt{t}"), TopLogprob(7, -2.0, "seven")) for t in tokens),
        token_texts=tuple(texts),
    )


def test_model_ids_parse_latest_and_pinned_versions() -> None:
    assert models.parse_model_id("my-run") == models.ModelRef("my-run", "my-run", None)
    assert models.parse_model_id("my-run@4") == models.ModelRef("my-run@4", "my-run", 4)
    for bad in ("my-run@", "my-run@x", "my-run@-1", "@3", "a b"):
        with pytest.raises(OpenAIError) as caught:
            models.parse_model_id(bad)
        assert (caught.value.status, caught.value.code, caught.value.param) == (
            404,
            "model_not_found",
            "model",
        )


def test_chat_parameters_map_onto_sample_arguments() -> None:
    request = chat_request(
        model="run@2",
        n=3,
        temperature=0.0,
        top_p=0.9,
        top_k=-1,
        max_completion_tokens=7,
        stop="END",
        seed=11,
        logprobs=True,
        top_logprobs=2,
        stop_token_ids=[5],
        ignore_eos=True,
        user="ignored",
        metadata={"k": "v"},
        store=False,
        parallel_tool_calls=True,
        service_tier="auto",
        response_format={"type": "text"},
    )
    args = chat.chat_sample_args(request, models.parse_model_id(request.model))
    assert vars(args) == {
        "n": 3,
        "max_tokens": 7,
        "temperature": 0.0,
        "top_p": 0.9,
        "top_k": 0,
        "stop": ["END"],
        "stop_token_ids": [5],
        "seed": 11,
        "policy_version": 2,
        "tools": None,
        "top_logprobs": 2,
        "include_prompt_logprobs": False,
        "prompt_top_logprobs": 0,
        "return_token_texts": True,
        "ignore_default_stops": True,
        "min_tokens": 0,
        "skip_special_tokens": True,
        "spaces_between_special_tokens": True,
        "return_prompt_text": False,
        "enable_thinking": None,
        "force_tool_call": False,
        "parallel_tool_calls": True,
    }
    assert chat.chat_sample_args(chat_request(), models.parse_model_id("run")).max_tokens == (
        SIDECAR_CHAT_MAX_TOKENS
    )


def test_parameters_the_sampler_cannot_honour_are_refused_by_name() -> None:
    cases: dict[str, dict[str, Any]] = {
        "presence_penalty": {"presence_penalty": 0.5},
        "frequency_penalty": {"frequency_penalty": -1.0},
        "logit_bias": {"logit_bias": {"5": 10}},
        "response_format": {"response_format": {"type": "json_object"}},
        "audio": {"audio": {"voice": "alloy", "format": "wav"}},
        "modalities": {"modalities": ["text", "audio"]},
        "tool_choice": {"tool_choice": "required"},
        "top_logprobs": {"top_logprobs": 3},
        "stop": {"stop": ["ok", ""]},
        "stream_options": {"stream_options": {"include_usage": True}},
        "max_completion_tokens": {"max_tokens": 5, "max_completion_tokens": 6},
        "stop_token_ids": {"stop_token_ids": [-3]},
    }
    for param, fields in cases.items():
        assert refused_param(chat_request(**fields)) == param, param
    # Neutral values of the same parameters are fine.
    chat.chat_sample_args(
        chat_request(presence_penalty=0, frequency_penalty=0.0, logit_bias={}, modalities=["text"]),
        models.parse_model_id("run"),
    )


def test_generate_parameters_map_onto_sample_arguments_and_server_errors_onto_its_names() -> None:
    """vLLM's sampling_params as the renderers client sends them (its stop ids, logprobs=1, special
    tokens kept) become the Sample call's arguments; the server's names for them become this route's."""
    request = GenerateRequest.model_validate(
        {
            "model": "run@3",
            "token_ids": [1, 2],
            "sampling_params": {
                "temperature": 0.7,
                "top_p": 0.9,
                "top_k": -1,
                "max_tokens": 9,
                "seed": 5,
                "stop_token_ids": [2],
                "logprobs": 1,
                "skip_special_tokens": False,
                "prompt_logprobs": 0,
                "repetition_penalty": 1.0,
                "min_p": 0.0,
            },
            "cache_salt": "salt",
        }
    )
    args = generate.generate_sample_args(request, models.parse_model_id(request.model))
    assert args == SamplingOptions(
        max_tokens=9,
        temperature=0.7,
        top_p=0.9,
        seed=5,
        policy_version=3,
        top_logprobs=1,
        return_token_texts=True,
        include_prompt_logprobs=True,
        stop=[],
        stop_token_ids=[2],
        skip_special_tokens=False,
    )
    unset = GenerateRequest.model_validate({"model": "run", "token_ids": [1], "sampling_params": {}})
    defaults = generate.generate_sample_args(unset, models.parse_model_id("run"))
    assert (defaults.max_tokens, defaults.temperature, defaults.top_logprobs, defaults.policy_version) == (
        SIDECAR_CHAT_MAX_TOKENS,
        1.0,
        0,
        None,
    )
    renamed = {
        "prompt": "token_ids",
        "prompt[3]": "token_ids[3]",
        "max_tokens": "sampling_params.max_tokens",
        "stop_token_ids": "sampling_params.stop_token_ids",
        "top_logprobs": "sampling_params.logprobs",
        "model": "model",
        None: None,
    }
    for server_name, route_name in renamed.items():
        assert generate.generate_param(server_name) == route_name, server_name


def test_schema_violations_name_the_parameter() -> None:
    cases = {
        "n": {"n": 17},
        "temperature": {"temperature": 2.5},
        "top_logprobs": {"logprobs": True, "top_logprobs": 21},
        "messages[0].role": {"messages": [{"role": "narrator", "content": "x"}]},
        "tools[0].type": {"tools": [{"type": "web_search", "function": {"name": "f"}}]},
        "messages[0].mystery_knob": {"messages": [{"role": "user", "content": "x", "mystery_knob": 1}]},
    }
    for param, fields in cases.items():
        with pytest.raises(ValidationError) as caught:
            chat_request(**fields)
        assert param_from_loc(("body", *caught.value.errors()[0]["loc"])) == param, param


def test_messages_are_checked_per_role_and_flattened_for_the_sdk() -> None:
    request = chat_request(
        messages=[
            {
                "role": "developer",
                "content": [{"type": "text", "text": "be "}, {"type": "text", "text": "brief"}],
            },
            {"role": "user", "content": "weather?"},
            {
                "role": "assistant",
                "content": None,
                "tool_calls": [
                    {
                        "id": "c1",
                        "type": "function",
                        "function": {"name": "get", "arguments": '{"city": "Oslo"}'},
                    }
                ],
            },
            {"role": "tool", "tool_call_id": "c1", "content": "sunny"},
        ]
    )
    converted = chat.chat_messages(request)
    assert converted[0] == {"role": "system", "content": "be brief"}
    assert converted[2]["tool_calls"][0]["function"] == {"name": "get", "arguments": '{"city": "Oslo"}'}
    assert converted[3] == {"role": "tool", "content": "sunny", "tool_call_id": "c1"}
    assert [Message.from_openai(m).role for m in converted] == ["system", "user", "assistant", "tool"]

    bad_messages = {
        "messages[0].tool_call_id": [{"role": "tool", "content": "x"}],
        "messages[0].content[1]": [
            {
                "role": "user",
                "content": [{"type": "text", "text": "a"}, {"type": "image_url", "image_url": {}}],
            }
        ],
        "messages[0]": [{"role": "user", "content": None}],
    }
    for param, messages in bad_messages.items():
        with pytest.raises(OpenAIError) as caught:
            chat.chat_messages(chat_request(messages=messages))
        assert caught.value.param == param


def test_tool_choice_none_withholds_the_tools() -> None:
    tools = [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    ref = models.parse_model_id("run")
    offered = chat.chat_sample_args(chat_request(tools=tools, tool_choice="auto"), ref).tools
    assert offered == [{"type": "function", "function": {"name": "get", "parameters": {"type": "object"}}}]
    assert chat.chat_sample_args(chat_request(tools=tools, tool_choice="none"), ref).tools is None


def test_completion_prompts_accept_one_text_or_token_prompt() -> None:
    def prompt_of(prompt: Any) -> Any:
        return completions.completion_prompt(CompletionRequest(model="run", prompt=prompt))

    assert prompt_of("hello") == "hello"
    assert prompt_of([4, 5, 6]) == [4, 5, 6]
    assert prompt_of(["hello"]) == "hello"
    assert prompt_of([[4, 5]]) == [4, 5]
    for bad in (["a", "b"], [[1], [2]], "", []):
        with pytest.raises(OpenAIError) as caught:
            prompt_of(bad)
        assert caught.value.param == "prompt"
    refused: tuple[tuple[dict[str, Any], str], ...] = (
        ({"echo": True, "logprobs": 1}, "echo"),
        ({"suffix": "x"}, "suffix"),
        ({"best_of": 3}, "best_of"),
    )
    for fields, param in refused:
        with pytest.raises(OpenAIError) as caught:
            completions.completion_sample_args(
                CompletionRequest(model="run", prompt="p", **fields), models.parse_model_id("run")
            )
        assert caught.value.param == param
    args = completions.completion_sample_args(
        CompletionRequest(model="run", prompt="p", logprobs=2), models.parse_model_id("run")
    )
    assert (args.max_tokens, args.top_logprobs, args.tools) == (16, 2, None)


def test_chat_completion_carries_rl_fields_and_openai_logprobs() -> None:
    request = chat_request(model="run", n=2, logprobs=True, top_logprobs=2, stop=["!"])
    ref = models.parse_model_id(request.model)
    args = chat.chat_sample_args(request, ref)
    samples = [make_sample(["a", "b!", "c"]), make_sample(["x", "y"], stop_reason="length")]
    body = chat.build_chat_completion(request, ref, args, samples, created=123).model_dump(mode="json")
    assert body["id"].startswith("chatcmpl-") and body["object"] == "chat.completion"
    assert (body["model"], body["policy_version"], body["prompt_token_ids"]) == ("run@3", 3, [1, 2, 3])
    first, second = body["choices"]
    # The stop string is cut from the text but its token stays in token_ids.
    assert (first["message"]["content"], first["finish_reason"], first["token_ids"]) == (
        "ab",
        "stop",
        [100, 101, 102],
    )
    assert (second["message"]["content"], second["finish_reason"]) == ("xy", "length")
    entry = first["logprobs"]["content"][1]
    assert entry == {
        "token": "b!",
        "logprob": -1.0,
        "bytes": list(b"b!"),
        "top_logprobs": [
            {"token": "alt101", "logprob": -0.1, "bytes": list(b"alt101")},
            {"token": "seven", "logprob": -2.0, "bytes": list(b"seven")},
        ],
    }
    assert body["usage"] == {"prompt_tokens": 3, "completion_tokens": 5, "total_tokens": 8}

    as_ids = chat_request(model="run", logprobs=True, top_logprobs=1, return_tokens_as_token_ids=True)
    body = chat.build_chat_completion(as_ids, ref, args, samples[:1], created=1).model_dump(mode="json")
    assert [e["token"] for e in body["choices"][0]["logprobs"]["content"]] == [
        "token_id:100",
        "token_id:101",
        "token_id:102",
    ]


def test_tool_calls_become_openai_tool_calls_with_finish_reason_tool_calls() -> None:
    # The server names every sampled call (tests/sidecar/test_sidecar_tool_calls.py); the id passes through.
    call = ToolCall(id="call_7", name="get_weather", arguments='{"city": "Paris"}')
    sample = make_sample(["<tool_call>", "...", "</tool_call>"], content="", tool_calls=(call,))
    request = chat_request()
    ref = models.parse_model_id("run")
    args = chat.chat_sample_args(request, ref)
    choice = chat.build_chat_completion(request, ref, args, [sample], 1).model_dump(mode="json")["choices"][0]
    assert choice["finish_reason"] == "tool_calls"
    assert choice["message"]["content"] is None
    (tool_call,) = choice["message"]["tool_calls"]
    assert tool_call["id"] == "call_7" and tool_call["type"] == "function"
    assert tool_call["function"] == {"name": "get_weather", "arguments": '{"city": "Paris"}'}


def test_stream_chunks_interleave_choices_and_reassemble_the_completion() -> None:
    request = chat_request(n=2, stream=True, stream_options={"include_usage": True}, logprobs=True)
    ref = models.parse_model_id("run")
    args = chat.chat_sample_args(request, ref)
    call = ToolCall(id="call_1", name="f", arguments="{}")
    samples = [make_sample(["He", "llo", "."]), make_sample(["Hi"], content="Hi", tool_calls=(call,))]
    chunks = [
        c.model_dump(mode="json", exclude_none=True)
        for c in collected(chat.chat_stream_chunks(request, ref, args, replayed(samples), 5))
    ]
    assert len({c["id"] for c in chunks}) == 1 and all(c["model"] == "run@3" for c in chunks)
    assert chunks[0]["prompt_token_ids"] == [1, 2, 3]
    assert [c["choices"][0]["delta"].get("role") for c in chunks[:2]] == ["assistant", "assistant"]
    assert [c["choices"][0].get("policy_version") for c in chunks[:2]] == [3, 3]
    indexes = [
        c["choices"][0]["index"]
        for c in chunks[2:]
        if c["choices"] and "token_ids" in c["choices"][0]["delta"]
    ]
    assert indexes == [0, 1, 0, 0]  # tokens interleaved by position as they come
    text = {0: "", 1: ""}
    token_ids: dict[int, list[int]] = {0: [], 1: []}
    keys: dict[int, str] = {}
    finish: dict[int, str] = {}
    for c in chunks:
        for choice in c["choices"]:
            text[choice["index"]] += choice["delta"].get("content", "")
            token_ids[choice["index"]] += choice["delta"].get("token_ids", [])
            keys[choice["index"]] = choice["delta"].get("sample_key", keys.get(choice["index"]))
            if "finish_reason" in choice:
                finish[choice["index"]] = choice["finish_reason"]
    assert text == {0: "Hello.", 1: "Hi"}
    assert token_ids == {0: [100, 101, 102], 1: [100]}
    assert finish == {0: "stop", 1: "tool_calls"}
    tool_chunk = next(c for c in chunks if c["choices"] and "tool_calls" in c["choices"][0]["delta"])
    assert tool_chunk["choices"][0]["delta"]["tool_calls"][0]["function"]["name"] == "f"
    assert chunks[-1]["choices"] == [] and chunks[-1]["usage"]["completion_tokens"] == 4


def test_completion_uses_the_legacy_logprobs_shape() -> None:
    request = CompletionRequest(
        model="run@3", prompt="p", logprobs=1, stream=True, stream_options={"include_usage": True}
    )
    ref = models.parse_model_id(request.model)
    args = completions.completion_sample_args(request, ref)
    sample = make_sample(["ab", "c", "de"])
    body = completions.build_completion(request, ref, args, [sample], 9).model_dump(mode="json")
    assert body["object"] == "text_completion" and body["id"].startswith("cmpl-")
    logprobs = body["choices"][0]["logprobs"]
    assert logprobs["tokens"] == ["ab", "c", "de"]
    assert logprobs["token_logprobs"] == [-0.5, -1.0, -1.5]
    assert logprobs["text_offset"] == [0, 2, 3]
    assert logprobs["top_logprobs"][0] == {"alt100": -0.1, "seven": -2.0}
    chunks = collected(completions.completion_stream_chunks(request, ref, args, replayed([sample]), 9))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == "abcde"
    assert [c.choices[0].logprobs.text_offset for c in chunks if c.choices and c.choices[0].logprobs] == [
        [0],
        [2],
        [3],
    ]
    assert chunks[-1].choices == [] and chunks[-1].usage == sample_output.usage_of([sample])


def test_grpc_failures_map_to_http_in_one_place() -> None:
    unavailable = from_rpc_error(UnavailableError(grpc.StatusCode.UNAVAILABLE, "down"), "run")
    assert (unavailable.status, unavailable.should_retry) == (503, True)
    missing = from_rpc_error(NotFoundError(grpc.StatusCode.NOT_FOUND, "no model"), "run@9")
    assert (missing.status, missing.code, missing.should_retry) == (404, "model_not_found", False)
    violation = error_details_pb2.BadRequest(
        field_violations=[
            error_details_pb2.BadRequest.FieldViolation(field="params.max_tokens", description="big")
        ]
    )
    invalid = from_rpc_error(
        InvalidArgumentError(grpc.StatusCode.INVALID_ARGUMENT, "bad", [violation]), "run"
    )
    assert (invalid.status, invalid.param, invalid.should_retry) == (400, "max_tokens", False)
    response = invalid.to_response()
    assert response.headers["x-should-retry"] == "false"
    assert json.loads(bytes(response.body))["error"]["param"] == "max_tokens"


def test_metrics_render_prometheus_text() -> None:
    metrics = SidecarMetrics()
    metrics.requests.labels("/v1/models", "200").inc()
    metrics.requests.labels("/v1/models", "200").inc()
    metrics.latency.labels("/v1/models").observe(0.2)
    metrics.latency.labels("/v1/models").observe(700.0)
    text = metrics.render()
    assert 'tinkerrpc_sidecar_requests_total{route="/v1/models",status="200"} 2' in text
    assert 'tinkerrpc_sidecar_request_duration_seconds_bucket{le="0.25",route="/v1/models"} 1' in text
    assert 'tinkerrpc_sidecar_request_duration_seconds_bucket{le="+Inf",route="/v1/models"} 2' in text
    assert 'tinkerrpc_sidecar_request_duration_seconds_count{route="/v1/models"} 2' in text
    assert "# TYPE tinkerrpc_sidecar_errors_total counter" in text
