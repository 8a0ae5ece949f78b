"""Sampled turns from the tinkerrpc sidecar's OpenAI chat completions and Responses.

The sidecar answers like vLLM with RL extensions: the response carries `prompt_token_ids`, each
choice `token_ids`, `policy_version` and `sample_key`, and `logprobs.content[].logprob` holds the
sampler's per-token logprobs when they were asked for (without them, the turn names the server's copy
by its `sample_key`). The `openai` client keeps such unknown fields, so both its pydantic objects and
plain dicts are accepted; `openai` itself is never imported here.
"""

from __future__ import annotations

from collections.abc import Mapping, Sequence
from typing import Any

from tinkerrpc._messages import Message, SampledTurn, ToolCall

# An `openai.types.chat.ChatCompletion` (anything with `model_dump()`) or its dict form.
ChatCompletionLike = object


def _as_dict(chat_completion: ChatCompletionLike) -> Mapping[str, Any]:
    if isinstance(chat_completion, Mapping):
        return chat_completion
    dump = getattr(chat_completion, "model_dump", None)
    if dump is None:
        raise TypeError(f"expected an openai response object or a dict, got {type(chat_completion).__name__}")
    result: Mapping[str, Any] = dump()
    return result


# The RL fields a sidecar stream sends on its deltas: openai's stream helper joins them on the message.
_STREAMED_FIELDS = ("token_ids", "sample_key")


def _with_provider_specific_fields(choice: Mapping[str, Any]) -> Mapping[str, Any]:
    """The choice with the RL fields litellm moves into `provider_specific_fields` (on the choice
    and/or its message), and those a stream accumulated on the message, put back beside the standard
    ones; a field the choice itself has wins."""
    message = choice.get("message") or {}
    streamed = {key: message[key] for key in _STREAMED_FIELDS if message.get(key) is not None}
    moved: dict[str, Any] = {}
    for source in (streamed, message.get("provider_specific_fields"), choice.get("provider_specific_fields")):
        if isinstance(source, Mapping):
            moved.update(source)
    return {**moved, **{key: value for key, value in choice.items() if value is not None}}


def turn_from_chat_completion(
    chat_completion: ChatCompletionLike, choice_index: int = 0
) -> tuple[Message, SampledTurn]:
    """The assistant message and the sampled turn of one choice; ValueError if RL fields are missing."""
    completion = _as_dict(chat_completion)
    choices = completion.get("choices") or []
    if not 0 <= choice_index < len(choices):
        raise ValueError(
            f"choice_index {choice_index} out of range: the completion has {len(choices)} choices"
        )
    choice = _with_provider_specific_fields(choices[choice_index])

    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise ValueError(
            f"choices[{choice_index}] has no token_ids: the completion must come from the tinkerrpc sidecar"
        )
    sample_key = str(choice.get("sample_key") or "")
    logprob_entries = (choice.get("logprobs") or {}).get("content")
    if logprob_entries is None and not sample_key:
        raise ValueError(
            f"choices[{choice_index}] has neither logprobs nor a sample_key: request the completion "
            "with logprobs=True from the tinkerrpc sidecar"
        )
    logprobs = [float(entry["logprob"]) for entry in logprob_entries or ()]
    if logprob_entries is not None and len(logprobs) != len(token_ids):
        raise ValueError(
            f"choices[{choice_index}] has {len(logprobs)} logprobs for {len(token_ids)} token_ids"
        )
    # The sidecar stamps every choice; a response-level stamp is accepted as a fallback.
    policy_version = choice.get("policy_version", completion.get("policy_version"))
    if policy_version is None:
        raise ValueError(f"choices[{choice_index}] has no policy_version: the sidecar stamps every choice")
    prompt_token_ids = completion.get("prompt_token_ids")
    if prompt_token_ids is None:
        raise ValueError(
            "the completion has no prompt_token_ids: the completion must come from the tinkerrpc sidecar"
        )

    raw_message = dict(choice.get("message") or {})
    raw_message.setdefault("role", "assistant")
    message = Message.from_openai(raw_message)
    turn = SampledTurn(
        prompt_token_ids=tuple(int(t) for t in prompt_token_ids),
        completion_token_ids=tuple(int(t) for t in token_ids),
        logprobs=tuple(logprobs),
        policy_version=int(policy_version),
        sample_key=sample_key,
    )
    return message, turn


# An `openai.types.responses.Response` (anything with `model_dump()`) or its dict form.
ResponseLike = object
# A Responses API `input`: a string (one user message) or a list of input items as dicts.
ResponseInput = str | Sequence[Mapping[str, Any]]

_TEXT_PART_TYPES = frozenset({"input_text", "output_text", "text"})


def _item_text(content: Any, where: str) -> str:
    if content is None or isinstance(content, str):
        return content or ""
    texts = []
    for j, part in enumerate(content):
        if part.get("type") not in _TEXT_PART_TYPES:
            raise ValueError(
                f"{where}.content[{j}] has type {part.get('type')!r}; only text parts are supported"
            )
        texts.append(part.get("text") or "")
    return "".join(texts)


def messages_from_response_input(input: ResponseInput, instructions: str | None = None) -> list[Message]:
    """The conversation a Responses API request describes, as chat messages.

    `instructions` becomes the system message; `function_call` items become the tool calls of the
    assistant message they follow (or of a new one), `function_call_output` items tool messages.
    """
    messages = [Message.system(instructions)] if instructions else []
    items: Sequence[Mapping[str, Any]] = (
        [{"role": "user", "content": input}] if isinstance(input, str) else input
    )
    for i, item in enumerate(items):
        where = f"input[{i}]"
        kind = item.get("type", "message")
        if kind == "message":
            role = "system" if item["role"] == "developer" else item["role"]
            messages.append(
                Message.from_openai({"role": role, "content": _item_text(item.get("content"), where)})
            )
        elif kind == "function_call":
            call = ToolCall(id=item["call_id"], name=item["name"], arguments=item.get("arguments") or "{}")
            last = messages[-1] if messages else None
            if last is not None and last.role == "assistant":
                messages[-1] = Message.assistant(last.content, (*last.tool_calls, call))
            else:
                messages.append(Message.assistant(tool_calls=[call]))
        elif kind == "function_call_output":
            messages.append(Message.tool(_item_text(item.get("output"), where), tool_call_id=item["call_id"]))
        else:
            raise ValueError(
                f"{where} has type {kind!r}; supported: message, function_call, function_call_output"
            )
    return messages


def turn_from_response(response: ResponseLike) -> tuple[Message, SampledTurn]:
    """The assistant message and the sampled turn of a sidecar Response (`/v1/responses`).

    Every output item of the sidecar's turn carries the turn's RL fields (`token_ids`,
    `prompt_token_ids`, `policy_version`, and `token_logprobs` when logprobs were asked).
    """
    output = _as_dict(response).get("output") or []
    stamped = next((item for item in output if item.get("token_ids") is not None), None)
    if stamped is None:
        raise ValueError(
            "the response's output carries no token_ids: it must come from the tinkerrpc sidecar"
        )
    sample_key = str(stamped.get("sample_key") or "")
    token_logprobs = stamped.get("token_logprobs")
    if token_logprobs is None and not sample_key:
        raise ValueError(
            "the response has neither logprobs nor a sample_key: request it with "
            'include=["message.output_text.logprobs"] from the tinkerrpc sidecar'
        )
    token_ids = stamped["token_ids"]
    if token_logprobs is not None and len(token_logprobs) != len(token_ids):
        raise ValueError(f"the response has {len(token_logprobs)} logprobs for {len(token_ids)} token_ids")
    content = "".join(
        _item_text(item.get("content"), f"output[{i}]")
        for i, item in enumerate(output)
        if item.get("type") == "message"
    )
    calls = [
        ToolCall(id=item["call_id"], name=item["name"], arguments=item.get("arguments") or "{}")
        for item in output
        if item.get("type") == "function_call"
    ]
    turn = SampledTurn(
        prompt_token_ids=tuple(int(t) for t in stamped["prompt_token_ids"]),
        completion_token_ids=tuple(int(t) for t in token_ids),
        logprobs=tuple(float(p) for p in token_logprobs or ()),
        policy_version=int(stamped["policy_version"]),
        sample_key=sample_key,
    )
    return Message.assistant(content, calls), turn
