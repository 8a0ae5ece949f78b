"""A tool call the model itself produces, through the official `openai` client.

The random tiny model never emits a well-formed tool call, so the `tool_agent` fixture first teaches one
through the public API (supervised steps on a single conversation: call get_weather for Paris, then answer
from the tool's result) until greedy decoding reproduces both turns. Greedy decoding of that policy
version is then deterministic, so the sidecar's answers at temperature 0 are known.
"""

from __future__ import annotations

import json
from typing import Any

import openai
import pytest
from openai.types.chat import ChatCompletion
from sidecar_support import ANSWER, ARGUMENTS, QUESTION, TOOL_RESULT, WEATHER_TOOL, Stack

import tinkerrpc

pytestmark = pytest.mark.process


def extra(response: Any, name: str) -> Any:
    return response.model_extra[name]


def ask(api: openai.OpenAI, model: str, messages: list[dict[str, Any]], **options: Any) -> ChatCompletion:
    return api.chat.completions.create(
        model=model, messages=messages, tools=[WEATHER_TOOL], temperature=0, max_tokens=40, **options
    )


def test_the_model_calls_the_tool_and_answers_from_its_result(stack: Stack, tool_agent: str) -> None:
    api = stack.openai()
    first = ask(api, tool_agent, [QUESTION], logprobs=True)
    (choice,) = first.choices
    assert choice.finish_reason == "tool_calls" and first.model == tool_agent
    assert choice.message.content is None
    (call,) = choice.message.tool_calls or []
    assert call.type == "function" and call.id.startswith("call_")
    assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
    # The call is what the model sampled: its tokens spell the Qwen3 tool-call markup, then end the turn.
    tokens = "".join(entry.token for entry in choice.logprobs.content or [])
    assert tokens.startswith("<tool_call>") and tokens.endswith("</tool_call><|im_end|>")
    assert len(extra(choice, "token_ids")) == len(choice.logprobs.content or [])

    # The agent runs the tool and hands the result back under the call's id.
    history = [
        QUESTION,
        choice.message.model_dump(exclude_none=True),
        {"role": "tool", "tool_call_id": call.id, "content": TOOL_RESULT},
    ]
    second = ask(api, tool_agent, history)
    (answer,) = second.choices
    assert answer.finish_reason == "stop" and answer.message.tool_calls is None
    assert answer.message.content == ANSWER
    # Greedy decoding of the first prompt calls the tool, so answering shows the result reached the model.
    assert len(extra(second, "prompt_token_ids")) > len(extra(first, "prompt_token_ids"))


def test_streamed_tool_call_reassembles_to_the_plain_one(stack: Stack, tool_agent: str) -> None:
    api = stack.openai()
    plain = ask(api, tool_agent, [QUESTION])
    with api.chat.completions.stream(
        model=tool_agent,
        messages=[QUESTION],  # type: ignore[list-item]
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        temperature=0,
        max_tokens=40,
        stream_options={"include_usage": True},
    ) as stream:
        deltas = [event.chunk for event in stream if event.type == "chunk"]
        streamed = stream.get_final_completion()
    (choice,) = streamed.choices
    (plain_choice,) = plain.choices
    assert choice.finish_reason == "tool_calls"
    (call,) = choice.message.tool_calls or []
    (plain_call,) = plain_choice.message.tool_calls or []
    assert (call.function.name, json.loads(call.function.arguments)) == ("get_weather", ARGUMENTS)
    assert call.function.arguments == plain_call.function.arguments
    assert not choice.message.content
    # The call arrives in one delta of its own, indexed, before the finish reason.
    tool_deltas = [c for c in deltas if c.choices and c.choices[0].delta.tool_calls]
    assert len(tool_deltas) == 1
    (delta_call,) = tool_deltas[0].choices[0].delta.tool_calls or []
    assert delta_call.index == 0 and delta_call.id == call.id and delta_call.type == "function"
    assert streamed.usage is not None and plain.usage is not None
    assert streamed.usage.completion_tokens == plain.usage.completion_tokens


def test_tool_call_rollouts_train_token_exact(stack: Stack, tool_agent: str) -> None:
    """A rollout with a tool round trip becomes a trajectory that trains, and the next call says so."""
    api = stack.openai()
    name, version = tool_agent.split("@")
    first = ask(api, tool_agent, [QUESTION], logprobs=True)
    call = first.choices[0].message
    tool_message = {"role": "tool", "tool_call_id": (call.tool_calls or [])[0].id, "content": TOOL_RESULT}
    second = ask(api, tool_agent, [QUESTION, call.model_dump(exclude_none=True), tool_message], logprobs=True)
    used_tool = (
        tinkerrpc.Trajectory.from_openai([QUESTION], first, reward=1.0, tools=[WEATHER_TOOL])
        .add_messages(tool_message)
        .add_openai(second)
    )
    assert [m.role for m in used_tool.messages] == ["user", "assistant", "tool", "assistant"]
    assert [t.policy_version for t in used_tool.turns] == [int(version)] * 2
    # Each sampled turn keeps exactly the tokens the sidecar reported.
    assert list(used_tool.turns[1].completion_token_ids) == extra(second.choices[0], "token_ids")
    assert list(used_tool.turns[1].prompt_token_ids) == extra(second, "prompt_token_ids")
    guessed = ask(api, tool_agent, [QUESTION], logprobs=True, tool_choice="none")
    no_tool = tinkerrpc.Trajectory.from_openai([QUESTION], guessed, reward=0.0)

    result = stack.client.model(name).train(
        [tinkerrpc.TrajectoryGroup([used_tool, no_tool])], learning_rate=1e-4
    )
    assert result.metrics.trajectories_used == 2 and result.policy_version > int(version)
    # Qwen3's template without thinking opens the generation prompt with an empty think block but drops
    # it from an earlier assistant turn, so the second prompt does not continue the first turn's
    # sequence: the round trip trains as one datum per turn (merging needs the renderer's extension
    # property), each its full sequence.
    first_turn, last_turn = used_tool.turns
    first_sequence = [*first_turn.prompt_token_ids, *first_turn.completion_token_ids]
    assert list(last_turn.prompt_token_ids[: len(first_sequence)]) != first_sequence
    sequence_lengths = [
        len(t.prompt_token_ids) + len(t.completion_token_ids) for t in (*used_tool.turns, *no_tool.turns)
    ]
    assert result.metrics.total_tokens == sum(sequence_lengths)
    after = ask(api, name, [QUESTION])
    assert after.model == f"{name}@{result.policy_version}"
    assert extra(after, "policy_version") == result.policy_version


def test_sdk_samples_name_each_tool_call(stack: Stack, tool_agent: str) -> None:
    """Qwen3's template carries no call ids; the server names each sampled call so a tool message can
    answer it, in the SDK as in the sidecar."""
    name, version = tool_agent.split("@")
    samples = stack.client.model(name).sample(
        [QUESTION], tools=[WEATHER_TOOL], n=2, max_tokens=40, temperature=0.0, policy_version=int(version)
    )
    calls = [call for sample in samples for call in sample.to_message().tool_calls]
    assert [(call.name, call.parsed_arguments()) for call in calls] == [("get_weather", ARGUMENTS)] * 2
    assert all(call.id.startswith("call_") for call in calls) and calls[0].id != calls[1].id


def test_streamed_chat_and_responses_rollouts_train_token_exact(stack: Stack, tool_agent: str) -> None:
    """The accumulated results of `.stream()` (chat and Responses) become trajectories that train.

    They need answers that end by themselves: openai's stream helpers refuse truncated ones.
    """
    api = stack.openai()
    name, version = tool_agent.split("@")
    plain_chat = ask(api, tool_agent, [QUESTION], logprobs=True)
    with api.chat.completions.stream(
        model=tool_agent,
        messages=[QUESTION],  # type: ignore[list-item]
        tools=[WEATHER_TOOL],  # type: ignore[list-item]
        temperature=0,
        max_tokens=40,
        logprobs=True,
    ) as stream:
        streamed_chat = stream.get_final_completion()
    from_chat = tinkerrpc.Trajectory.from_openai([QUESTION], streamed_chat, reward=1.0, tools=[WEATHER_TOOL])
    assert list(from_chat.turns[0].completion_token_ids) == extra(plain_chat.choices[0], "token_ids")
    assert list(from_chat.turns[0].prompt_token_ids) == extra(plain_chat, "prompt_token_ids")
    assert from_chat.messages[-1].tool_calls[0].name == "get_weather"

    responses_tool = {"type": "function", **WEATHER_TOOL["function"]}
    request: dict[str, Any] = {
        "model": tool_agent,
        "input": [QUESTION],
        "tools": [responses_tool],
        "temperature": 0,
        "max_output_tokens": 40,
        "include": ["message.output_text.logprobs"],
    }
    plain_response = api.responses.create(**request)
    with api.responses.stream(**request) as response_stream:
        kinds = [event.type for event in response_stream]
        streamed_response = response_stream.get_final_response()
    assert "response.function_call_arguments.done" in kinds and kinds[-1] == "response.completed"
    (call,) = streamed_response.output
    assert call.type == "function_call" and json.loads(call.arguments) == ARGUMENTS
    from_response = tinkerrpc.Trajectory.from_openai_response(
        [QUESTION], streamed_response, reward=0.0, tools=[responses_tool]
    )
    assert list(from_response.turns[0].completion_token_ids) == extra(plain_response.output[0], "token_ids")
    assert from_response.turns[0] == from_chat.turns[0]
    # The agent answers the call in Responses form; the answer is the taught one.
    answer = api.responses.create(
        **{
            **request,
            "input": [
                QUESTION,
                *[item.model_dump() for item in streamed_response.output],
                {"type": "function_call_output", "call_id": call.call_id, "output": TOOL_RESULT},
            ],
        }
    )
    assert answer.status == "completed" and answer.output_text == ANSWER

    result = stack.client.model(name).train(
        [tinkerrpc.TrajectoryGroup([from_chat, from_response])], learning_rate=1e-4
    )
    assert result.metrics.trajectories_used == 2 and result.policy_version > int(version)


def test_forced_tool_choice_opens_the_call_as_prompt_tokens(stack: Stack, tool_agent: str) -> None:
    """tool_choice "required" or a named function: the renderer's call opening ends the prompt (not sampled,
    no logprob), the model continues inside the call, and the rollout trains token-exact."""
    api = stack.openai()
    unforced = extra(ask(api, tool_agent, [QUESTION]), "prompt_token_ids")
    trajectories = []
    named = {"type": "function", "function": {"name": "get_weather"}}
    for tool_choice in ("required", named):
        forced = ask(
            api, tool_agent, [QUESTION], logprobs=True, tool_choice=tool_choice, parallel_tool_calls=False
        )
        prompt = extra(forced, "prompt_token_ids")
        assert prompt[: len(unforced)] == unforced and len(prompt) > len(unforced)
        (choice,) = forced.choices
        assert choice.finish_reason == "tool_calls", choice.message
        (call,) = choice.message.tool_calls or []
        assert call.function.name == "get_weather" and json.loads(call.function.arguments) == ARGUMENTS
        sampled = extra(choice, "token_ids")
        assert len(sampled) == len(choice.logprobs.content or [])
        # Rewards differ so the group has an advantage to train on.
        reward = 1.0 if tool_choice == "required" else 0.0
        trajectory = tinkerrpc.Trajectory.from_openai([QUESTION], forced, reward=reward, tools=[WEATHER_TOOL])
        assert list(trajectory.turns[0].prompt_token_ids) == prompt
        assert list(trajectory.turns[0].completion_token_ids) == sampled
        trajectories.append(trajectory)
    # The named opening goes further into the call than "required"'s.
    assert len(trajectories[1].turns[0].prompt_token_ids) > len(trajectories[0].turns[0].prompt_token_ids)

    responses_tool = {"type": "function", **WEATHER_TOOL["function"]}
    response = api.responses.create(
        model=tool_agent,
        input=[QUESTION],  # type: ignore[list-item]
        tools=[responses_tool],  # type: ignore[list-item]
        tool_choice={"type": "function", "name": "get_weather"},
        temperature=0,
        max_output_tokens=40,
    )
    (output,) = response.output
    assert output.type == "function_call" and json.loads(output.arguments) == ARGUMENTS
    assert extra(output, "prompt_token_ids") == list(trajectories[1].turns[0].prompt_token_ids)

    name = tool_agent.split("@")[0]
    result = stack.client.model(name).train([tinkerrpc.TrajectoryGroup(trajectories)], learning_rate=1e-4)
    assert result.policy_version > int(tool_agent.split("@")[1])


def test_forced_tool_choice_on_an_untrained_model_shows_the_unparsed_call(stack: Stack) -> None:
    """A model that cannot finish a call still gets the opening; its garbage continuation is returned as
    the content (no tool_calls), never a server error."""
    stack.client.create_model("forced-untrained", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    api = stack.openai()
    forced = ask(api, "forced-untrained", [QUESTION], tool_choice="required", seed=2)
    unforced = extra(ask(api, "forced-untrained", [QUESTION]), "prompt_token_ids")
    assert extra(forced, "prompt_token_ids")[: len(unforced)] == unforced
    (choice,) = forced.choices
    if not choice.message.tool_calls:
        assert choice.finish_reason in ("stop", "length")
        assert '<tool_call>\n{"name": "' in (choice.message.content or "")
