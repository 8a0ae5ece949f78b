"""The Responses API's request and its answer, in the shapes the `openai` package
declares in `openai.types.responses`, with the RL fields on every output item.

A function call item is OpenAI's ResponseFunctionToolCall shape (`openai_shapes`) with the RL fields.
The rest are ours: the request's input items and tools are validated strictly (openai's models allow
any extra field), and openai's ResponseOutputText, ResponseOutputMessage and Response declare lists of
their own types, which cannot be narrowed to ours (a list is invariant), nor hold the usage details this
reply carries.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field

from tinkerrpc.contract.limits import (
    MAX_INT32,
    MAX_INT64,
    MAX_TOP_LOGPROBS,
    MIN_INT64,
    SIDECAR_MAX_TEMPERATURE,
)
from tinkerrpc_server.sidecar.extensions import ExtensibleRequest
from tinkerrpc_server.sidecar.openai_shapes import ChatCompletionTokenLogprob, ResponseFunctionToolCall
from tinkerrpc_server.sidecar.protocol import OutputFormatType, ServiceTier, StrictRequest


class TextFormat(StrictRequest):
    # A json_schema format carries its schema's name, schema, description and strict beside its type.
    model_config = ConfigDict(extra="allow", strict=True)
    type: OutputFormatType


class TextConfig(StrictRequest):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(StrictRequest):
    include_obfuscation: bool | None = None


LOGPROBS_INCLUDE = "message.output_text.logprobs"


# OpenAI's include values; only the logprobs one adds anything here (the sidecar has no built-in
# tools, images or encrypted reasoning whose details the others ask for).
ResponseInclude = Literal[
    "message.output_text.logprobs",
    "reasoning.encrypted_content",
    "file_search_call.results",
    "web_search_call.results",
    "web_search_call.action.sources",
    "message.input_image.image_url",
    "computer_call_output.output.image_url",
    "code_interpreter_call.outputs",
]


class _InputItem(BaseModel):
    # Items echoed from an earlier response's output carry ids, status and the RL fields.
    model_config = ConfigDict(extra="ignore", strict=True)


class InputTextPart(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["input_text", "output_text", "text"]
    text: str


class InputMessage(_InputItem):
    type: Literal["message"] = "message"
    role: Literal["user", "assistant", "system", "developer"]
    content: str | list[InputTextPart]


class FunctionCallInput(_InputItem):
    type: Literal["function_call"]
    call_id: str = Field(min_length=1)
    name: str = Field(min_length=1)
    arguments: str


class FunctionCallOutputInput(_InputItem):
    type: Literal["function_call_output"]
    call_id: str = Field(min_length=1)
    output: str | list[InputTextPart]


INPUT_ITEMS: dict[str, type[_InputItem]] = {
    "message": InputMessage,
    "function_call": FunctionCallInput,
    "function_call_output": FunctionCallOutputInput,
}


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore", strict=True)
    type: Literal["function"] = "function"
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ResponseRequest(ExtensibleRequest, StrictRequest):
    model: str = Field(min_length=1)
    input: str | list[dict[str, Any]]
    instructions: str | None = None
    tools: list[dict[str, Any]] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_output_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=SIDECAR_MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[ResponseInclude] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    text: TextConfig | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # Accepted and ignored: they do not change what is sampled (nothing is stored).
    store: bool | None = None
    stream_options: ResponsesStreamOptions | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = Field(None, ge=1, le=MAX_INT32)
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: ServiceTier | None = None
    truncation: Literal["auto", "disabled"] | None = None
    # RL extensions (vLLM names), as on chat completions.
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    seed: int | None = Field(None, ge=MIN_INT64, le=MAX_INT64)
    return_token_ids: bool | None = None

    @property
    def logprobs_asked(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)


class OutputText(BaseModel):
    type: Literal["output_text"] = "output_text"
    text: str
    annotations: list[Any] = Field(default_factory=list)
    logprobs: list[ChatCompletionTokenLogprob] | None = None


class _TurnFields(BaseModel):
    # RL extensions: the turn's tokens, shared by every output item of the turn.
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    policy_version: int | None = None
    token_logprobs: list[float] | None = None
    sample_key: str | None = None


ItemStatus = Literal["in_progress", "completed", "incomplete"]


class OutputMessage(_TurnFields):
    id: str
    status: ItemStatus
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(ResponseFunctionToolCall, _TurnFields):
    id: str
    status: ItemStatus
    type: Literal["function_call"] = "function_call"


class ResponseUsage(BaseModel):
    input_tokens: int
    input_tokens_details: dict[str, int] = {"cached_tokens": 0, "cache_write_tokens": 0}
    output_tokens: int
    output_tokens_details: dict[str, int] = {"reasoning_tokens": 0}
    total_tokens: int


class ResponseObject(BaseModel):
    id: str
    object: Literal["response"] = "response"
    created_at: int
    completed_at: int | None = None
    status: Literal["in_progress", "completed", "incomplete"]
    incomplete_details: dict[str, str] | None = None
    error: None = None
    model: str
    instructions: str | None
    output: list[OutputMessage | OutputFunctionCall]
    parallel_tool_calls: bool
    tool_choice: str | dict[str, Any]
    tools: list[FunctionTool]
    temperature: float | None
    top_p: float | None
    top_logprobs: int | None
    max_output_tokens: int | None
    store: bool = False
    text: dict[str, Any] = {"format": {"type": "text"}}
    metadata: dict[str, str] = Field(default_factory=dict)
    usage: ResponseUsage | None = None
