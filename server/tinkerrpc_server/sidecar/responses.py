"""`POST /v1/responses`: OpenAI's Responses API over the same Sample call as chat completions.

Stateless: nothing is stored, so `previous_response_id` is refused and callers send the whole
conversation as `input`. One sample per request (the Responses API has no `n`). Every output item
of the sampled turn carries the RL fields `token_ids`, `prompt_token_ids`, `policy_version` and,
when logprobs are asked, `token_logprobs` (one per token id) — on plain responses unless
`return_token_ids` is false, in a stream only when logprobs or `return_token_ids` ask.
The shapes follow the `openai` package's `openai.types.responses`. (Slightly over 400 lines: the
request, response and stream shapes of this one endpoint are read together.)
"""

from __future__ import annotations

import json
import time
from collections.abc import Awaitable, Callable, Iterator
from typing import Any, Literal

from fastapi import APIRouter, Response
from fastapi.responses import StreamingResponse
from pydantic import BaseModel, ConfigDict, Field, ValidationError

from tinkerrpc import Sample, messages_from_response_input
from tinkerrpc_server.sidecar import translate
from tinkerrpc_server.sidecar.errors import bad_request, param_from_loc
from tinkerrpc_server.sidecar.protocol import MAX_TOP_LOGPROBS, TokenLogprobEntry

LOGPROBS_INCLUDE = "message.output_text.logprobs"

# ---------------------------------------------------------------- request


class _Request(BaseModel):
    model_config = ConfigDict(extra="forbid")


class _InputItem(BaseModel):
    # Items echoed from an earlier response's output carry ids, status and the RL fields.
    model_config = ConfigDict(extra="ignore")


class InputTextPart(BaseModel):
    model_config = ConfigDict(extra="ignore")
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


_INPUT_ITEMS: dict[str, type[_InputItem]] = {
    "message": InputMessage,
    "function_call": FunctionCallInput,
    "function_call_output": FunctionCallOutputInput,
}


class FunctionTool(BaseModel):
    model_config = ConfigDict(extra="ignore")
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
    max_output_tokens: int | None = Field(None, ge=1)
    temperature: float | None = Field(None, ge=0.0, le=2.0)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    top_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    include: list[str] | None = None
    stream: bool = False
    previous_response_id: str | None = None
    text: dict[str, Any] | None = None
    reasoning: dict[str, Any] | None = None
    background: bool | None = None
    conversation: str | dict[str, Any] | None = None
    prompt: dict[str, Any] | None = None
    # Accepted and ignored: they do not change what is sampled (nothing is stored).
    store: bool | None = None
    stream_options: dict[str, Any] | None = None
    parallel_tool_calls: bool | None = None
    max_tool_calls: int | None = None
    metadata: dict[str, str] | None = None
    user: str | None = None
    safety_identifier: str | None = None
    prompt_cache_key: str | None = None
    service_tier: str | None = None
    truncation: str | None = None
    # RL extensions (vLLM names), as on chat completions.
    top_k: int | None = Field(None, ge=-1)
    seed: int | None = None
    return_token_ids: bool | None = None

    @property
    def logprobs_asked(self) -> bool:
        return LOGPROBS_INCLUDE in (self.include or ()) or bool(self.top_logprobs)


def _validated(model: type[BaseModel], raw: dict[str, Any], where: str) -> Any:
    try:
        return model.model_validate(raw)
    except ValidationError as error:
        # The deepest location is the most specific one (a union reports every member's failure).
        first = max(error.errors(), key=lambda e: len(e["loc"]))
        param = ".".join(p for p in (where, param_from_loc(tuple(first["loc"]))) if p)
        raise bad_request(f"Invalid value for {param}: {first['msg']}", param) from error


def _check_request(request: ResponseRequest) -> None:
    """400 naming the first thing the sidecar cannot honour."""
    if request.previous_response_id is not None:
        raise bad_request(
            "previous_response_id is not supported: the sidecar stores no responses; "
            "send the whole conversation as input",
            "previous_response_id",
        )
    refused = (
        ("background", bool(request.background)),
        ("conversation", request.conversation is not None),
        ("prompt", request.prompt is not None),
        ("reasoning", request.reasoning is not None),
    )
    for param, is_set in refused:
        if is_set:
            raise bad_request(f"{param} is not supported by the tinkerrpc sidecar", param)
    text_format = (request.text or {}).get("format") or {"type": "text"}
    if text_format.get("type") != "text":
        raise bad_request(
            "only text.format {'type': 'text'} is supported: Tinker's sampler has no constrained "
            "decoding to hold a reply to a JSON schema",
            "text.format",
        )


def function_tools(request: ResponseRequest) -> list[FunctionTool]:
    for i, raw in enumerate(request.tools or ()):
        if raw.get("type") != "function":
            raise bad_request(
                f"tool type {raw.get('type')!r} is not supported; only function tools are", f"tools[{i}]"
            )
    return [_validated(FunctionTool, raw, f"tools[{i}]") for i, raw in enumerate(request.tools or ())]


def prompt_messages(request: ResponseRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI chat message dicts, after checking every input item's shape."""
    items: str | list[dict[str, Any]] = request.input
    if isinstance(items, list):
        if not items:
            raise bad_request("input must not be empty", "input")
        checked = []
        for i, raw in enumerate(items):
            kind = raw.get("type", "message")
            if kind not in _INPUT_ITEMS:
                raise bad_request(
                    f"input item type {kind!r} is not supported; supported: {', '.join(_INPUT_ITEMS)}",
                    f"input[{i}].type",
                )
            checked.append(_validated(_INPUT_ITEMS[kind], raw, f"input[{i}]").model_dump())
        items = checked
    try:
        messages = messages_from_response_input(items, request.instructions)
    except ValueError as error:
        raise bad_request(str(error), "input") from error
    return [m.to_openai() for m in messages]


def sample_args(request: ResponseRequest, ref: translate.ModelRef) -> translate.SampleArgs:
    _check_request(request)
    tools = function_tools(request)
    offered = [
        {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in tools
    ]
    return translate.SampleArgs(
        n=1,
        max_tokens=request.max_output_tokens or translate.DEFAULT_CHAT_MAX_TOKENS,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=request.top_p,
        top_k=max(request.top_k or 0, 0),
        stop=[],
        stop_token_ids=[],
        seed=request.seed,
        policy_version=ref.version,
        # With tool_choice "none" the tools are not offered to the model at all.
        tools=offered if offered and request.tool_choice != "none" else None,
        top_logprobs=(request.top_logprobs or 0) if request.logprobs_asked else 0,
        return_token_texts=True,
        ignore_default_stops=False,
        force_tool_call=translate.forced_tool_call(request.tool_choice, [t.name for t in tools]),
        parallel_tool_calls=request.parallel_tool_calls is not False,
    )


# ---------------------------------------------------------------- response


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


def build_response(
    request: ResponseRequest, ref: translate.ModelRef, sample: Sample, created: int, *, rl_fields: bool
) -> ResponseObject:
    parsed = translate.parse_chat_choice(sample, ())
    status: Literal["completed", "incomplete"] = (
        "incomplete" if parsed.finish_reason == "length" else "completed"
    )
    stamp: dict[str, Any] = {"status": status}
    if rl_fields:
        stamp.update(
            token_ids=list(sample.tokens),
            prompt_token_ids=list(sample.prompt_token_ids),
            policy_version=sample.policy_version,
            token_logprobs=list(sample.logprobs) if request.logprobs_asked else None,
        )
    output: list[OutputMessage | OutputFunctionCall] = []
    if parsed.content or not parsed.tool_calls:
        logprobs = (
            [translate.chat_logprob_entry(sample, p, False) for p in range(len(sample.tokens))]
            if request.logprobs_asked
            else None
        )
        text = OutputText(text=parsed.content or "", logprobs=logprobs)
        output.append(OutputMessage(id=translate.new_id("msg"), content=[text], **stamp))
    output.extend(
        OutputFunctionCall(
            id=translate.new_id("fc"),
            call_id=call.id,
            name=call.function.name,
            arguments=call.function.arguments,
            **stamp,
        )
        for call in parsed.tool_calls
    )
    usage = translate.usage_of([sample])
    return ResponseObject(
        id=translate.new_id("resp"),
        created_at=created,
        completed_at=int(time.time()),
        status=status,
        incomplete_details={"reason": "max_output_tokens"} if status == "incomplete" else None,
        model=ref.served_id(sample.policy_version),
        instructions=request.instructions,
        output=output,
        parallel_tool_calls=request.parallel_tool_calls is not False,
        tool_choice=request.tool_choice or "auto",
        tools=function_tools(request),
        temperature=request.temperature,
        top_p=request.top_p,
        top_logprobs=request.top_logprobs,
        max_output_tokens=request.max_output_tokens,
        metadata=request.metadata or {},
        usage=ResponseUsage(
            input_tokens=usage.prompt_tokens,
            output_tokens=usage.completion_tokens,
            total_tokens=usage.total_tokens,
        ),
    )


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(exclude_none=True)


def stream_events(final: ResponseObject, sample: Sample) -> Iterator[dict[str, Any]]:
    """The documented event sequence for `final`, replayed (the Sample call is unary).

    A truncated answer ends with `response.incomplete` instead of `response.completed`, as OpenAI's does.
    """
    sequence = iter(range(1 << 62))

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(sequence), **fields}

    started = final.model_copy(
        update={
            "status": "in_progress",
            "output": [],
            "usage": None,
            "completed_at": None,
            "incomplete_details": None,
        }
    )
    yield event("response.created", response=_dump(started))
    yield event("response.in_progress", response=_dump(started))
    for index, item in enumerate(final.output):
        rl_fields = dict.fromkeys(("token_ids", "prompt_token_ids", "policy_version", "token_logprobs"))
        empty: dict[str, Any] = {"content": []} if isinstance(item, OutputMessage) else {"arguments": ""}
        opened = item.model_copy(update={"status": "in_progress", **rl_fields, **empty})
        yield event("response.output_item.added", output_index=index, item=_dump(opened))
        where = {"item_id": item.id, "output_index": index}
        if isinstance(item, OutputMessage):
            (part,) = item.content
            yield event(
                "response.content_part.added", **where, content_index=0, part=_dump(OutputText(text=""))
            )
            pieces = translate.split_by_tokens(part.text, sample.token_texts, len(sample.tokens))
            for position, piece in enumerate(pieces):
                if piece:
                    entries = part.logprobs[position : position + 1] if part.logprobs else []
                    yield event(
                        "response.output_text.delta",
                        **where,
                        content_index=0,
                        delta=piece,
                        logprobs=[_dump(e) for e in entries],
                    )
            all_logprobs = [_dump(e) for e in part.logprobs or ()]
            yield event(
                "response.output_text.done", **where, content_index=0, text=part.text, logprobs=all_logprobs
            )
            yield event("response.content_part.done", **where, content_index=0, part=_dump(part))
        else:
            yield event("response.function_call_arguments.delta", **where, delta=item.arguments)
            yield event(
                "response.function_call_arguments.done", **where, name=item.name, arguments=item.arguments
            )
        yield event("response.output_item.done", output_index=index, item=_dump(item))
    ending = "response.completed" if final.status == "completed" else "response.incomplete"
    yield event(ending, response=_dump(final))


def _sse(events: Iterator[dict[str, Any]]) -> Iterator[str]:
    for payload in events:
        yield f"event: {payload['type']}\ndata: {json.dumps(payload)}\n\n"


Sampler = Callable[[translate.ModelRef, translate.Prompt, translate.SampleArgs], Awaitable[list[Sample]]]


def create_router(sample: Sampler, count_tokens: Callable[[str, list[Sample]], None]) -> APIRouter:
    """The `/v1/responses` route, sampling through the app's `sample` (which maps gRPC errors)."""
    router = APIRouter()

    @router.post("/v1/responses", response_model=None)
    async def create_response(request: ResponseRequest) -> Response:
        ref = translate.parse_model_id(request.model)
        args = sample_args(request, ref)
        samples = await sample(ref, prompt_messages(request), args)
        count_tokens("/v1/responses", samples)
        (sampled,) = samples
        created = int(time.time())
        if request.stream:
            rl_fields = bool(request.return_token_ids) or (
                request.logprobs_asked and request.return_token_ids is not False
            )
            final = build_response(request, ref, sampled, created, rl_fields=rl_fields)
            return StreamingResponse(_sse(stream_events(final, sampled)), media_type="text/event-stream")
        body = build_response(request, ref, sampled, created, rl_fields=request.return_token_ids is not False)
        return Response(body.model_dump_json(exclude_none=True), media_type="application/json")

    return router
