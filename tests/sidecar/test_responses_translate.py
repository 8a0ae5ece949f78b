"""The Responses API's conversions as plain functions: input items → chat messages, a sample →
output items and the replayed event sequence, and back to a trajectory turn in the SDK."""

from __future__ import annotations

from typing import Any

import pytest
from stream_replay import collected, replayed

from tinkerrpc import Message, Sample, ToolCall, Trajectory, messages_from_response_input
from tinkerrpc_server.sidecar import models, responses, responses_protocol
from tinkerrpc_server.sidecar.errors import OpenAIError

pytestmark = pytest.mark.unit


def request(**fields: Any) -> responses_protocol.ResponseRequest:
    return responses_protocol.ResponseRequest.model_validate({"model": "run", "input": "hi", **fields})


def tool_sample() -> Sample:
    call = ToolCall("call_7", "get_weather", '{"city": "Paris"}')
    texts = ["<tool_call>", '{"name": "get_weather"}', "</tool_call>", "<|im_end|>"]
    return Sample(
        tokens=(11, 12, 13, 14),
        logprobs=(-0.1, -0.2, -0.3, -0.4),
        text="".join(texts),
        message=Message.assistant("", [call]),
        stop_reason="stop",
        policy_version=2,
        prompt_token_ids=(1, 2),
        token_texts=tuple(texts),
    )


def test_input_items_become_the_chat_conversation() -> None:
    items = [
        {"role": "developer", "content": "Be brief."},
        {
            "role": "user",
            "content": [
                {"type": "input_text", "text": "Weather in "},
                {"type": "input_text", "text": "Paris?"},
            ],
        },
        {"type": "message", "role": "assistant", "content": [{"type": "output_text", "text": "Checking."}]},
        {"type": "function_call", "call_id": "c1", "name": "get_weather", "arguments": "{}"},
        {"type": "function_call", "call_id": "c2", "name": "get_time", "arguments": "{}"},
        {"type": "function_call_output", "call_id": "c1", "output": "sunny"},
    ]
    messages = messages_from_response_input(items, instructions="You are a bot.")
    assert [m.role for m in messages] == ["system", "system", "user", "assistant", "tool"]
    assert messages[2].content == "Weather in Paris?"
    assert messages[3].content == "Checking." and [c.id for c in messages[3].tool_calls] == ["c1", "c2"]
    assert (messages[4].tool_call_id, messages[4].content) == ("c1", "sunny")
    assert messages_from_response_input("hi") == [Message.user("hi")]
    assert responses.prompt_messages(request(input=items)) == [m.to_openai() for m in messages[1:]]


def test_unsupported_input_is_refused_by_name() -> None:
    cases: list[tuple[dict[str, Any], str]] = [
        ({"input": []}, "input"),
        ({"input": [{"type": "function_call_output", "output": "x"}]}, "input[0].call_id"),
        (
            {"input": [{"role": "user", "content": [{"type": "input_file", "file_id": "f"}]}]},
            "input[0].content[0].type",
        ),
    ]
    for fields, param in cases:
        with pytest.raises(OpenAIError) as caught:
            responses.prompt_messages(request(**fields))
        assert caught.value.param == param, fields
    with pytest.raises(OpenAIError) as caught:
        responses.sample_args(request(text={"format": {"type": "json_object"}}), models.parse_model_id("run"))
    assert caught.value.param == "text.format"


def test_sample_arguments_withhold_tools_under_tool_choice_none() -> None:
    tool = {"type": "function", "name": "get_weather", "parameters": {"type": "object"}}
    ref = models.parse_model_id("run@3")
    args = responses.sample_args(request(tools=[tool], max_output_tokens=9, top_logprobs=2), ref)
    assert args.tools == [
        {"type": "function", "function": {"name": "get_weather", "parameters": {"type": "object"}}}
    ]
    assert (args.n, args.max_tokens, args.top_logprobs, args.policy_version) == (1, 9, 2, 3)
    assert responses.sample_args(request(tools=[tool], tool_choice="none"), ref).tools is None


def test_a_tool_call_streams_as_function_call_events_and_trains_as_one_turn() -> None:
    sample = tool_sample()
    asked = request(include=[responses_protocol.LOGPROBS_INCLUDE])
    final = responses.build_response(asked, models.parse_model_id("run"), sample, 0, rl_fields=True)
    (item,) = final.output
    assert isinstance(item, responses_protocol.OutputFunctionCall) and item.call_id == "call_7"
    assert (final.status, final.model, item.token_ids, item.token_logprobs) == (
        "completed",
        "run@2",
        [11, 12, 13, 14],
        [-0.1, -0.2, -0.3, -0.4],
    )
    ref = models.parse_model_id("run")
    args = responses.sample_args(asked, ref)
    events = collected(responses.stream_events(asked, ref, args, replayed([sample]), 0))
    assert [e["type"] for e in events] == [
        "response.created",
        "response.in_progress",
        "response.output_item.added",
        "response.function_call_arguments.delta",
        "response.function_call_arguments.done",
        "response.output_item.done",
        "response.completed",
    ]
    # The opened item carries no RL fields and no arguments yet; the finished one carries both.
    assert "token_ids" not in events[2]["item"] and events[2]["item"]["arguments"] == ""
    assert events[5]["item"]["token_ids"] == [11, 12, 13, 14]
    dumped = final.model_dump(exclude_none=True)
    traj = Trajectory.from_openai_response("hi", dumped, reward=1.0)
    assert traj.turns[0] == sample.to_turn()
    assert traj.messages[-1].tool_calls == sample.message.tool_calls  # type: ignore[union-attr]
    without = responses.build_response(request(), models.parse_model_id("run"), sample, 0, rl_fields=False)
    with pytest.raises(ValueError, match="no token_ids"):
        Trajectory.from_openai_response("hi", without.model_dump(exclude_none=True))
