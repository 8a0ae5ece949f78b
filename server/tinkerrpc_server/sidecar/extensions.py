"""Vendor extensions, taken as vLLM takes them: the one rule for request fields the sidecar does not know.

Clients add their own fields to OpenAI requests (ART sends `nvext` and `chat_template_kwargs`'
`preserve_thinking` with every rollout; gateways add routing hints). vLLM ignores such fields with a
logged warning, so the sidecar does too:

- an unknown top-level field of a chat, legacy completion or Responses request is dropped before the
  request is validated;
- an unknown `chat_template_kwargs` key is dropped too: only the keys in CHAT_TEMPLATE_KWARGS select a
  renderer option; a chat template's other variables are not ours to render.

Each ignored name is logged at WARNING the first time this process sees it (then at DEBUG: an RL loop
sends the same extension with every rollout) and named on the response, in IGNORED_FIELDS_HEADER,
comma-separated. Nested objects (messages, tools, stream_options) stay strict, and fields the sidecar
declares but cannot honour (`audio`, `logit_bias`, `previous_response_id`...) keep their 400 naming them.
So do vLLM's own extensions that would change what is rendered or sampled (UNSUPPORTED_VLLM_FIELDS,
UNSUPPORTED_TEMPLATE_KWARGS: guided decoding, beam search, a template of the caller's...): ignoring them
would hand back something other than what was asked for, so any value but their neutral one is a 400.
"""

from __future__ import annotations

import logging
from collections.abc import Callable, Coroutine, Iterator
from contextlib import contextmanager
from contextvars import ContextVar
from typing import Any

from fastapi import Request, Response
from pydantic import BaseModel, ModelWrapValidatorHandler, model_validator

from tinkerrpc_server.sidecar.errors import bad_request

log = logging.getLogger("tinkerrpc.sidecar")

# The response header naming what a request sent that was ignored, e.g. `nvext, chat_template_kwargs.preserve_thinking`.
IGNORED_FIELDS_HEADER = "x-tinkerrpc-ignored-fields"

# chat_template_kwargs keys that mean something here: each maps to a renderer option.
CHAT_TEMPLATE_KWARGS = ("enable_thinking",)

# vLLM's request extensions the sampler or the renderer cannot honour, with the value at which each
# changes nothing (accepted); any other value is refused by name.
UNSUPPORTED_VLLM_FIELDS: dict[str, object] = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "chat_template": None,
    "documents": None,
    "guided_json": None,
    "guided_regex": None,
    "guided_choice": None,
    "guided_grammar": None,
    "structured_outputs": None,
    "allowed_token_ids": None,
    "bad_words": None,
    "logits_processors": None,
    "use_beam_search": False,
    "length_penalty": 1.0,
    "min_p": 0.0,
    "truncate_prompt_tokens": None,
}
# Chat template variables a renderer has no option for, whose other values would change the prompt.
UNSUPPORTED_TEMPLATE_KWARGS: dict[str, object] = {
    "add_generation_prompt": True,
    "continue_final_message": False,
    "documents": None,
    "tools": None,
}

# The names ignored while the current request is parsed (set per request by `noting_ignored_fields`).
_ignored: ContextVar[list[str] | None] = ContextVar("sidecar_ignored_fields", default=None)
# Names already warned about in this process.
_warned: set[str] = set()


def _note(names: list[str]) -> None:
    collected = _ignored.get()
    if collected is not None:
        collected.extend(names)


def _refuse_unsupported(values: dict[str, Any], unsupported: dict[str, object], prefix: str) -> None:
    for name, neutral in unsupported.items():
        if name in values and values[name] != neutral:
            raise bad_request(
                f"{prefix}{name} is not supported by the tinkerrpc sidecar (a vLLM extension Tinker's sampler "
                f"and the model's renderer cannot honour); leave it out or at {neutral!r}",
                f"{prefix}{name}",
            )


class ExtensibleRequest(BaseModel):
    """A top-level request: unknown fields are dropped (and noted) before strict validation."""

    @model_validator(mode="wrap")
    @classmethod
    def _drop_unknown_fields(cls, data: Any, handler: ModelWrapValidatorHandler[Any]) -> Any:
        if isinstance(data, dict):
            _refuse_unsupported(data, UNSUPPORTED_VLLM_FIELDS, "")
            unknown = [key for key in data if key not in cls.model_fields]
            if unknown:
                _note(unknown)
                data = {key: value for key, value in data.items() if key in cls.model_fields}
        return handler(data)


def known_template_kwargs(kwargs: dict[str, Any] | None) -> dict[str, Any] | None:
    """chat_template_kwargs with only the keys a renderer option reads; the others are noted."""
    if kwargs is None:
        return None
    _refuse_unsupported(kwargs, UNSUPPORTED_TEMPLATE_KWARGS, "chat_template_kwargs.")
    unknown = [key for key in kwargs if key not in CHAT_TEMPLATE_KWARGS]
    _note([f"chat_template_kwargs.{key}" for key in unknown])
    return {key: value for key, value in kwargs.items() if key in CHAT_TEMPLATE_KWARGS}


@contextmanager
def _collecting() -> Iterator[list[str]]:
    names: list[str] = []
    token = _ignored.set(names)
    try:
        yield names
    finally:
        _ignored.reset(token)


async def noting_ignored_fields(
    handler: Callable[[Request], Coroutine[Any, Any, Response]], request: Request
) -> Response:
    """Answer `request` with `handler`; what its parsing ignored is logged and named in the header."""
    with _collecting() as names:
        response = await handler(request)
    if names:
        unique = list(dict.fromkeys(names))
        for name in unique:
            level = logging.DEBUG if name in _warned else logging.WARNING
            _warned.add(name)
            log.log(
                level, "%s: ignored unknown request field %s (a vendor extension)", request.url.path, name
            )
        response.headers[IGNORED_FIELDS_HEADER] = ", ".join(unique)
    return response
