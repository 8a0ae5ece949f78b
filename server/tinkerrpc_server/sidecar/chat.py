"""`POST /v1/chat/completions`: a conversation in, one Sample call, a chat completion or its stream out.

The messages pass to the SDK as OpenAI-style dicts after each role's rules are checked; the server
renders them with the model's renderer. vLLM's chat extensions (`echo`, `chat_template_kwargs`'
enable_thinking) are honoured here; the sampling knobs are shared with the other endpoints.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Sequence
from typing import Any

from fastapi import APIRouter, Response

from tinkerrpc import Sample, SamplingOptions
from tinkerrpc.contract.sampling import SIDECAR_CHAT_MAX_TOKENS
from tinkerrpc_server.sidecar.chat_protocol import (
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageParam,
    ToolCallDelta,
    policy_token_spans,
    prompt_policy_token_spans,
)
from tinkerrpc_server.sidecar.completion_route import CompletionFamily, answer
from tinkerrpc_server.sidecar.errors import THINKING_FIELD, THINKING_PARAM, OpenAIError, bad_request
from tinkerrpc_server.sidecar.json_bounds import BoundedJSONRoute, check_json_text
from tinkerrpc_server.sidecar.models import ModelRef
from tinkerrpc_server.sidecar.openai_shapes import ChoiceLogprobs
from tinkerrpc_server.sidecar.prompt_logprobs import vllm_prompt_logprobs
from tinkerrpc_server.sidecar.sample_output import (
    ReplyHead,
    chat_logprob_entry,
    new_id,
    parse_chat_choice,
    rl_fields_asked,
    usage_of,
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
    check_sampling_fields,
    sampling_fields_args,
    tool_options,
)

ROUTE = "/v1/chat/completions"


def enable_thinking(kwargs: dict[str, Any] | None) -> bool | None:
    """chat_template_kwargs' enable_thinking (None when unset); the request kept only the keys a renderer
    option reads (`extensions.CHAT_TEMPLATE_KWARGS`), the others were ignored as vendor extensions."""
    value = (kwargs or {}).get("enable_thinking")
    if value is not None and not isinstance(value, bool):
        raise bad_request(f"{THINKING_PARAM} must be a boolean", THINKING_PARAM)
    return value


def thinking_asked(request: ChatCompletionRequest) -> bool | None:
    """Whether the request asks for thinking (None: the model's renderer as it is), from
    chat_template_kwargs' enable_thinking or OpenAI's reasoning_effort. The renderers think or do
    not, at one level: "none" asks for the thinking-disabled variant, any other effort for the
    thinking one; the two fields may not disagree."""
    from_kwargs = enable_thinking(request.chat_template_kwargs)
    if request.reasoning_effort is None:
        return from_kwargs
    from_effort = request.reasoning_effort != "none"
    if from_kwargs is not None and from_kwargs != from_effort:
        raise bad_request(
            f"reasoning_effort {request.reasoning_effort!r} asks for thinking "
            f"{'on' if from_effort else 'off'}, chat_template_kwargs.enable_thinking for the opposite",
            "reasoning_effort",
        )
    return from_effort


def name_as_sent(error: OpenAIError, request: ChatCompletionRequest) -> None:
    """Make the server's refusal of the thinking variant (a renderer without one) name the field the
    caller set, in param and message: reasoning_effort when it alone asked, else
    chat_template_kwargs.enable_thinking."""
    if error.param != THINKING_PARAM:
        return
    if enable_thinking(request.chat_template_kwargs) is None:
        error.param = "reasoning_effort"
    error.message = error.message.replace(THINKING_FIELD, error.param)


def _check_unsupported_chat(request: ChatCompletionRequest) -> None:
    refused: list[tuple[str, bool]] = [
        ("audio", request.audio is not None),
        ("modalities", any(m != "text" for m in request.modalities or ())),
        ("prediction", request.prediction is not None),
        ("verbosity", request.verbosity is not None),
        ("web_search_options", request.web_search_options is not None),
        ("functions", request.functions is not None),
        ("function_call", request.function_call is not None),
        *(
            (f"messages[{i}].function_call", m.function_call is not None)
            for i, m in enumerate(request.messages)
        ),
    ]
    for param, is_set in refused:
        if is_set:
            raise bad_request(f"{param} is not supported by the tinkerrpc sidecar", param)
    if request.response_format is not None and request.response_format.type != "text":
        raise bad_request(
            "only response_format {'type': 'text'} is supported: Tinker's sampler has no constrained "
            "decoding to hold a reply to a JSON schema",
            "response_format",
        )
    if request.top_logprobs and not request.logprobs:
        raise bad_request("top_logprobs requires logprobs to be true", "top_logprobs")
    if (
        request.max_tokens is not None
        and request.max_completion_tokens is not None
        and request.max_tokens != request.max_completion_tokens
    ):
        raise bad_request("max_tokens and max_completion_tokens disagree; set one", "max_completion_tokens")


def _message_text(message: ChatMessageParam, index: int) -> str:
    if message.content is None or isinstance(message.content, str):
        return message.content or ""
    texts: list[str] = []
    for j, part in enumerate(message.content):
        if part.type != "text" or part.text is None:
            raise bad_request(
                f"content part type {part.type!r} is not supported; only text parts are",
                f"messages[{index}].content[{j}]",
            )
        texts.append(part.text)
    return "".join(texts)


def chat_messages(request: ChatCompletionRequest) -> list[dict[str, Any]]:
    """The conversation as OpenAI-style dicts the SDK converts, after checking each role's rules."""
    out: list[dict[str, Any]] = []
    for i, message in enumerate(request.messages):
        where = f"messages[{i}]"
        if message.tool_calls and message.role != "assistant":
            raise bad_request("only assistant messages carry tool_calls", f"{where}.tool_calls")
        if message.role == "tool" and not message.tool_call_id:
            raise bad_request("a tool message needs tool_call_id", f"{where}.tool_call_id")
        if message.role != "tool" and message.tool_call_id:
            raise bad_request("only tool messages carry tool_call_id", f"{where}.tool_call_id")
        if message.content is None and not (message.role == "assistant" and message.tool_calls):
            raise bad_request("content is required (except for an assistant message with tool_calls)", where)
        converted: dict[str, Any] = {
            # OpenAI's `developer` role is the newer name of `system`.
            "role": "system" if message.role == "developer" else message.role,
            "content": _message_text(message, i),
        }
        if message.name:
            converted["name"] = message.name
        if message.tool_call_id:
            converted["tool_call_id"] = message.tool_call_id
        if message.tool_calls:
            for k, call in enumerate(message.tool_calls):
                check_json_text(call.function.arguments, f"{where}.tool_calls[{k}].function.arguments")
            converted["tool_calls"] = [
                call.model_dump(exclude={"provider_specific_fields"}) for call in message.tool_calls
            ]
        out.append(converted)
    return out


def chat_sample_args(request: ChatCompletionRequest, ref: ModelRef) -> SamplingOptions:
    check_sampling_fields(request)
    _check_unsupported_chat(request)
    max_tokens = request.max_completion_tokens or request.max_tokens or SIDECAR_CHAT_MAX_TOKENS
    top_logprobs = (request.top_logprobs or 0) if request.logprobs else 0
    thinking = thinking_asked(request)
    tools = tool_options(
        [t.model_dump(exclude_none=True) for t in request.tools or ()],
        [t.function.name for t in request.tools or ()],
        request.tool_choice,
        request.parallel_tool_calls,
    )
    return sampling_fields_args(request, ref, max_tokens, top_logprobs, enable_thinking=thinking, **tools)


def chat_echo(request: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's text when it is the assistant's (the reply continues it)."""
    last = request.messages[-1]
    return _message_text(last, len(request.messages) - 1) if request.echo and last.role == "assistant" else ""


def build_chat_completion(
    request: ChatCompletionRequest,
    ref: ModelRef,
    args: SamplingOptions,
    samples: Sequence[Sample],
    created: int,
) -> ChatCompletion:
    head = ReplyHead.of("chatcmpl", ref, samples, created)
    choices: list[ChatChoice] = []
    for index, sample in enumerate(samples):
        parsed = parse_chat_choice(sample, args.stop, request, chat_echo(request))
        logprobs = (
            ChoiceLogprobs(
                content=[
                    chat_logprob_entry(sample, p, request.return_tokens_as_token_ids)
                    for p in range(len(sample.tokens))
                ]
            )
            if request.logprobs
            else None
        )
        choices.append(
            ChatChoice(
                index=index,
                message=AssistantMessage(content=parsed.content, tool_calls=parsed.tool_calls or None),
                finish_reason=parsed.finish_reason,
                logprobs=logprobs,
                token_ids=list(sample.tokens),
                policy_version=sample.policy_version,
                sample_key=sample.sample_key or None,
                policy_token_spans=policy_token_spans(head.model, head.policy_version, 0, len(sample.tokens)),
                prompt_policy_token_spans=prompt_policy_token_spans(
                    head.model, head.policy_version, len(sample.prompt_token_ids)
                ),
            )
        )
    return ChatCompletion(
        **head.body_fields(samples), choices=choices, prompt_logprobs=vllm_prompt_logprobs(samples)
    )


async def chat_stream_chunks(
    request: ChatCompletionRequest, ref: ModelRef, args: SamplingOptions, opened: OpenedStream, created: int
) -> AsyncIterator[ChatCompletionChunk]:
    """The chunks of a streamed chat completion, each choice's as its tokens arrive (OpenAI interleaves
    choices by index the same way), its content as sample_streams.ChoiceContent lets it go.

    When asked (`rl_fields_asked`), the first chunk carries `prompt_token_ids` and each choice's first
    chunk its `policy_version` and `prompt_policy_token_spans` (openai's stream helper keeps a choice's
    fields from its first chunk); each delta carries its `token_ids` and the last its `sample_key` (the
    helper joins the deltas' lists on the message, where `Trajectory.from_openai` finds them). Each chunk
    with tokens also carries them on its choice, as vLLM does, with the `policy_token_spans` of their
    interval: ART's stream reader joins these into the plain choice's fields, and a reader that stops
    early holds the provenance of every token it got."""
    head = ReplyHead(new_id("chatcmpl"), created, ref.served_id(opened.policy_version), opened.policy_version)
    rl_fields = rl_fields_asked(request.return_token_ids, request.logprobs)

    def chunk(choices: list[ChatChunkChoice], **extra: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(**head.fields(), choices=choices, **extra)

    echo = chat_echo(request)
    # A forced call's head is written by the renderer: every sampled token belongs to the call.
    held = bool(args.force_tool_call)
    contents = [ChoiceContent(chat=True, stops=args.stop, held=held) for _ in range(args.n)]
    for index in range(args.n):
        first = ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=echo))
        if not rl_fields:
            yield chunk([first])
            continue
        first.policy_version = opened.policy_version
        first.prompt_policy_token_spans = prompt_policy_token_spans(
            head.model, head.policy_version, len(opened.head.prompt_token_ids)
        )
        prompt_ids = list(opened.head.prompt_token_ids) if index == 0 else None
        yield chunk([first], prompt_token_ids=prompt_ids, policy_version=head.policy_version)
    samples: tuple[Sample, ...] = ()
    sent_tokens = [0] * args.n
    async for item in deltas_then_samples(opened):
        if isinstance(item, tuple):
            samples = item
            break
        text = contents[item.index].take(item)
        logprobs = None
        if request.logprobs:
            part = delta_sample(item, opened.policy_version)
            entries = [
                chat_logprob_entry(part, p, request.return_tokens_as_token_ids)
                for p in range(len(item.tokens))
            ]
            logprobs = ChoiceLogprobs(content=entries)
        if not (text or logprobs is not None or rl_fields):
            continue
        piece = ChatChunkChoice(index=item.index, delta=ChatDelta(content=text), logprobs=logprobs)
        if rl_fields and item.tokens:
            start = sent_tokens[item.index]
            sent_tokens[item.index] += len(item.tokens)
            piece.delta.token_ids = piece.token_ids = list(item.tokens)
            piece.policy_token_spans = policy_token_spans(
                head.model, head.policy_version, start, sent_tokens[item.index]
            )
        elif rl_fields:
            piece.delta.token_ids = []
        yield chunk([piece])
    parsed = [parse_chat_choice(s, args.stop, request, echo) for s in samples]
    for index, choice in enumerate(parsed):
        rest = contents[index].finish((choice.content or "")[len(echo) :])
        if rest:
            yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(content=rest))])
        if choice.tool_calls:
            deltas = [
                ToolCallDelta(index=k, id=call.id, function=call.function)
                for k, call in enumerate(choice.tool_calls)
            ]
            yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=deltas))])
    for index, (choice, sample) in enumerate(zip(parsed, samples, strict=True)):
        last = ChatDelta(sample_key=(sample.sample_key or None) if rl_fields else None)
        yield chunk([ChatChunkChoice(index=index, delta=last, finish_reason=choice.finish_reason)])
    if request.stream_options is not None and request.stream_options.include_usage:
        yield chunk([], usage=usage_of(samples))


CHAT = CompletionFamily(ROUTE, chat_sample_args, chat_messages, build_chat_completion, chat_stream_chunks)


def create_router(sample: Sampler, stream: StreamSampler) -> APIRouter:
    router = APIRouter(route_class=BoundedJSONRoute)

    @router.post(ROUTE, response_model=None)
    async def chat_completions(request: ChatCompletionRequest) -> Response:
        try:
            return await answer(CHAT, request, sample, stream)
        except OpenAIError as error:
            name_as_sent(error, request)
            raise

    return router
