"""Pydantic models of the OpenAI API subset the sidecar serves (chat and legacy completions, the
Responses API, model cards), with vLLM-style RL extensions.

Requests forbid unknown fields (OpenAI answers "Unrecognized request argument" too), so a typo
never silently changes sampling, and validate strictly: `true` is no integer and `1.0` no count. Fields that do not affect sampling are declared and ignored;
fields the sampler cannot honour are declared so that the endpoint modules can name them in a 400.
"""

from __future__ import annotations

from typing import Annotated, Any, Literal

from pydantic import BaseModel, ConfigDict, Field

# The bounds are the contract's (tinkerrpc.contract.limits): token counts and ids are int32 on the wire,
# seeds int64; n, temperature and top_logprobs keep one request from monopolising the sampler.
from tinkerrpc.contract.limits import (
    MAX_INT32,
    MAX_INT64,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    MIN_INT64,
    SIDECAR_MAX_N,
    SIDECAR_MAX_TAG_CHARS,
    SIDECAR_MAX_TEMPERATURE,
)
from tinkerrpc.contract.sampling import SIDECAR_COMPLETION_MAX_TOKENS


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class TextPart(BaseModel):
    # Other part types (image_url, input_audio, file) are kept loose here and refused by name later.
    model_config = ConfigDict(extra="allow", strict=True)
    type: str
    text: str | None = None


class FunctionCallParam(_Request):
    name: str
    arguments: str = "{}"


class ToolCallParam(_Request):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCallParam
    # litellm's echoed tool calls carry it (provider extras such as thought signatures); ignored.
    provider_specific_fields: dict[str, Any] | None = None


class ChatMessageParam(_Request):
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


class FunctionDefinition(_Request):
    name: str = Field(min_length=1)
    description: str | None = None
    parameters: dict[str, Any] | None = None
    strict: bool | None = None


class ToolParam(_Request):
    type: Literal["function"]
    function: FunctionDefinition


class StreamOptions(_Request):
    include_usage: bool = False
    # Accepted for compatibility; the stream is produced after sampling, so it changes nothing.
    include_obfuscation: bool | None = None


# Structured-output formats OpenAI names; only "text" is served (refused by name otherwise).
OutputFormatType = Literal["text", "json_object", "json_schema"]


class ResponseFormat(_Request):
    type: OutputFormatType
    json_schema: dict[str, Any] | None = None


class TextFormat(_Request):
    # A json_schema format carries its schema's name, schema, description and strict beside its type.
    model_config = ConfigDict(extra="allow", strict=True)
    type: OutputFormatType


class TextConfig(_Request):
    format: TextFormat | None = None
    verbosity: Literal["low", "medium", "high"] | None = None


class ResponsesStreamOptions(_Request):
    include_obfuscation: bool | None = None


ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class SamplingFields(_Request):
    """Parameters shared by chat and legacy completions."""

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=SIDECAR_MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=SIDECAR_MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # Extension (vLLM): -1 or 0 disables top-k.
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=MIN_INT64, le=MAX_INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Honoured only at their neutral values (checked by name so the 400 says which one).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # RL extensions (vLLM): logprob tokens as `token_id:N`, extra stop token ids, no end-of-turn stop.
    return_tokens_as_token_ids: bool = False
    # Negative ids are refused by name with the other sampling checks.
    stop_token_ids: list[Annotated[int, Field(le=MAX_INT32)]] | None = None
    ignore_eos: bool = False
    # vLLM: true returns `token_ids`/`prompt_token_ids`/`policy_version` (also on a stream's last
    # chunk), false leaves them out; unset keeps them on plain responses.
    return_token_ids: bool | None = None
    # vLLM: no stop (stop token or stop string) before this many tokens.
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    # vLLM: how the returned text is decoded from the tokens (special tokens dropped or kept, and
    # kept ones spaced from their neighbours), and whether the matched stop string stays in it.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # Accepted and ignored: they do not change what is sampled.
    user: str | None = None


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
    # thinking or thinking-disabled variant.
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


TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    # OpenAI's legacy default.
    max_tokens: int | None = Field(SIDECAR_COMPLETION_MAX_TOKENS, ge=1, le=MAX_INT32)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=SIDECAR_MAX_N)
    suffix: str | None = None


# ---------------------------------------------------------------- responses


class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


class TopLogprobEntry(BaseModel):
    token: str
    logprob: float
    bytes: list[int] | None


class TokenLogprobEntry(TopLogprobEntry):
    top_logprobs: list[TopLogprobEntry]


class ChoiceLogprobs(BaseModel):
    content: list[TokenLogprobEntry] | None
    refusal: None = None


class FunctionCall(BaseModel):
    name: str
    arguments: str


class ToolCall(BaseModel):
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class AssistantMessage(BaseModel):
    role: Literal["assistant"] = "assistant"
    content: str | None
    refusal: None = None
    tool_calls: list[ToolCall] | None = None


FinishReason = Literal["stop", "length", "tool_calls"]


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


class ChatCompletion(BaseModel):
    id: str
    object: Literal["chat.completion"] = "chat.completion"
    created: int
    model: str
    choices: list[ChatChoice]
    usage: Usage
    system_fingerprint: str | None = None
    # RL extensions (vLLM names).
    prompt_token_ids: list[int]
    policy_version: int


class ToolCallDelta(BaseModel):
    index: int
    id: str
    type: Literal["function"] = "function"
    function: FunctionCall


class ChatDelta(BaseModel):
    role: Literal["assistant"] | None = None
    content: str | None = None
    tool_calls: list[ToolCallDelta] | None = None


class ChatChunkChoice(BaseModel):
    index: int
    delta: ChatDelta
    logprobs: ChoiceLogprobs | None = None
    finish_reason: FinishReason | None = None
    token_ids: list[int] | None = None
    policy_version: int | None = None
    sample_key: str | None = None


class ChatCompletionChunk(BaseModel):
    id: str
    object: Literal["chat.completion.chunk"] = "chat.completion.chunk"
    created: int
    model: str
    choices: list[ChatChunkChoice]
    usage: Usage | None = None
    prompt_token_ids: list[int] | None = None
    policy_version: int | None = None


class LegacyLogprobs(BaseModel):
    tokens: list[str]
    token_logprobs: list[float]
    top_logprobs: list[dict[str, float]] | None
    text_offset: list[int]


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: LegacyLogprobs | None
    token_ids: list[int] | None = None
    policy_version: int | None = None
    sample_key: str | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None
    # Set on plain responses; on stream chunks only when asked (see completions.completion_stream_chunks).
    policy_version: int | None = None


class ModelCard(BaseModel):
    id: str
    object: Literal["model"] = "model"
    created: int
    owned_by: str = "tinkerrpc"
    parent: str
    root: str
    max_model_len: int | None
    policy_version: int


class ModelList(BaseModel):
    object: Literal["list"] = "list"
    data: list[ModelCard]


# ---------------------------------------------------------------- the Responses API
# The shapes of the `openai` package's `openai.types.responses`.

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


class ResponseRequest(_Request):
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
    logprobs: list[TokenLogprobEntry] | None = None


class _OutputItem(BaseModel):
    id: str
    status: Literal["in_progress", "completed", "incomplete"]
    # RL extensions: the turn's tokens, shared by every output item of the turn.
    token_ids: list[int] | None = None
    prompt_token_ids: list[int] | None = None
    policy_version: int | None = None
    token_logprobs: list[float] | None = None
    sample_key: str | None = None


class OutputMessage(_OutputItem):
    type: Literal["message"] = "message"
    role: Literal["assistant"] = "assistant"
    content: list[OutputText]


class OutputFunctionCall(_OutputItem):
    type: Literal["function_call"] = "function_call"
    call_id: str
    name: str
    arguments: str


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


# ---------------------------------------------------------------- vLLM's tokens-in, tokens-out generate
# The shapes of vLLM's `/inference/v1/generate` (GenerateRequest, GenerateResponse), as the `renderers`
# package's client (verifiers' and prime-rl's training client) sends and reads them.


class GenerateSamplingParams(_Request):
    """vLLM's SamplingParams, the subset the sampler honours; knobs it lacks are declared so that the
    route names them in a 400 (accepted only at their neutral values)."""

    n: int = Field(1, ge=1, le=SIDECAR_MAX_N)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=SIDECAR_MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # -1 or 0 disables top-k.
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    seed: int | None = Field(None, ge=MIN_INT64, le=MAX_INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    # Top alternatives per sampled token (the sampled token's own logprob always comes with them).
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Only 0 (each prompt token's own logprob) is served.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # The answer carries no text: these change nothing but are what vLLM clients send.
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # prime-rl's vLLM: where in the prompt the MoE routing data starts; no routing data is returned here.
    routed_experts_prompt_start: int | None = Field(None, ge=0, le=MAX_INT32)
    # Honoured only at their neutral values (checked by name so the 400 says which one).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None


class GenerateRequest(_Request):
    model: str = Field(min_length=1)
    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: GenerateSamplingParams
    request_id: str | None = Field(None, min_length=1, max_length=SIDECAR_MAX_TAG_CHARS)
    stream: bool = False
    # Accepted and ignored: it keeps one caller's prompts out of another's prefix cache, and no KV cache
    # outlives a Sample call here.
    cache_salt: str | None = Field(None, max_length=SIDECAR_MAX_TAG_CHARS)
    # vLLM refuses any other priority unless it schedules by priority, as this server does not.
    priority: int = Field(0, ge=MIN_INT64, le=MAX_INT64)


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


class GenerateChoice(BaseModel):
    index: int
    logprobs: ChoiceLogprobs | None
    finish_reason: Literal["stop", "length"]
    token_ids: list[int]
    # RL extensions, as on the other routes.
    policy_version: int
    sample_key: str | None = None


class GenerateResponse(BaseModel):
    request_id: str
    model: str
    created: int
    choices: list[GenerateChoice]
    usage: Usage
    # vLLM's shape: None at position 0, then {token id: its logprob} per prompt token.
    prompt_logprobs: list[dict[str, PromptTokenLogprob] | None] | None = None
    # RL extensions (vLLM names), as on the other routes.
    prompt_token_ids: list[int]
    policy_version: int
