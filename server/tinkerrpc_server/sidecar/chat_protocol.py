"""The chat completions request and its answers (plain and streamed), with vLLM-style RL extensions.

Logprob entries and a tool call's function are OpenAI's shapes (`openai_shapes`, field for field as
the `openai` package declares them). The envelopes are ours: openai's ChatCompletion, Choice and
ChatCompletionMessage declare lists of their own types (a list field cannot be narrowed to our choices
with the RL fields, it is invariant) and optional fields (service_tier, annotations, audio) that would
add nulls to every reply.
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, ConfigDict, Field, field_validator

from tinkerrpc.contract.limits import MAX_INT32, MAX_TOP_LOGPROBS
from tinkerrpc_server.sidecar.extensions import known_template_kwargs
from tinkerrpc_server.sidecar.openai_shapes import (
    ChatCompletionMessageFunctionToolCall,
    ChoiceLogprobs,
    Function,
)
from tinkerrpc_server.sidecar.prompt_logprobs import PromptLogprobs
from tinkerrpc_server.sidecar.protocol import (
    FinishReason,
    OutputFormatType,
    SamplingFields,
    ServiceTier,
    StrictRequest,
    Usage,
)


class TextPart(BaseModel):
    # Other part types (image_url, input_audio, file) are kept loose here and refused by name later.
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class FunctionCallParam(StrictRequest):
    name: str
    arguments: str = "{}"


class ToolCallParam(StrictRequest):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam
    # litellm's echoed tool calls carry it (provider extras such as thought signatures); ignored.
    provider_specific_fields: dict[str, Any] | None = None


class ChatMessageParam(StrictRequest):
    role: Literal["system", "developer", "user", "assistant", "tool"]
    content: str | list[TextPart] | None = None
    name: str | None = None
    tool_calls: list[ToolCallParam] | None = None
    tool_call_id: str | None = None
    # Sent back by clients that echo returned assistant messages verbatim (`message.model_dump()`);
    # none of them changes the rendered prompt: the sidecar never returns refusals, annotations or
    # audio, and an earlier turn's reasoning is not re-rendered (Qwen3's template drops it too).
    refusal: str | None = None
    annotations: list[Any] | None = None
    audio: dict[str, Any] | None = None
    reasoning_content: str | None = None
    # The deprecated single function call; only null is accepted (refused by name when set).
    function_call: dict[str, Any] | None = None
    # What litellm's Message adds when it is echoed back (`message.model_dump()`): the provider's
    # extras (RL fields among them), Anthropic-style thinking blocks and generated images. None of
    # them is rendered: the sidecar produces no thinking blocks or images.
    provider_specific_fields: dict[str, Any] | None = None
    thinking_blocks: list[dict[str, Any]] | None = None
    images: list[dict[str, Any]] | None = None


class FunctionDefinition(StrictRequest):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(StrictRequest):
    type: Literal["function"]
    function: FunctionDefinition


class ResponseFormat(StrictRequest):
    type: OutputFormatType
    json_schema: dict[str, Any] | None = None


class ChatCompletionRequest(SamplingFields):
    messages: list[ChatMessageParam] = Field(min_length=1)
    tools: list[ToolParam] | None = None
    tool_choice: str | dict[str, Any] | None = None
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    max_completion_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    logprobs: bool = False
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    response_format: ResponseFormat | None = None
    # vLLM: keyword arguments of the chat template; only enable_thinking, which picks the renderer's
    # thinking or thinking-disabled variant, is kept (other keys are vendor extensions, ignored).
    chat_template_kwargs: dict[str, Any] | None = None
    # vLLM: the reply's content starts with the last message's when that message is the assistant's.
    echo: bool = False
    audio: dict[str, Any] | None = None
    modalities: list[Literal["text", "audio"]] | None = None
    prediction: dict[str, Any] | None = None
    reasoning_effort: Literal["none", "minimal", "low", "medium", "high"] | None = None
    verbosity: Literal["low", "medium", "high"] | None = None
    web_search_options: dict[str, Any] | None = None
    functions: list[dict[str, Any]] | None = None
    function_call: str | dict[str, Any] | None = None
    # False keeps only the first tool call of each reply.
    parallel_tool_calls: bool | None = None
    # Accepted and ignored.
    metadata: dict[str, str] | None = None
    store: bool | None = None
    service_tier: ServiceTier | None = None
    prompt_cache_key: str | None = None
    safety_identifier: str | None = None

    _known_template_kwargs = field_validator("chat_template_kwargs")(known_template_kwargs)


class ToolCall(ChatCompletionMessageFunctionToolCall):
    type: Literal["function"] = "function"


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None


class PolicyTokenSpan(BaseModel):
    """ART 0.5.20+'s provenance of tokens: the half-open token interval one policy state drew (or, for a
    prompt, scored) (art/preprocessing/policy_spans.py); its PipelineTrainer's eval requires them on every
    Choice, and its stream reader joins a stream's spans when their identity fields match."""

    start_token: int
    end_token: int
    generation_id: str
    policy_version: int
    lora_slot: str
    update_seq: int


def policy_token_spans(served_model: str, policy_version: int, start: int, end: int) -> list[PolicyTokenSpan]:
    """Tokens [start, end) as drawn by `served_model` (`name@N`), an immutable version: one span with
    the identity ART itself gives an immutable step's adapter (generation and slot are the versioned
    name, which no later update changes); none for an empty interval."""
    if end <= start:
        return []
    span = PolicyTokenSpan(
        start_token=start,
        end_token=end,
        generation_id=served_model,
        policy_version=policy_version,
        lora_slot=served_model,
        update_seq=policy_version,
    )
    return [span]


def prompt_policy_token_spans(
    served_model: str, policy_version: int, prompt_tokens: int
) -> list[PolicyTokenSpan]:
    """ART's prompt provenance: the positions with a causal logprob (all but the first), scored by the
    version that sampled the reply (ART's reader wants them beside the completion's spans)."""
    return policy_token_spans(served_model, policy_version, min(prompt_tokens, 1), prompt_tokens)


class ChatChoice(BaseModel):
    index: int
    message: AssistantMessage
    finish_reason: FinishReason
    logprobs: ChoiceLogprobs | None
    # RL extensions: the sampled token ids and the version that produced them.
    token_ids: list[int]
    policy_version: int
    # RL extension: the server's key for the sampler's logprobs of these tokens (SampledTurn.sample_key).
    sample_key: str | None = None
    # ART's provenance (`policy_token_spans`): every token drawn, and every prompt position scored, by
    # `policy_version`.
    policy_token_spans: list[PolicyTokenSpan]
    prompt_policy_token_spans: list[PolicyTokenSpan]


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    # vLLM's prompt_logprobs, when asked (prompt_logprobs.py).
    prompt_logprobs: PromptLogprobs | None = None
    # RL extensions (vLLM names).
    prompt_token_ids: list[int]
    policy_version: int


class ToolCallDelta(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: Function


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None
    # RL fields of a stream, on the delta: openai's stream helper joins the deltas' token_ids into the
    # accumulated message's (and keeps the sample_key of the last one), where Trajectory.from_openai reads them.
    token_ids: list[int] | None = None
    sample_key: str | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    # On a choice's first chunk (the stream helper keeps the first chunk's choice fields).
    policy_version: int | None = None
    prompt_policy_token_spans: list[PolicyTokenSpan] | None = None
    # On each chunk that carries tokens: the ids where vLLM puts them (beside the delta's copy, which
    # openai's helper joins) and their provenance, the interval of the choice's tokens they fill; ART's
    # stream reader joins both into the plain choice's `token_ids` and `policy_token_spans`.
    token_ids: list[int] | None = None
    policy_token_spans: list[PolicyTokenSpan] | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    policy_version: int | None = None
