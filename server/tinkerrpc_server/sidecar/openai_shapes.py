"""OpenAI's wire shapes that the sidecar's answers are built from, field for field as the `openai`
package declares them (its `types.chat`, `types.completion_choice`, `types.model` and
`types.responses`).

Written here rather than imported: importing any of `openai.types` runs `openai/__init__`, which loads
the whole client (httpx and its transports, ~23 MiB in `serve`'s process, where the sidecar is hosted),
and that alone took the demo's memory figure past its goal (1.53-1.60x the in-process baseline against
1.5x). tests/sidecar/test_openai_shapes.py checks each field against the installed `openai` package.
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, ConfigDict


class _Shape(BaseModel):
    # As openai's models: a field another server sends is kept, not refused.
    model_config = ConfigDict(extra="allow")


class TopLogprob(_Shape):
    token: str
    bytes: list[int] | None = None
    logprob: float


class ChatCompletionTokenLogprob(_Shape):
    token: str
    bytes: list[int] | None = None
    logprob: float
    top_logprobs: list[TopLogprob]


class ChoiceLogprobs(_Shape):
    content: list[ChatCompletionTokenLogprob] | None = None
    refusal: list[ChatCompletionTokenLogprob] | None = None


class Function(_Shape):
    arguments: str
    name: str


class ChatCompletionMessageFunctionToolCall(_Shape):
    id: str
    function: Function
    type: Literal["function"]


class Logprobs(_Shape):
    """A legacy completion's logprobs."""

    text_offset: list[int] | None = None
    token_logprobs: list[float] | None = None
    tokens: list[str] | None = None
    top_logprobs: list[dict[str, float]] | None = None


class Model(_Shape):
    id: str
    created: int
    object: Literal["model"]
    owned_by: str
    shutdown_date: str | None = None


class ResponseFunctionToolCall(_Shape):
    """The Responses API's function call item (openai's optional `async`, `caller` and `namespace` are
    never set by this server, so they are not declared)."""

    arguments: str
    call_id: str
    name: str
    type: Literal["function_call"]
    id: str | None = None
    status: Literal["in_progress", "completed", "incomplete"] | None = None
