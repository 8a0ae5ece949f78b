"""A tiny-chat model taught to write given replies, so tests can see what the server makes of model
output that an agent framework meets in the wild: tool-call markup that does not parse, a call of a
function the request did not offer, a call followed by chatter, several end-of-turn tokens.

The random tiny model writes none of these by itself. `taught_model` teaches one model every lesson
at once through the public API (supervised steps on one batch holding each lesson), with the
default renderer of tiny-chat (Qwen3's, thinking: a reply starts with the empty think block), until
greedy decoding of every lesson's question reproduces its reply; greedy decoding of that version is
deterministic from then on, so the tests know what the model writes.
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from typing import Any

import tinkerrpc

WEATHER_TOOL: dict[str, Any] = {
    "type": "function",
    "function": {
        "name": "get_weather",
        "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string"}}, "required": ["city"]},
    },
}
ARGUMENTS = {"city": "Paris"}
EMPTY_THINK = "<think>\n\n</think>\n\n"
CALL_MARKUP = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris"}}\n</tool_call>'
BAD_JSON_MARKUP = '<tool_call>\n{"name": "get_weather", "arguments": {"city": Paris}}\n</tool_call>'
UNOFFERED_MARKUP = '<tool_call>\n{"name": "launch_rockets", "arguments": {"count": 3}}\n</tool_call>'
CHATTER = "\nIt is usually mild in Paris at this time of year, so take a light coat."


@dataclass(frozen=True)
class Lesson:
    question: str
    # The reply as content text (markup included), or None for the weather tool call itself.
    reply: str | None


WEATHER = Lesson("What is the weather in Paris?", None)
BAD_JSON = Lesson("Check Paris, quickly.", BAD_JSON_MARKUP)
UNOFFERED = Lesson("Launch the rockets.", UNOFFERED_MARKUP)
CALL_THEN_CHATTER = Lesson("Weather in Paris, and chat about it.", CALL_MARKUP + CHATTER)
YES = Lesson("Say yes.", "yes")
LESSONS = (WEATHER, BAD_JSON, UNOFFERED, CALL_THEN_CHATTER, YES)

MODEL = "reply-actor"
MAX_STEPS = 400
CHECK_EVERY = 10


def question(lesson: Lesson) -> dict[str, str]:
    return {"role": "user", "content": lesson.question}


def _example(lesson: Lesson) -> tinkerrpc.SupervisedExample:
    if lesson.reply is None:
        call = tinkerrpc.ToolCall(id="call_0", name="get_weather", arguments=json.dumps(ARGUMENTS))
        answer = tinkerrpc.Message.assistant(tool_calls=[call])
    else:
        answer = tinkerrpc.Message.assistant(lesson.reply)
    return tinkerrpc.SupervisedExample(
        (tinkerrpc.Message.from_openai(question(lesson)), answer),
        tools=(tinkerrpc.Tool.from_openai(WEATHER_TOOL),),
    )


def _greedy(model: tinkerrpc.Model, lesson: Lesson, max_tokens: int = 64) -> tinkerrpc.Sample:
    (sample,) = model.sample([question(lesson)], tools=[WEATHER_TOOL], max_tokens=max_tokens, temperature=0.0)
    return sample


def written(lesson: Lesson) -> str:
    """The text of the reply the lesson teaches, as the model writes it (the empty think block first)."""
    return EMPTY_THINK + (lesson.reply if lesson.reply is not None else CALL_MARKUP)


def _knows(model: tinkerrpc.Model, lesson: Lesson) -> bool:
    sample = _greedy(model, lesson)
    return sample.stop_reason == "stop" and sample.text == written(lesson)


_taught: dict[str, str | None] = {}


def taught_model(target: str) -> str | None:
    """`reply-actor@N` on the server at `target`: the first version whose greedy replies are every
    lesson's (taught once per server, whichever test asks first); None if it never learns."""
    if target in _taught:
        return _taught[target]
    _taught[target] = None  # a lesson that failed is not tried again by the next module
    with tinkerrpc.Client(target) as client:
        model = client.create_model(MODEL, "tinkerrpc/tiny-chat", lora_rank=8, seed=0)
        batch = [_example(lesson) for lesson in LESSONS]
        for step in range(1, MAX_STEPS + 1):
            version = model.train_supervised(batch, learning_rate=5e-3).policy_version
            if step % CHECK_EVERY == 0 and all(_knows(model, lesson) for lesson in LESSONS):
                print(f"reply lessons learned after {step} steps")
                _taught[target] = f"{MODEL}@{version}"
                return _taught[target]
    return None
