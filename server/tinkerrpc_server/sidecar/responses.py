"""`POST /v1/responses`: OpenAI's Responses API over the same Sample call as chat completions.

Stateless: nothing is stored, so `previous_response_id` is refused and callers send the whole
conversation as `input`. One sample per request (the Responses API has no `n`). Every output item
of the sampled turn carries the RL fields `token_ids`, `prompt_token_ids`, `policy_version` and,
when logprobs are asked, `token_logprobs` (one per token id) — on plain responses unless
`return_token_ids` is false, in a stream only when logprobs or `return_token_ids` ask.
"""

from __future__ import annotations

import time
from collections.abc import AsyncIterator, Iterator
from typing import Any, Literal

from fastapi import APIRouter, Response
from pydantic import BaseModel, ValidationError

from tinkerrpc import Sample, SamplingOptions, messages_from_response_input
from tinkerrpc.contract.sampling import SIDECAR_CHAT_MAX_TOKENS
from tinkerrpc_server.sidecar import sample_output
from tinkerrpc_server.sidecar.errors import bad_request, param_from_loc
from tinkerrpc_server.sidecar.json_bounds import BoundedJSONRoute, check_json_text
from tinkerrpc_server.sidecar.models import ModelRef, parse_model_id
from tinkerrpc_server.sidecar.responses_protocol import (
    INPUT_ITEMS,
    FunctionCallInput,
    FunctionTool,
    OutputFunctionCall,
    OutputMessage,
    OutputText,
    ResponseObject,
    ResponseRequest,
    ResponseUsage,
)
from tinkerrpc_server.sidecar.sample_streams import (
    ChoiceContent,
    OpenedStream,
    StreamSampler,
    delta_sample,
    deltas_then_samples,
)
from tinkerrpc_server.sidecar.sampling_args import (
    Sampler,
    base_sample_args,
    tool_options,
)
from tinkerrpc_server.sidecar.streaming import typed_event_stream

# The turn's RL fields, left off an output item until it is done.
_TURN_FIELDS = ("token_ids", "prompt_token_ids", "policy_version", "token_logprobs", "sample_key")

ROUTE = "/v1/responses"


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
    text_format = request.text.format if request.text is not None else None
    if text_format is not None and text_format.type != "text":
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
            if kind not in INPUT_ITEMS:
                raise bad_request(
                    f"input item type {kind!r} is not supported; supported: {', '.join(INPUT_ITEMS)}",
                    f"input[{i}].type",
                )
            item = _validated(INPUT_ITEMS[kind], raw, f"input[{i}]")
            if isinstance(item, FunctionCallInput):
                check_json_text(item.arguments, f"input[{i}].arguments")
            checked.append(item.model_dump())
        items = checked
    try:
        messages = messages_from_response_input(items, request.instructions)
    except ValueError as error:
        raise bad_request(str(error), "input") from error
    return [m.to_openai() for m in messages]


def sample_args(request: ResponseRequest, ref: ModelRef) -> SamplingOptions:
    _check_request(request)
    tools = function_tools(request)
    offered = [
        {"type": "function", "function": t.model_dump(exclude_none=True, exclude={"type"})} for t in tools
    ]
    return base_sample_args(
        request,
        ref,
        n=1,
        max_tokens=request.max_output_tokens or SIDECAR_CHAT_MAX_TOKENS,
        top_logprobs=(request.top_logprobs or 0) if request.logprobs_asked else 0,
        **tool_options(offered, [t.name for t in tools], request.tool_choice, request.parallel_tool_calls),
    )


def response_shell(request: ResponseRequest, ref: ModelRef, version: int, created: int) -> ResponseObject:
    """The response before anything is sampled: in progress, no output yet."""
    return ResponseObject(
        id=sample_output.new_id("resp"),
        created_at=created,
        status="in_progress",
        model=ref.served_id(version),
        instructions=request.instructions,
        output=[],
        parallel_tool_calls=request.parallel_tool_calls is not False,
        tool_choice=request.tool_choice or "auto",
        tools=function_tools(request),
        temperature=request.temperature,
        top_p=request.top_p,
        top_logprobs=request.top_logprobs,
        max_output_tokens=request.max_output_tokens,
        metadata=request.metadata or {},
    )


def build_response(
    request: ResponseRequest, ref: ModelRef, sample: Sample, created: int, *, rl_fields: bool
) -> ResponseObject:
    parsed = sample_output.parse_chat_choice(sample, ())
    status: Literal["completed", "incomplete"] = (
        "incomplete" if parsed.finish_reason == "length" else "completed"
    )
    stamp: dict[str, Any] = {"status": status}
    if rl_fields:
        stamp.update(
            token_ids=list(sample.tokens),
            prompt_token_ids=list(sample.prompt_token_ids),
            policy_version=sample.policy_version,
            sample_key=sample.sample_key or None,
            token_logprobs=list(sample.logprobs) if request.logprobs_asked else None,
        )
    output: list[OutputMessage | OutputFunctionCall] = []
    if parsed.content or not parsed.tool_calls:
        logprobs = (
            [sample_output.chat_logprob_entry(sample, p, False) for p in range(len(sample.tokens))]
            if request.logprobs_asked
            else None
        )
        text = OutputText(text=parsed.content or "", logprobs=logprobs)
        output.append(OutputMessage(id=sample_output.new_id("msg"), content=[text], **stamp))
    output.extend(
        OutputFunctionCall(
            id=sample_output.new_id("fc"),
            call_id=call.id,
            name=call.function.name,
            arguments=call.function.arguments,
            **stamp,
        )
        for call in parsed.tool_calls
    )
    usage = sample_output.usage_of([sample])
    return response_shell(request, ref, sample.policy_version, created).model_copy(
        update={
            "completed_at": int(time.time()),
            "status": status,
            "incomplete_details": {"reason": "max_output_tokens"} if status == "incomplete" else None,
            "output": output,
            "usage": ResponseUsage(
                input_tokens=usage.prompt_tokens,
                output_tokens=usage.completion_tokens,
                total_tokens=usage.total_tokens,
            ),
        }
    )


def _dump(model: BaseModel) -> dict[str, Any]:
    return model.model_dump(exclude_none=True)


async def stream_events(
    request: ResponseRequest, ref: ModelRef, args: SamplingOptions, opened: OpenedStream, created: int
) -> AsyncIterator[dict[str, Any]]:
    """The documented event sequence, the message's text deltas as its tokens arrive (as
    sample_streams.ChoiceContent lets them go, with their tokens' logprobs), the function calls and the
    final response once the sample is there. A truncated answer ends with `response.incomplete` instead
    of `response.completed`, as OpenAI's does."""
    sequence = iter(range(1 << 62))

    def event(kind: str, **fields: Any) -> dict[str, Any]:
        return {"type": kind, "sequence_number": next(sequence), **fields}

    shell = response_shell(request, ref, opened.policy_version, created)
    yield event("response.created", response=_dump(shell))
    yield event("response.in_progress", response=_dump(shell))
    message_id = sample_output.new_id("msg")
    opened_message = False
    # A Responses request has no stop strings; a forced call's head is the renderer's, its tokens the call's.
    content = ChoiceContent(chat=True, held=bool(args.force_tool_call))
    pending: list[dict[str, Any]] = []  # logprob entries of tokens whose text is not sent yet
    where = {"item_id": message_id, "output_index": 0}

    def open_message() -> Iterator[dict[str, Any]]:
        item = OutputMessage(id=message_id, status="in_progress", content=[])
        yield event("response.output_item.added", output_index=0, item=_dump(item))
        yield event("response.content_part.added", **where, content_index=0, part=_dump(OutputText(text="")))

    sample: Sample | None = None
    async for item in deltas_then_samples(opened):
        if isinstance(item, tuple):
            (sample,) = item
            break
        text = content.take(item)
        if request.logprobs_asked:
            part = delta_sample(item, opened.policy_version)
            pending += [
                _dump(sample_output.chat_logprob_entry(part, p, False)) for p in range(len(item.tokens))
            ]
        if text:
            if not opened_message:
                opened_message = True
                for opening in open_message():
                    yield opening
            yield event("response.output_text.delta", **where, content_index=0, delta=text, logprobs=pending)
            pending = []
    assert sample is not None
    rl_fields = sample_output.rl_fields_asked(request.return_token_ids, request.logprobs_asked)
    final = build_response(request, ref, sample, created, rl_fields=rl_fields).model_copy(
        update={"id": shell.id}
    )
    for index, output in enumerate(final.output):
        if isinstance(output, OutputMessage):
            output = output.model_copy(update={"id": message_id})
            final.output[index] = output
            if not opened_message:
                for opening in open_message():
                    yield opening
            (text_part,) = output.content
            rest = content.finish(text_part.text)
            if rest:
                yield event(
                    "response.output_text.delta", **where, content_index=0, delta=rest, logprobs=pending
                )
            all_logprobs = [_dump(e) for e in text_part.logprobs or ()]
            yield event(
                "response.output_text.done",
                **where,
                content_index=0,
                text=text_part.text,
                logprobs=all_logprobs,
            )
            yield event("response.content_part.done", **where, content_index=0, part=_dump(text_part))
        else:
            call_where = {"item_id": output.id, "output_index": index}
            opened_call = output.model_copy(
                update={"status": "in_progress", "arguments": "", **dict.fromkeys(_TURN_FIELDS)}
            )
            yield event("response.output_item.added", output_index=index, item=_dump(opened_call))
            yield event("response.function_call_arguments.delta", **call_where, delta=output.arguments)
            yield event(
                "response.function_call_arguments.done",
                **call_where,
                name=output.name,
                arguments=output.arguments,
            )
        yield event("response.output_item.done", output_index=index, item=_dump(output))
    ending = "response.completed" if final.status == "completed" else "response.incomplete"
    yield event(ending, response=_dump(final))


def create_router(sample: Sampler, stream: StreamSampler) -> APIRouter:
    router = APIRouter(route_class=BoundedJSONRoute)

    @router.post(ROUTE, response_model=None)
    async def create_response(request: ResponseRequest) -> Response:
        ref = parse_model_id(request.model)
        args = sample_args(request, ref)
        if request.stream:
            opened = await stream(ROUTE, ref, prompt_messages(request), args)
            events = stream_events(request, ref, args, opened, int(time.time()))
            return typed_event_stream(events, opened.close, ref.requested)
        (sampled,) = await sample(ROUTE, ref, prompt_messages(request), args)
        created = int(time.time())
        body = build_response(request, ref, sampled, created, rl_fields=request.return_token_ids is not False)
        return Response(body.model_dump_json(exclude_none=True), media_type="application/json")

    return router
