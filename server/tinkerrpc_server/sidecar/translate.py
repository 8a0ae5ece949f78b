"""OpenAI requests → Sample arguments, and SDK samples → OpenAI responses and stream chunks.

Pure functions: no I/O, so every mapping is testable without a server.
"""

from __future__ import annotations

import dataclasses
import re
import uuid
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from typing import Any, Literal

from tinkerrpc import ModelInfo, Sample
from tinkerrpc_server.sidecar.errors import bad_request, model_not_found
from tinkerrpc_server.sidecar.protocol import (
    MAX_STOP_SEQUENCES,
    AssistantMessage,
    ChatChoice,
    ChatChunkChoice,
    ChatCompletion,
    ChatCompletionChunk,
    ChatCompletionRequest,
    ChatDelta,
    ChatMessageParam,
    ChoiceLogprobs,
    Completion,
    CompletionChoice,
    CompletionRequest,
    FinishReason,
    FunctionCall,
    LegacyLogprobs,
    ModelCard,
    ModelList,
    SamplingFields,
    TokenLogprobEntry,
    ToolCall,
    ToolCallDelta,
    TopLogprobEntry,
    Usage,
)

# Chat requests that set neither max_tokens nor max_completion_tokens get this budget.
DEFAULT_CHAT_MAX_TOKENS = 512
_MODEL_NAME = re.compile(r"[A-Za-z0-9][A-Za-z0-9._-]{0,63}")


@dataclass(frozen=True)
class ModelRef:
    """A requested model id: `name` (latest version) or `name@N` (pinned policy version N)."""

    requested: str
    name: str
    version: int | None

    def served_id(self, produced_version: int) -> str:
        return f"{self.name}@{produced_version}"


def parse_model_id(model: str) -> ModelRef:
    name, at, version_text = model.partition("@")
    if not _MODEL_NAME.fullmatch(name):
        raise model_not_found(model, "model ids are `name` or `name@<policy version>`")
    if not at:
        return ModelRef(model, name, None)
    if not version_text.isdigit():
        raise model_not_found(model, f"`{version_text}` is not a policy version (a non-negative integer)")
    return ModelRef(model, name, int(version_text))


@dataclass(frozen=True)
class SampleArgs:
    """Keyword arguments of the SDK's `model.sample(...)`, decided from an OpenAI request."""

    n: int
    max_tokens: int
    temperature: float
    top_p: float | None
    top_k: int
    stop: list[str]
    stop_token_ids: list[int]
    seed: int | None
    policy_version: int | None
    tools: list[dict[str, Any]] | None
    top_logprobs: int
    # Always on: stream deltas and OpenAI logprob tokens are built from the tokens' texts.
    return_token_texts: bool
    ignore_default_stops: bool
    min_tokens: int = 0
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    return_prompt_text: bool = False
    enable_thinking: bool | None = None
    # True: a call to any of the tools; a name: a call to that function.
    force_tool_call: bool | str = False
    parallel_tool_calls: bool = True

    def sdk_kwargs(self) -> dict[str, Any]:
        return dataclasses.asdict(self)


# What the SDK accepts as a prompt: raw text, token ids, or OpenAI-style message dicts.
Prompt = str | list[int] | list[dict[str, Any]]


def _stop_list(stop: str | list[str] | None) -> list[str]:
    stops = [stop] if isinstance(stop, str) else list(stop or [])
    if len(stops) > MAX_STOP_SEQUENCES:
        raise bad_request(
            f"at most {MAX_STOP_SEQUENCES} stop sequences are supported, got {len(stops)}", "stop"
        )
    if any(not s for s in stops):
        raise bad_request("stop sequences must be non-empty strings", "stop")
    return stops


def _check_unsupported_sampling(request: SamplingFields) -> None:
    """400 naming the first parameter the sampler cannot honour."""
    penalties = (
        ("presence_penalty", request.presence_penalty, 0.0),
        ("frequency_penalty", request.frequency_penalty, 0.0),
        ("repetition_penalty", request.repetition_penalty, 1.0),
    )
    for param, value, neutral in penalties:
        if value is not None and value != neutral:
            raise bad_request(
                f"{param}={value} cannot be honoured: Tinker's sampler has no {param} knob "
                f"(only the neutral {neutral} is accepted)",
                param,
            )
    if request.logit_bias:
        raise bad_request("logit_bias is not supported", "logit_bias")
    if request.stream_options is not None and not request.stream:
        raise bad_request("stream_options is only allowed when stream is true", "stream_options")
    if any(t < 0 for t in request.stop_token_ids or ()):
        raise bad_request("stop_token_ids must be non-negative token ids", "stop_token_ids")


def _common_args(
    request: SamplingFields,
    ref: ModelRef,
    max_tokens: int,
    top_logprobs: int,
    tools: list[dict[str, Any]] | None,
    **chat_options: Any,
) -> SampleArgs:
    if request.min_tokens > max_tokens:
        raise bad_request(
            f"min_tokens ({request.min_tokens}) must not exceed max_tokens ({max_tokens})", "min_tokens"
        )
    return SampleArgs(
        n=request.n,
        max_tokens=max_tokens,
        temperature=1.0 if request.temperature is None else request.temperature,
        top_p=request.top_p,
        top_k=max(request.top_k or 0, 0),
        stop=_stop_list(request.stop),
        stop_token_ids=list(request.stop_token_ids or ()),
        seed=request.seed,
        policy_version=ref.version,
        tools=tools,
        top_logprobs=top_logprobs,
        return_token_texts=True,
        ignore_default_stops=request.ignore_eos,
        min_tokens=request.min_tokens,
        skip_special_tokens=request.skip_special_tokens,
        spaces_between_special_tokens=request.spaces_between_special_tokens,
        **chat_options,
    )


def forced_tool_call(tool_choice: str | dict[str, Any] | None, tool_names: Sequence[str]) -> bool | str:
    """What a tool_choice forces: nothing (False), a call to any tool (True) or to the named function.
    A named choice is `{"type": "function", "function": {"name": N}}` (chat) or `{"type": "function",
    "name": N}` (Responses)."""
    if tool_choice in (None, "auto", "none"):
        return False
    if tool_choice == "required":
        if not tool_names:
            raise bad_request("tool_choice 'required' needs tools", "tool_choice")
        return True
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function":
        function = tool_choice.get("function")
        name = function.get("name") if isinstance(function, dict) else tool_choice.get("name")
        if not isinstance(name, str) or name not in tool_names:
            raise bad_request(
                f"tool_choice names function {name!r}, which is not one of the tools", "tool_choice"
            )
        return name
    raise bad_request(
        "tool_choice must be 'auto', 'none', 'required' or a function ({'type': 'function', ...})",
        "tool_choice",
    )


# chat_template_kwargs keys that mean something here: each maps to a renderer option.
CHAT_TEMPLATE_KWARGS = ("enable_thinking",)


def enable_thinking(kwargs: dict[str, Any] | None) -> bool | None:
    """chat_template_kwargs' enable_thinking (None when unset), after refusing keys the renderer cannot
    honour: a chat template's variables are not ours to render, only the renderer's variants are."""
    for key in kwargs or {}:
        if key not in CHAT_TEMPLATE_KWARGS:
            raise bad_request(
                f"chat_template_kwargs key {key!r} is not supported: the model's renderer takes only "
                f"{', '.join(CHAT_TEMPLATE_KWARGS)} (its thinking or thinking-disabled variant)",
                f"chat_template_kwargs.{key}",
            )
    value = (kwargs or {}).get("enable_thinking")
    if value is not None and not isinstance(value, bool):
        raise bad_request(
            "chat_template_kwargs.enable_thinking must be a boolean", "chat_template_kwargs.enable_thinking"
        )
    return value


def _check_unsupported_chat(request: ChatCompletionRequest) -> None:
    refused: list[tuple[str, bool]] = [
        ("audio", request.audio is not None),
        ("modalities", any(m != "text" for m in request.modalities or ())),
        ("prediction", request.prediction is not None),
        ("reasoning_effort", request.reasoning_effort is not None),
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
    if request.response_format is not None and request.response_format.get("type") != "text":
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
            converted["tool_calls"] = [call.model_dump() for call in message.tool_calls]
        out.append(converted)
    return out


def chat_sample_args(request: ChatCompletionRequest, ref: ModelRef) -> SampleArgs:
    _check_unsupported_sampling(request)
    _check_unsupported_chat(request)
    max_tokens = request.max_completion_tokens or request.max_tokens or DEFAULT_CHAT_MAX_TOKENS
    # With tool_choice "none" the tools are not offered to the model at all.
    tools = (
        [t.model_dump(exclude_none=True) for t in request.tools or ()]
        if request.tool_choice != "none"
        else []
    )
    top_logprobs = (request.top_logprobs or 0) if request.logprobs else 0
    return _common_args(
        request,
        ref,
        max_tokens,
        top_logprobs,
        tools or None,
        enable_thinking=enable_thinking(request.chat_template_kwargs),
        force_tool_call=forced_tool_call(request.tool_choice, [t.function.name for t in request.tools or ()]),
        parallel_tool_calls=request.parallel_tool_calls is not False,
    )


def completion_prompt(request: CompletionRequest) -> str | list[int]:
    """The single prompt of a legacy completion: text or token ids."""
    prompt = request.prompt
    if isinstance(prompt, str):
        if not prompt:
            raise bad_request("prompt must not be empty", "prompt")
        return prompt
    if not prompt:
        raise bad_request("prompt must not be empty", "prompt")
    if all(isinstance(p, int) for p in prompt):
        tokens = [int(p) for p in prompt]  # type: ignore[arg-type]
        if any(t < 0 for t in tokens):
            raise bad_request("prompt token ids must be non-negative", "prompt")
        return tokens
    if len(prompt) > 1:
        raise bad_request("batches of prompts are not supported: send one prompt per request", "prompt")
    return completion_prompt(request.model_copy(update={"prompt": prompt[0]}))


def completion_sample_args(request: CompletionRequest, ref: ModelRef) -> SampleArgs:
    _check_unsupported_sampling(request)
    if request.echo and request.logprobs is not None:
        raise bad_request(
            "echo with logprobs is not supported (the prompt's logprobs are not returned here)", "echo"
        )
    if request.suffix:
        raise bad_request("suffix is not supported", "suffix")
    if request.best_of is not None and request.best_of != request.n:
        raise bad_request("best_of is not supported (only best_of == n)", "best_of")
    max_tokens = request.max_tokens if request.max_tokens is not None else 16
    return _common_args(
        request, ref, max_tokens, request.logprobs or 0, None, return_prompt_text=request.echo
    )


# ---------------------------------------------------------------- responses


def truncate_at_stop(text: str, stops: Sequence[str], keep_stop: bool = False, start: int = 0) -> str:
    """OpenAI leaves stop sequences out of the returned text (vLLM's include_stop_str_in_output keeps
    the matched one); the token ids keep them. Matches start at `start` (after min_tokens' text)."""
    found = [(i, len(s)) for i, s in ((text.find(s, start), s) for s in stops) if i >= 0]
    if not found:
        return text
    at, length = min(found)
    return text[: at + length] if keep_stop else text[:at]


def stop_search_start(text: str, sample: Sample, min_tokens: int) -> int:
    """Where the stop that ended `text` may start: after the text of the first min_tokens tokens, in
    which stop strings were not looked for (measured from the end, as `text` may be a parsed message's
    content)."""
    if min_tokens <= 0:
        return 0
    return max(0, len(text) - len("".join(sample.token_texts[min_tokens:])))


def _stop_truncated(text: str, sample: Sample, stops: Sequence[str], request: SamplingFields) -> str:
    if sample.stop_reason != "stop":
        return text
    start = stop_search_start(text, sample, request.min_tokens)
    return truncate_at_stop(text, stops, request.include_stop_str_in_output, start)


def split_by_tokens(content: str, token_texts: Sequence[str], token_count: int) -> list[str]:
    """One piece of `content` per sampled token, in order; the pieces always join to `content`.

    The content is located inside the concatenated token texts so each token carries the part of
    the content it produced; tokens outside it (a think block, tool-call markup, the end-of-turn
    token) carry "". When the content cannot be located, it all goes on the first token.
    """
    if token_count == 0:
        return [content] if content else []
    pieces = [""] * token_count
    raw = "".join(token_texts) if len(token_texts) == token_count else ""
    start = raw.find(content) if content else -1
    if start < 0:
        pieces[0] = content
        return pieces
    end = start + len(content)
    offset = 0
    for i, text in enumerate(token_texts):
        low, high = max(offset, start), min(offset + len(text), end)
        if low < high:
            pieces[i] = raw[low:high]
        offset += len(text)
    return pieces


def _token_label(token_id: int, text: str, as_token_ids: bool) -> str:
    return f"token_id:{token_id}" if as_token_ids else text


def _token_bytes(text: str) -> list[int]:
    return list(text.encode("utf-8"))


def _token_text(sample: Sample, position: int) -> str:
    return sample.token_texts[position] if position < len(sample.token_texts) else ""


def chat_logprob_entry(sample: Sample, position: int, as_token_ids: bool) -> TokenLogprobEntry:
    token_id = sample.tokens[position]
    text = _token_text(sample, position)
    alternatives = sample.top_logprobs[position] if position < len(sample.top_logprobs) else ()
    return TokenLogprobEntry(
        token=_token_label(token_id, text, as_token_ids),
        logprob=sample.logprobs[position],
        bytes=_token_bytes(text),
        top_logprobs=[
            TopLogprobEntry(
                token=_token_label(alt.token_id, alt.text, as_token_ids),
                logprob=alt.logprob,
                bytes=_token_bytes(alt.text),
            )
            for alt in alternatives
        ],
    )


@dataclass(frozen=True)
class ParsedChoice:
    """What one sample becomes in a chat response, shared by the plain and streamed forms."""

    content: str | None
    tool_calls: list[ToolCall]
    finish_reason: FinishReason


def parse_chat_choice(
    sample: Sample, stops: Sequence[str], request: SamplingFields | None = None, echo: str = ""
) -> ParsedChoice:
    """A sample as a chat reply: stop strings cut as `request` asks, `echo` put before the content."""
    message = sample.message
    content = message.content if message is not None else sample.text
    if request is not None:
        content = _stop_truncated(content, sample, stops, request)
    elif sample.stop_reason == "stop":
        content = truncate_at_stop(content, stops)
    content = echo + content
    tool_calls = [
        ToolCall(
            id=call.id,
            function=FunctionCall(name=call.name, arguments=call.arguments),
        )
        for call in (message.tool_calls if message is not None else ())
    ]
    finish: FinishReason = (
        "length" if sample.stop_reason == "length" else "tool_calls" if tool_calls else "stop"
    )
    return ParsedChoice(content if content or not tool_calls else None, tool_calls, finish)


def usage_of(samples: Sequence[Sample]) -> Usage:
    prompt_tokens = len(samples[0].prompt_token_ids) if samples else 0
    completion_tokens = sum(len(s.tokens) for s in samples)
    return Usage(
        prompt_tokens=prompt_tokens,
        completion_tokens=completion_tokens,
        total_tokens=prompt_tokens + completion_tokens,
    )


def produced_version(samples: Sequence[Sample], ref: ModelRef) -> int:
    """The policy version that produced the samples (all of one Sample call share it)."""
    if samples:
        return samples[0].policy_version
    return ref.version or 0


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


# A plain response's RL extension fields, left out when the request sets `return_token_ids: false`.
_RL_FIELDS: dict[str, Any] = {
    "prompt_token_ids": True,
    "policy_version": True,
    "choices": {"__all__": {"token_ids": True, "policy_version": True}},
}


def response_json(body: ChatCompletion | Completion, request: SamplingFields) -> str:
    return body.model_dump_json(exclude=_RL_FIELDS if request.return_token_ids is False else None)


def stream_carries_rl_fields(request: ChatCompletionRequest | CompletionRequest) -> bool:
    """Streams stay OpenAI-shaped unless the request asks for logprobs or token ids."""
    asked_logprobs = request.logprobs if isinstance(request.logprobs, bool) else request.logprobs is not None
    return bool(request.return_token_ids) or (asked_logprobs and request.return_token_ids is not False)


def chat_echo(request: ChatCompletionRequest) -> str:
    """vLLM's chat echo: the last message's text when it is the assistant's (the reply continues it)."""
    last = request.messages[-1]
    return _message_text(last, len(request.messages) - 1) if request.echo and last.role == "assistant" else ""


def build_chat_completion(
    request: ChatCompletionRequest, ref: ModelRef, args: SampleArgs, samples: Sequence[Sample], created: int
) -> ChatCompletion:
    version = produced_version(samples, ref)
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
            )
        )
    return ChatCompletion(
        id=new_id("chatcmpl"),
        created=created,
        model=ref.served_id(version),
        choices=choices,
        usage=usage_of(samples),
        prompt_token_ids=list(samples[0].prompt_token_ids) if samples else [],
        policy_version=version,
    )


def chat_stream_chunks(
    request: ChatCompletionRequest, ref: ModelRef, args: SampleArgs, samples: Sequence[Sample], created: int
) -> Iterator[ChatCompletionChunk]:
    """The chunks OpenAI would stream for these samples, interleaved by choice index.

    The Sample RPC is unary, so the stream replays a finished result: the first token arrives
    only after the whole sample, and the chunks exist for client compatibility, not latency.
    When asked (`stream_carries_rl_fields`), the first chunk carries `prompt_token_ids` and each
    choice's first chunk its complete `token_ids` and `policy_version`: openai's stream
    accumulator (`.stream()`'s `get_final_completion()`) keeps a choice's extra fields from its
    first chunk only, so that is where they survive into the accumulated completion.
    """
    version = produced_version(samples, ref)
    chunk_id = new_id("chatcmpl")
    model = ref.served_id(version)
    rl_fields = stream_carries_rl_fields(request)

    def chunk(choices: list[ChatChunkChoice], **extra: Any) -> ChatCompletionChunk:
        return ChatCompletionChunk(id=chunk_id, created=created, model=model, choices=choices, **extra)

    echo = chat_echo(request)
    parsed = [parse_chat_choice(s, args.stop, request, echo) for s in samples]
    pieces = [
        split_by_tokens((p.content or "")[len(echo) :], s.token_texts, len(s.tokens))
        for p, s in zip(parsed, samples, strict=True)
    ]
    for index, sample in enumerate(samples):
        first = ChatChunkChoice(index=index, delta=ChatDelta(role="assistant", content=echo))
        if not rl_fields:
            yield chunk([first])
            continue
        first.token_ids, first.policy_version = list(sample.tokens), sample.policy_version
        yield chunk(
            [first],
            prompt_token_ids=list(sample.prompt_token_ids) if index == 0 else None,
            policy_version=version,
        )
    for position in range(max((len(p) for p in pieces), default=0)):
        for index, sample in enumerate(samples):
            if position >= len(pieces[index]):
                continue
            logprobs = (
                ChoiceLogprobs(
                    content=[chat_logprob_entry(sample, position, request.return_tokens_as_token_ids)]
                )
                if request.logprobs and position < len(sample.tokens)
                else None
            )
            yield chunk(
                [
                    ChatChunkChoice(
                        index=index, delta=ChatDelta(content=pieces[index][position]), logprobs=logprobs
                    )
                ]
            )
    for index, choice in enumerate(parsed):
        if choice.tool_calls:
            deltas = [
                ToolCallDelta(index=k, id=call.id, function=call.function)
                for k, call in enumerate(choice.tool_calls)
            ]
            yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(tool_calls=deltas))])
    for index, choice in enumerate(parsed):
        yield chunk([ChatChunkChoice(index=index, delta=ChatDelta(), finish_reason=choice.finish_reason)])
    if request.stream_options is not None and request.stream_options.include_usage:
        yield chunk([], usage=usage_of(samples))


def _legacy_logprobs(sample: Sample, positions: range, text_start: int, as_token_ids: bool) -> LegacyLogprobs:
    tokens: list[str] = []
    offsets: list[int] = []
    top: list[dict[str, float]] = []
    offset = text_start
    for p in positions:
        text = _token_text(sample, p)
        tokens.append(_token_label(sample.tokens[p], text, as_token_ids))
        offsets.append(offset)
        offset += len(text)
        alternatives = sample.top_logprobs[p] if p < len(sample.top_logprobs) else ()
        top.append({_token_label(a.token_id, a.text, as_token_ids): a.logprob for a in alternatives})
    return LegacyLogprobs(
        tokens=tokens,
        token_logprobs=[sample.logprobs[p] for p in positions],
        top_logprobs=top if sample.top_logprobs else None,
        text_offset=offsets,
    )


def completion_text(sample: Sample, stops: Sequence[str], request: CompletionRequest) -> str:
    """The sampled text, stop strings cut as asked (the prompt's text before it when echoed)."""
    return _stop_truncated(sample.text, sample, stops, request)


def completion_echo(request: CompletionRequest, sample: Sample) -> str:
    if not request.echo:
        return ""
    return request.prompt if isinstance(request.prompt, str) else sample.prompt_text


def _finish(sample: Sample) -> Literal["stop", "length"]:
    return "length" if sample.stop_reason == "length" else "stop"


def build_completion(
    request: CompletionRequest, ref: ModelRef, args: SampleArgs, samples: Sequence[Sample], created: int
) -> Completion:
    version = produced_version(samples, ref)
    choices = [
        CompletionChoice(
            index=index,
            text=completion_echo(request, sample) + completion_text(sample, args.stop, request),
            finish_reason=_finish(sample),
            logprobs=_legacy_logprobs(
                sample, range(len(sample.tokens)), 0, request.return_tokens_as_token_ids
            )
            if request.logprobs is not None
            else None,
            token_ids=list(sample.tokens),
            policy_version=sample.policy_version,
        )
        for index, sample in enumerate(samples)
    ]
    return Completion(
        id=new_id("cmpl"),
        created=created,
        model=ref.served_id(version),
        choices=choices,
        usage=usage_of(samples),
        prompt_token_ids=list(samples[0].prompt_token_ids) if samples else [],
        policy_version=version,
    )


def completion_stream_chunks(
    request: CompletionRequest, ref: ModelRef, args: SampleArgs, samples: Sequence[Sample], created: int
) -> Iterator[Completion]:
    """Legacy completion chunks, one per sampled token, interleaved by index (replayed, see chat).

    When asked, each choice's first chunk carries its complete `token_ids`, `policy_version` and
    the `prompt_token_ids`, as in a chat stream.
    """
    version = produced_version(samples, ref)
    chunk_id = new_id("cmpl")
    model = ref.served_id(version)
    rl_fields = stream_carries_rl_fields(request)

    def chunk(choices: list[CompletionChoice], **extra: Any) -> Completion:
        return Completion(id=chunk_id, created=created, model=model, choices=choices, **extra)

    texts = [completion_text(s, args.stop, request) for s in samples]
    pieces = [split_by_tokens(t, s.token_texts, len(s.tokens)) for t, s in zip(texts, samples, strict=True)]
    echoes = [completion_echo(request, s) for s in samples]
    for index, echo in enumerate(echoes):
        if echo:
            yield chunk([CompletionChoice(index=index, text=echo, finish_reason=None, logprobs=None)])
    offsets = [len(echo) for echo in echoes]
    for position in range(max((len(p) for p in pieces), default=0)):
        for index, sample in enumerate(samples):
            if position >= len(pieces[index]):
                continue
            logprobs = (
                _legacy_logprobs(
                    sample, range(position, position + 1), offsets[index], request.return_tokens_as_token_ids
                )
                if request.logprobs is not None and position < len(sample.tokens)
                else None
            )
            offsets[index] += len(_token_text(sample, position))
            choice = CompletionChoice(
                index=index, text=pieces[index][position], finish_reason=None, logprobs=logprobs
            )
            if not (rl_fields and position == 0):
                yield chunk([choice])
                continue
            choice.token_ids, choice.policy_version = list(sample.tokens), sample.policy_version
            yield chunk([choice], prompt_token_ids=list(sample.prompt_token_ids), policy_version=version)
    for index, sample in enumerate(samples):
        yield chunk([CompletionChoice(index=index, text="", finish_reason=_finish(sample), logprobs=None)])
    if request.stream_options is not None and request.stream_options.include_usage:
        yield chunk([], usage=usage_of(samples))


def model_cards(models: Sequence[ModelInfo]) -> ModelList:
    """Each model as `name` (its latest version) and `name@N` for every sampleable version."""
    cards: list[ModelCard] = []
    for info in models:
        created = int(info.create_time.timestamp()) if info.create_time is not None else 0
        max_len = info.max_context_length or None
        cards.append(
            ModelCard(
                id=info.name,
                created=created,
                parent=info.base_model,
                root=info.base_model,
                max_model_len=max_len,
                policy_version=info.policy_version,
            )
        )
        cards.extend(
            ModelCard(
                id=f"{info.name}@{version}",
                created=created,
                parent=info.name,
                root=info.base_model,
                max_model_len=max_len,
                policy_version=version,
            )
            for version in info.sampleable_versions
        )
    return ModelList(data=cards)


def find_card(cards: ModelList, model_id: str) -> ModelCard:
    for card in cards.data:
        if card.id == model_id:
            return card
    raise model_not_found(model_id, "no such model or sampleable version")
