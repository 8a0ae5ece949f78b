"""Chat messages, tools and the sampled turn: what a conversation is made of, and what the readers of
the sidecar's OpenAI responses (_openai.py) build."""

from __future__ import annotations

import json
from collections.abc import Iterable, Mapping, Sequence
from dataclasses import dataclass, field
from typing import Any, Literal

Role = Literal["system", "user", "assistant", "tool"]
ROLES: tuple[Role, ...] = ("system", "user", "assistant", "tool")


@dataclass(frozen=True)
class ToolCall:
    """A function call requested by an assistant message; arguments are JSON text, as in OpenAI's API."""

    id: str
    name: str
    arguments: str = "{}"

    def parsed_arguments(self) -> Any:
        return json.loads(self.arguments)


@dataclass(frozen=True)
class Tool:
    """A function the model may call; `parameters` is a JSON Schema object."""

    name: str
    description: str = ""
    parameters: Mapping[str, Any] = field(default_factory=dict)

    @classmethod
    def from_openai(cls, tool: Mapping[str, Any]) -> Tool:
        """From OpenAI's `{"type": "function", "function": {...}}` form (or the inner function dict)."""
        function = tool.get("function", tool)
        return cls(
            name=function["name"],
            description=function.get("description") or "",
            parameters=dict(function.get("parameters") or {}),
        )

    def to_openai(self) -> dict[str, Any]:
        return {
            "type": "function",
            "function": {
                "name": self.name,
                "description": self.description,
                "parameters": dict(self.parameters),
            },
        }


@dataclass(frozen=True)
class Message:
    """One chat message."""

    role: Role
    content: str = ""
    tool_calls: tuple[ToolCall, ...] = ()
    tool_call_id: str = ""
    name: str = ""

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise ValueError(f"Message role must be one of {ROLES}, got {self.role!r}")
        # Accept lists for convenience while keeping the dataclass hashable and immutable.
        object.__setattr__(self, "tool_calls", tuple(self.tool_calls))

    @classmethod
    def system(cls, content: str) -> Message:
        return cls("system", content)

    @classmethod
    def user(cls, content: str) -> Message:
        return cls("user", content)

    @classmethod
    def assistant(cls, content: str = "", tool_calls: Sequence[ToolCall] = ()) -> Message:
        return cls("assistant", content, tuple(tool_calls))

    @classmethod
    def tool(cls, content: str, tool_call_id: str, name: str = "") -> Message:
        return cls("tool", content, tool_call_id=tool_call_id, name=name)

    @classmethod
    def from_openai(cls, message: Mapping[str, Any]) -> Message:
        """From an OpenAI chat message dict (request or response form)."""
        calls = tuple(
            ToolCall(
                id=call.get("id") or "",
                name=call["function"]["name"],
                arguments=call["function"].get("arguments") or "{}",
            )
            for call in message.get("tool_calls") or ()
        )
        return cls(
            role=message["role"],
            content=message.get("content") or "",
            tool_calls=calls,
            tool_call_id=message.get("tool_call_id") or "",
            name=message.get("name") or "",
        )

    def to_openai(self) -> dict[str, Any]:
        """The OpenAI chat message dict, ready for `client.chat.completions.create(messages=...)`."""
        out: dict[str, Any] = {"role": self.role, "content": self.content}
        if self.tool_calls:
            out["tool_calls"] = [
                {"id": c.id, "type": "function", "function": {"name": c.name, "arguments": c.arguments}}
                for c in self.tool_calls
            ]
        if self.tool_call_id:
            out["tool_call_id"] = self.tool_call_id
        if self.name:
            out["name"] = self.name
        return out


MessageLike = Message | Mapping[str, Any]


def as_messages(messages: Iterable[MessageLike]) -> list[Message]:
    """Messages given as dataclasses or OpenAI-style dicts, as dataclasses."""
    converted = []
    for m in messages:
        if not isinstance(m, (Message, Mapping)):
            raise TypeError(f"expected a Message or an OpenAI-style message dict, got {type(m).__name__}")
        converted.append(m if isinstance(m, Message) else Message.from_openai(m))
    return converted


@dataclass(frozen=True)
class SampledTurn:
    """One completion exactly as the sampler produced it: the unit that trains, token-exact.

    `logprobs` may be empty when `sample_key` names the server's copy of the sampler's logprobs (the
    sidecar returns the key whether or not logprobs were asked); a turn with neither is scored at Train."""

    prompt_token_ids: tuple[int, ...]
    completion_token_ids: tuple[int, ...]
    logprobs: tuple[float, ...]
    policy_version: int
    sample_key: str = field(default="", compare=False)  # an opaque handle, not content
    # Per-token advantages added to the trajectory's (one per completion token, or none).
    advantages: tuple[float, ...] = ()

    def __post_init__(self) -> None:
        object.__setattr__(self, "prompt_token_ids", tuple(self.prompt_token_ids))
        object.__setattr__(self, "completion_token_ids", tuple(self.completion_token_ids))
        object.__setattr__(self, "logprobs", tuple(self.logprobs))
        object.__setattr__(self, "advantages", tuple(self.advantages))
