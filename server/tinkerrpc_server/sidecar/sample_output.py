"""What a sampled `Sample` becomes in any endpoint's answer: its text cut at stop strings, OpenAI logprob
entries, the parsed chat reply, usage, and the fields every response of one reply shares.

Pure functions: no I/O, so every mapping is testable without a server.
"""

from __future__ import annotations

import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any

from tinkerrpc import Sample
from tinkerrpc_server.sidecar.chat_protocol import ChatCompletion, ToolCall
from tinkerrpc_server.sidecar.completions_protocol import Completion
from tinkerrpc_server.sidecar.models import ModelRef
from tinkerrpc_server.sidecar.openai_shapes import ChatCompletionTokenLogprob, Function, TopLogprob
from tinkerrpc_server.sidecar.protocol import FinishReason, SamplingFields, Usage


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


def stop_truncated(text: str, sample: Sample, stops: Sequence[str], request: SamplingFields) -> str:
    """`text` cut at the stop string that ended the sample, as the request's vLLM options ask."""
    if sample.stop_reason != "stop":
        return text
    start = stop_search_start(text, sample, request.min_tokens)
    return truncate_at_stop(text, stops, request.include_stop_str_in_output, start)


def token_label(token_id: int, text: str, as_token_ids: bool) -> str:
    """A logprob entry's token: its text, or vLLM's `token_id:N` under return_tokens_as_token_ids."""
    return f"token_id:{token_id}" if as_token_ids else text


def _token_bytes(exact: bytes | None, text: str) -> list[int]:
    """OpenAI's `bytes` of a token: the server's exact bytes (a token holding part of a multi-byte
    character has U+FFFD in its text), or its text's UTF-8 from a server that sends none."""
    return list(exact if exact is not None else text.encode("utf-8"))


def token_text(sample: Sample, position: int) -> str:
    return sample.token_texts[position] if position < len(sample.token_texts) else ""


def chat_logprob_entry(sample: Sample, position: int, as_token_ids: bool) -> ChatCompletionTokenLogprob:
    """The chat-shaped logprob entry (also the Responses API's) of the token at `position`."""
    token_id = sample.tokens[position]
    text = token_text(sample, position)
    alternatives = sample.top_logprobs[position] if position < len(sample.top_logprobs) else ()
    return ChatCompletionTokenLogprob(
        token=token_label(token_id, text, as_token_ids),
        logprob=sample.logprobs[position],
        bytes=_token_bytes(
            sample.token_bytes[position] if position < len(sample.token_bytes) else None, text
        ),
        top_logprobs=[
            TopLogprob(
                token=token_label(alt.token_id, alt.text, as_token_ids),
                logprob=alt.logprob,
                bytes=_token_bytes(alt.bytes, alt.text),
            )
            for alt in alternatives
        ],
    )


@dataclass(frozen=True)
class ParsedChoice:
    """What one sample becomes as an assistant reply, shared by chat and the Responses API and by
    their plain and streamed forms."""

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
        content = stop_truncated(content, sample, stops, request)
    elif sample.stop_reason == "stop":
        content = truncate_at_stop(content, stops)
    content = echo + content
    tool_calls = [
        ToolCall(
            id=call.id,
            function=Function(name=call.name, arguments=call.arguments),
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


def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


@dataclass(frozen=True)
class ReplyHead:
    """What a chat or legacy completion and each of its stream chunks share: the id, the creation time,
    the served model id and the policy version that produced the samples."""

    id: str
    created: int
    model: str
    policy_version: int

    @classmethod
    def of(cls, id_prefix: str, ref: ModelRef, samples: Sequence[Sample], created: int) -> ReplyHead:
        # All samples of one Sample call share the version; an empty result reports the pinned one.
        version = samples[0].policy_version if samples else ref.version or 0
        return cls(new_id(id_prefix), created, ref.served_id(version), version)

    def fields(self) -> dict[str, Any]:
        return {"id": self.id, "created": self.created, "model": self.model}

    def body_fields(self, samples: Sequence[Sample]) -> dict[str, Any]:
        """A plain (not streamed) response's fields besides its choices: usage and the RL fields too."""
        return {
            **self.fields(),
            "usage": usage_of(samples),
            "prompt_token_ids": list(samples[0].prompt_token_ids) if samples else [],
            "policy_version": self.policy_version,
        }


def rl_fields_asked(return_token_ids: bool | None, asked_logprobs: bool) -> bool:
    """Whether a stream carries the RL fields: streams stay OpenAI-shaped unless the request asks for
    logprobs or token ids (`return_token_ids: false` wins over logprobs)."""
    return bool(return_token_ids) or (asked_logprobs and return_token_ids is not False)


# A plain response's RL extension fields, left out when the request sets `return_token_ids: false`.
_RL_FIELDS: dict[str, Any] = {
    "prompt_token_ids": True,
    "policy_version": True,
    "choices": {
        "__all__": {
            "token_ids": True,
            "policy_version": True,
            "sample_key": True,
            "policy_token_spans": True,
            "prompt_policy_token_spans": True,
        }
    },
}


def response_json(body: ChatCompletion | Completion, request: SamplingFields) -> str:
    return body.model_dump_json(exclude=_RL_FIELDS if request.return_token_ids is False else None)
