"""The OpenAI Agents SDK (`openai-agents`) against the real sidecar: a one-tool agent on the chat
completions model and on the default Responses model, plain and streamed, runs to the model's answer,
and its rollouts train token-exact.

The model is `tool_agent` (conftest): taught to call get_weather for Paris and answer from the result.
The tool is declared with the schema it was taught on (a `@function_tool` derives another schema from
the signature, which the tiny model has never seen). Where the RL fields are: the Responses model keeps
the sidecar's output items, RL fields included, in `result.raw_responses`; the chat completions model
rebuilds its output in Responses types without them, so the chat rollouts come from the exchanges
recorded on the httpx client handed to the SDK's AsyncOpenAI (sidecar_support.ExchangeRecorder).
"""

from __future__ import annotations

import json
from typing import Any

import pytest
from agents import (
    Agent,
    FunctionTool,
    ModelSettings,
    OpenAIChatCompletionsModel,
    OpenAIResponsesModel,
    RunContextWrapper,
    Runner,
    set_tracing_disabled,
)
from agents.items import ModelResponse
from sidecar_support import (
    ANSWER,
    ARGUMENTS,
    QUESTION,
    TOOL_RESULT,
    WEATHER_TOOL,
    ExchangeRecorder,
    Stack,
)

import tinkerrpc

pytestmark = pytest.mark.ecosystem

# Tracing would export spans to OpenAI's servers.
set_tracing_disabled(True)

RESPONSES_TOOL = {"type": "function", **WEATHER_TOOL["function"]}
GREEDY = {"temperature": 0.0, "max_tokens": 40}


class WeatherTool:
    """get_weather as the agent sees it, remembering the arguments of every call."""

    def __init__(self) -> None:
        self.calls: list[dict[str, Any]] = []
        function = WEATHER_TOOL["function"]
        self.tool = FunctionTool(
            name=function["name"],
            description=function["description"],
            params_json_schema=function["parameters"],
            on_invoke_tool=self.invoke,
            strict_json_schema=False,
        )

    async def invoke(self, context: RunContextWrapper[Any], arguments: str) -> str:
        self.calls.append(json.loads(arguments))
        return TOOL_RESULT


def chat_agent(stack: Stack, tool_agent: str, recorder: ExchangeRecorder, weather: WeatherTool) -> Agent[Any]:
    client = stack.async_openai(http_client=recorder.async_http_client())
    return Agent(
        name="weather",
        model=OpenAIChatCompletionsModel(model=tool_agent, openai_client=client),
        tools=[weather.tool],
        # logprobs=True is not a ModelSettings field: extra_args passes it to chat.completions.create.
        model_settings=ModelSettings(**GREEDY, extra_args={"logprobs": True}),
    )


def rollout_from_responses(raw: list[ModelResponse], reward: float) -> tinkerrpc.Trajectory:
    """A run of the Responses model as a trajectory: each ModelResponse holds the sidecar's output items."""

    def response(model_response: ModelResponse) -> dict[str, Any]:
        return {"output": [item.model_dump() for item in model_response.output]}

    first, second = raw
    (call,) = first.output
    trajectory = tinkerrpc.Trajectory.from_openai_response(
        [QUESTION], response(first), reward, tools=[RESPONSES_TOOL]
    )
    tool_message = tinkerrpc.Message.tool(TOOL_RESULT, tool_call_id=call.call_id)  # type: ignore[union-attr]
    return trajectory.add_messages(tool_message).add_openai_response(response(second))


@pytest.fixture(scope="module")
def chat_run(stack: Stack, tool_agent: str) -> tuple[Any, WeatherTool, ExchangeRecorder]:
    recorder, weather = ExchangeRecorder(), WeatherTool()
    result = Runner.run_sync(chat_agent(stack, tool_agent, recorder, weather), QUESTION["content"])
    return result, weather, recorder


@pytest.fixture(scope="module")
def responses_run(stack: Stack, tool_agent: str) -> tuple[Any, WeatherTool]:
    weather = WeatherTool()
    agent = Agent(
        name="weather",
        model=OpenAIResponsesModel(model=tool_agent, openai_client=stack.async_openai()),
        tools=[weather.tool],
        model_settings=ModelSettings(**GREEDY, response_include=["message.output_text.logprobs"]),
    )
    return Runner.run_sync(agent, QUESTION["content"]), weather


def test_chat_completions_agent_calls_the_tool_and_answers(
    chat_run: tuple[Any, WeatherTool, ExchangeRecorder],
) -> None:
    result, weather, recorder = chat_run
    assert weather.calls == [ARGUMENTS]
    assert result.final_output == ANSWER
    first, second = recorder.exchanges
    # The SDK sent the tool's result back under the id of the call the sidecar returned.
    call_id = first.completion()["choices"][0]["message"]["tool_calls"][0]["id"]
    assert second.request["messages"][-1] == {"role": "tool", "tool_call_id": call_id, "content": TOOL_RESULT}


def test_responses_agent_calls_the_tool_and_answers(responses_run: tuple[Any, WeatherTool]) -> None:
    result, weather = responses_run
    assert weather.calls == [ARGUMENTS]
    assert result.final_output == ANSWER
    first, second = result.raw_responses
    assert [item.type for item in first.output] == ["function_call"]
    assert [item.type for item in second.output] == ["message"]


async def test_agent_rollouts_train_token_exact(
    stack: Stack,
    tool_agent: str,
    chat_run: tuple[Any, WeatherTool, ExchangeRecorder],
    responses_run: tuple[Any, WeatherTool],
) -> None:
    """Both runs' rollouts, and a streamed chat run's, become trajectories whose turns are the
    sidecar's tokens (the same greedy turns through either API), and they train."""
    name, version = tool_agent.split("@")
    from_chat = chat_run[2].rollout(reward=1.0)
    first, second = chat_run[2].exchanges
    assert [list(turn.completion_token_ids) for turn in from_chat.turns] == [
        exchange.completion()["choices"][0]["token_ids"] for exchange in (first, second)
    ]
    assert list(from_chat.turns[1].prompt_token_ids) == second.completion()["prompt_token_ids"]
    assert [turn.policy_version for turn in from_chat.turns] == [int(version)] * 2
    assert [m.role for m in from_chat.messages] == ["user", "assistant", "tool", "assistant"]
    assert from_chat.messages[-1].content == ANSWER

    from_responses = rollout_from_responses(responses_run[0].raw_responses, reward=0.0)
    assert from_responses.turns == from_chat.turns

    # run_streamed: the stream's last chunk carries the RL fields because logprobs were asked.
    recorder, weather = ExchangeRecorder(), WeatherTool()
    streamed = Runner.run_streamed(chat_agent(stack, tool_agent, recorder, weather), QUESTION["content"])
    kinds = {event.type async for event in streamed.stream_events()}
    assert "raw_response_event" in kinds and streamed.final_output == ANSWER
    assert weather.calls == [ARGUMENTS] and all(e.request["stream"] for e in recorder.exchanges)
    from_stream = recorder.rollout(reward=0.5)
    assert from_stream.turns == from_chat.turns

    group = tinkerrpc.TrajectoryGroup([from_chat, from_responses, from_stream])
    result = stack.client.model(name).train([group], learning_rate=1e-4)
    assert result.metrics.trajectories_used == 3 and result.policy_version > int(version)
