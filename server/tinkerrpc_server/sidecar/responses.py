"""`POST /v1/responses`: OpenAI's Responses API over the same Sample call as chat completions.

Stateless: nothing is stored, so `previous_response_id` is refused and callers send the whole
conversation as `input`. One sample per request (the Responses API has no `n`). Every output item
of the sampled turn carries the RL fields `token_ids`, `prompt_token_ids`, `policy_version` and,
when logprobs are asked, `token_logprobs` (one per token id) — on plain responses unless
`return_token_ids` is false, in a stream only when logprobs or `return_token_ids` ask.
"""

from __future__ import annotations

import time
from collections.abc import Iterator
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
from tinkerrpc_server.sidecar.sampling_args import (
    Sampler,
    base_sample_args,
    tool_options,
)
from tinkerrpc_server.sidecar.streaming import typed_event_stream

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
    return ResponseObject(
        id=sample_output.new_id("resp"),
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
            pieces = sample_output.split_by_tokens(part.text, sample)
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


def create_router(sample: Sampler) -> APIRouter:
    router = APIRouter(route_class=BoundedJSONRoute)

    @router.post(ROUTE, response_model=None)
    async def create_response(request: ResponseRequest) -> Response:
        ref = parse_model_id(request.model)
        args = sample_args(request, ref)
        samples = await sample(ROUTE, ref, prompt_messages(request), args)
        (sampled,) = samples
        created = int(time.time())
        if request.stream:
            rl_fields = sample_output.rl_fields_asked(request.return_token_ids, request.logprobs_asked)
            final = build_response(request, ref, sampled, created, rl_fields=rl_fields)
            return typed_event_stream(stream_events(final, sampled))
        body = build_response(request, ref, sampled, created, rl_fields=request.return_token_ids is not False)
        return Response(body.model_dump_json(exclude_none=True), media_type="application/json")

    return router
