"""LangChain's `ChatOpenAI` (`langchain-openai`) against the real sidecar: a model bound to the weather
tool calls it, answers from its result, plain and streamed; forced tool choice (`"required"`, a named
function) and `with_structured_output(method="function_calling")` work; the rollouts train token-exact.

The model is `tool_agent` (conftest), taught the weather-tool conversation. LangChain rebuilds responses
as its own messages and keeps neither `token_ids` nor `prompt_token_ids`, so the rollouts come from the
exchanges recorded on the httpx client handed to ChatOpenAI (sidecar_support.ExchangeRecorder).
"""

from __future__ import annotations

from typing import Any

import pytest
from langchain_core.messages import AIMessage, BaseMessage, HumanMessage, ToolMessage
from langchain_openai import ChatOpenAI
from sidecar_support import (
    ANSWER,
    API_KEY,
    ARGUMENTS,
    QUESTION,
    TOOL_RESULT,
    WEATHER_TOOL,
    ExchangeRecorder,
    Stack,
)

import tinkerrpc

pytestmark = pytest.mark.ecosystem


def chat_model(stack: Stack, model: str, recorder: ExchangeRecorder) -> ChatOpenAI:
    return ChatOpenAI(
        base_url=stack.sidecar.openai_base_url,
        api_key=API_KEY,  # type: ignore[arg-type]
        model=model,
        temperature=0,
        max_tokens=40,  # type: ignore[call-arg]
        logprobs=True,
        max_retries=0,
        http_client=recorder.http_client(),
    )


def run_the_tool(stack: Stack, tool_agent: str, stream: bool) -> tuple[list[BaseMessage], ExchangeRecorder]:
    """Ask, run the tool the model calls, hand its result back, and return the conversation."""
    recorder = ExchangeRecorder()
    bound = chat_model(stack, tool_agent, recorder).bind_tools([WEATHER_TOOL], tool_choice="auto")

    def reply(messages: list[BaseMessage]) -> AIMessage:
        if not stream:
            message = bound.invoke(messages)
            assert isinstance(message, AIMessage)
            return message
        chunks = list(bound.stream(messages))
        merged: Any = chunks[0]
        for chunk in chunks[1:]:
            merged = merged + chunk
        return AIMessage(content=merged.content, tool_calls=merged.tool_calls)

    conversation: list[BaseMessage] = [HumanMessage(QUESTION["content"])]
    call = reply(conversation)
    assert [(c["name"], c["args"]) for c in call.tool_calls] == [("get_weather", ARGUMENTS)]
    conversation += [call, ToolMessage(TOOL_RESULT, tool_call_id=call.tool_calls[0]["id"])]
    conversation.append(reply(conversation))
    return conversation, recorder


def test_bound_tool_is_called_and_the_rollouts_train_token_exact(stack: Stack, tool_agent: str) -> None:
    name, version = tool_agent.split("@")
    conversation, recorder = run_the_tool(stack, tool_agent, stream=False)
    assert conversation[-1].content == ANSWER
    assert conversation[-1].response_metadata["finish_reason"] == "stop"
    first, _ = recorder.exchanges
    assert first.request["tool_choice"] == "auto" and first.request["logprobs"] is True

    plain = recorder.rollout(reward=1.0)
    # The sidecar's tokens for the same greedy request through the official client.
    direct = stack.openai().chat.completions.create(**{**first.request, "model": tool_agent})
    assert list(plain.turns[0].completion_token_ids) == (direct.choices[0].model_extra or {})["token_ids"]
    assert list(plain.turns[0].prompt_token_ids) == (direct.model_extra or {})["prompt_token_ids"]
    assert [turn.policy_version for turn in plain.turns] == [int(version)] * 2
    assert [m.role for m in plain.messages] == ["user", "assistant", "tool", "assistant"]

    streamed_conversation, streamed_recorder = run_the_tool(stack, tool_agent, stream=True)
    assert streamed_conversation[-1].content == ANSWER
    assert all(exchange.request["stream"] for exchange in streamed_recorder.exchanges)
    streamed = streamed_recorder.rollout(reward=0.0)
    assert streamed.turns == plain.turns

    result = stack.client.model(name).train(
        [tinkerrpc.TrajectoryGroup([plain, streamed])], learning_rate=1e-4
    )
    assert result.metrics.trajectories_used == 2 and result.policy_version > int(version)


def test_forced_tool_choice_and_structured_output(stack: Stack, tool_agent: str) -> None:
    """Forced choices send `"required"` or the named function; the sidecar makes the opening of the call
    part of the prompt, so the model continues inside it and the rollout still trains token-exact."""
    name, version = tool_agent.split("@")
    question = [HumanMessage(QUESTION["content"])]
    rollouts = []
    # Different rewards, so the group carries signal and trains.
    for tool_choice, sent, reward in (
        ("required", "required", 1.0),
        ("get_weather", {"type": "function", "function": {"name": "get_weather"}}, 0.5),
    ):
        recorder = ExchangeRecorder()
        bound = chat_model(stack, tool_agent, recorder).bind_tools([WEATHER_TOOL], tool_choice=tool_choice)
        message = bound.invoke(question)
        assert isinstance(message, AIMessage)
        assert [(c["name"], c["args"]) for c in message.tool_calls] == [("get_weather", ARGUMENTS)]
        (exchange,) = recorder.exchanges
        assert exchange.request["tool_choice"] == sent
        rollout = recorder.rollout(reward=reward)
        (turn,) = rollout.turns
        assert list(turn.completion_token_ids) == exchange.completion()["choices"][0]["token_ids"]
        assert list(turn.prompt_token_ids) == exchange.completion()["prompt_token_ids"]
        rollouts.append(rollout)

    structured = chat_model(stack, tool_agent, ExchangeRecorder()).with_structured_output(
        WEATHER_TOOL["function"], method="function_calling"
    )
    assert structured.invoke(question) == ARGUMENTS

    result = stack.client.model(name).train([tinkerrpc.TrajectoryGroup(rollouts)], learning_rate=1e-4)
    assert result.metrics.trajectories_used == 2 and result.policy_version > int(version)
