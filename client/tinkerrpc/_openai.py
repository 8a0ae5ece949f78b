"""Sampled turns from the tinkerrpc sidecar's OpenAI chat completions.

The sidecar answers like vLLM with RL extensions: the response carries `prompt_token_ids`, each
choice `token_ids` and `policy_version`, and `logprobs.content[].logprob` holds the sampler's
per-token logprobs. The `openai` client keeps such unknown fields, so both its pydantic objects
and plain dicts are accepted; `openai` itself is never imported here.
"""

from __future__ import annotations

from collections.abc import Mapping
from typing import Any

from tinkerrpc._types import Message, SampledTurn

# An `openai.types.chat.ChatCompletion` (anything with `model_dump()`) or its dict form.
ChatCompletionLike = object


def _as_dict(chat_completion: ChatCompletionLike) -> Mapping[str, Any]:
    if isinstance(chat_completion, Mapping):
        return chat_completion
    dump = getattr(chat_completion, "model_dump", None)
    if dump is None:
        raise TypeError(f"expected an openai ChatCompletion or a dict, got {type(chat_completion).__name__}")
    result: Mapping[str, Any] = dump()
    return result


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
    choice = choices[choice_index]

    token_ids = choice.get("token_ids")
    if token_ids is None:
        raise ValueError(
            f"choices[{choice_index}] has no token_ids: the completion must come from the tinkerrpc sidecar"
        )
    logprob_entries = (choice.get("logprobs") or {}).get("content")
    if logprob_entries is None:
        raise ValueError(
            f"choices[{choice_index}] has no logprobs: request the completion with logprobs=True"
        )
    logprobs = [float(entry["logprob"]) for entry in logprob_entries]
    if len(logprobs) != len(token_ids):
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
    )
    return message, turn
