"""Sidecar processes for the tests: `tinkerrpc sidecar` (the real FastAPI app under uvicorn) on 127.0.0.1.

Also the weather-tool lesson that teaches the random tiny model one tool call (shared by the modules
that need a model calling a tool), and a recorder of the raw HTTP exchanges of client libraries that
drop the sidecar's RL fields from their own response objects.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

import httpx
import openai
from openai.lib.streaming.chat import ChatCompletionStreamState
from openai.types.chat import ChatCompletionChunk

import tinkerrpc
from tinkerrpc_server.local.stack import LocalSidecar

API_KEY = "sk-sidecar-test"


class Sidecar(LocalSidecar):
    def metrics(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", timeout=10).text


def start_sidecar(grpc_target: str, log_path: Path, api_key: str | None = API_KEY) -> Sidecar:
    return Sidecar(grpc_target, log_path, api_key).start()


@dataclass
class Stack:
    """`tinkerrpc serve` (embedded engine) with a sidecar in front, and an SDK client on the server."""

    grpc_target: str
    sidecar: Sidecar
    client: tinkerrpc.Client

    def openai(self, **options: Any) -> openai.OpenAI:
        return openai.OpenAI(base_url=self.sidecar.openai_base_url, api_key=API_KEY, max_retries=0, **options)

    def async_openai(self, **options: Any) -> openai.AsyncOpenAI:
        return openai.AsyncOpenAI(
            base_url=self.sidecar.openai_base_url, api_key=API_KEY, max_retries=0, **options
        )


# ---------------------------------------------------------------- the weather-tool lesson

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
QUESTION = {"role": "user", "content": "What is the weather in Paris?"}
ARGUMENTS = {"city": "Paris"}
TOOL_RESULT = "sunny"
ANSWER = "It is sunny."
# Measured on a quiet 2-core machine: greedy decoding gets both turns right after 50-70 steps (~50 s).
MAX_STEPS = 200
CHECK_EVERY = 5


def lesson() -> tinkerrpc.SupervisedExample:
    call = tinkerrpc.ToolCall(id="call_0", name="get_weather", arguments=json.dumps(ARGUMENTS))
    conversation = (
        tinkerrpc.Message.from_openai(QUESTION),
        tinkerrpc.Message.assistant(tool_calls=[call]),
        tinkerrpc.Message.tool(TOOL_RESULT, tool_call_id="call_0", name="get_weather"),
        tinkerrpc.Message.assistant(ANSWER),
    )
    return tinkerrpc.SupervisedExample(conversation, tools=(tinkerrpc.Tool.from_openai(WEATHER_TOOL),))


def greedy_reply(model: tinkerrpc.Model, messages: tuple[tinkerrpc.Message, ...]) -> tinkerrpc.Message:
    (sample,) = model.sample(messages, tools=[WEATHER_TOOL], max_tokens=40, temperature=0.0)
    return sample.to_message()


def knows_the_lesson(model: tinkerrpc.Model) -> bool:
    conversation = lesson().messages
    first = greedy_reply(model, conversation[:1])
    calls = [(call.name, call.parsed_arguments()) for call in first.tool_calls]
    return calls == [("get_weather", ARGUMENTS)] and greedy_reply(model, conversation[:3]).content == ANSWER


def teach_the_weather_tool(client: tinkerrpc.Client) -> str | None:
    """`tool-agent@N`, the first version of a new model that calls the weather tool and then answers
    from its result under greedy decoding (deterministic from then on); None if it never learns."""
    model = client.create_model(
        "tool-agent", "tinkerrpc/tiny-chat", lora_rank=8, renderer="qwen3_disable_thinking", seed=0
    )
    example = lesson()
    for step in range(1, MAX_STEPS + 1):
        version = model.train_supervised([example] * 8, learning_rate=5e-3).policy_version
        if step % CHECK_EVERY == 0 and knows_the_lesson(model):
            print(f"tool-call lesson learned after {step} steps")
            return f"tool-agent@{version}"
    return None


# ---------------------------------------------------------------- raw exchanges


@dataclass
class Exchange:
    """One chat completions call as it crossed the wire: the request's JSON and the response's bytes."""

    request: dict[str, Any]
    body: bytes

    def completion(self) -> Any:
        """The response: a chat completion dict, or a stream's chunks accumulated into one (its final
        chunk carries the RL fields when the request asked for logprobs or return_token_ids)."""
        if not self.request.get("stream"):
            return json.loads(self.body)
        state: ChatCompletionStreamState = ChatCompletionStreamState()
        for line in self.body.decode().splitlines():
            if line.startswith("data: ") and line != "data: [DONE]":
                state.handle_chunk(ChatCompletionChunk.model_validate_json(line.removeprefix("data: ")))
        return state.get_final_completion()


@dataclass
class ExchangeRecorder:
    """Records a library's chat completions exchanges through an httpx client handed to it.

    Libraries that rebuild the response in their own types (LangChain, the Agents SDK's chat model)
    drop the sidecar's `token_ids`/`prompt_token_ids`/`policy_version`; what came over the wire has them.
    """

    exchanges: list[Exchange] = field(default_factory=list)

    def http_client(self) -> httpx.Client:
        def record(response: httpx.Response) -> None:
            response.read()
            self._keep(response)

        return httpx.Client(event_hooks={"response": [record]})

    def async_http_client(self) -> httpx.AsyncClient:
        async def record(response: httpx.Response) -> None:
            await response.aread()
            self._keep(response)

        return httpx.AsyncClient(event_hooks={"response": [record]})

    def _keep(self, response: httpx.Response) -> None:
        if response.request.url.path.endswith("/chat/completions") and response.is_success:
            self.exchanges.append(Exchange(json.loads(response.request.content), response.content))

    def rollout(self, reward: float = 0.0) -> tinkerrpc.Trajectory:
        """The recorded calls of one conversation as a trajectory: each call's messages beyond what the
        trajectory holds already (tool results, user turns) are appended before its sampled turn."""
        first, *rest = self.exchanges
        trajectory = tinkerrpc.Trajectory.from_openai(
            first.request["messages"], first.completion(), reward, tools=first.request.get("tools") or ()
        )
        for exchange in rest:
            messages = exchange.request["messages"]
            trajectory.add_messages(*messages[len(trajectory.messages) :]).add_openai(exchange.completion())
        return trajectory
