"""vLLM's `prompt_logprobs`: the request field (k alternatives per prompt position; 0 is each prompt
token's own logprob alone) as SamplingOptions take it, and the response's shape, the same on chat
completions, legacy completions and /inference/v1/generate: None at position 0, then per prompt position
a dict {token id: {logprob, rank, decoded_token}} holding the prompt token itself first, then its top k.

The top k's ranks are 1..k. The prompt token's rank and text are known where it ranks within k; outside
them both are None (its rank is past k, and the sidecar has no tokenizer to name it).
"""

from __future__ import annotations

import math
from collections.abc import Sequence
from typing import Any

from pydantic import BaseModel

from tinkerrpc import Sample
from tinkerrpc_server.sidecar.errors import bad_request


class PromptTokenLogprob(BaseModel):
    logprob: float
    rank: int | None = None
    decoded_token: str | None = None


PromptLogprobs = list[dict[str, PromptTokenLogprob] | None]


def prompt_logprob_options(prompt_logprobs: int | None, stream: bool = False) -> dict[str, Any]:
    """The SamplingOptions fields of a request's prompt_logprobs (None: not asked). vLLM refuses
    prompt_logprobs in a stream, and so does this."""
    if prompt_logprobs is None:
        return {}
    if stream:
        raise bad_request("prompt_logprobs are not available when stream is true", "prompt_logprobs")
    return {"include_prompt_logprobs": True, "prompt_top_logprobs": prompt_logprobs}


def vllm_prompt_logprobs(samples: Sequence[Sample]) -> PromptLogprobs | None:
    """The prompt's logprobs in vLLM's shape, or None when they were not asked."""
    if not samples or not samples[0].prompt_logprobs:
        return None
    first = samples[0]
    entries: PromptLogprobs = []
    for position, (token_id, own) in enumerate(
        zip(first.prompt_token_ids, first.prompt_logprobs, strict=True)
    ):
        # Position 0 has no logprob (the server sends NaN); vLLM sends None there.
        if math.isnan(own):
            entries.append(None)
            continue
        top = first.prompt_top_logprobs[position] if position < len(first.prompt_top_logprobs) else ()
        ranked = {
            str(a.token_id): PromptTokenLogprob(logprob=a.logprob, rank=rank, decoded_token=a.text)
            for rank, a in enumerate(top, start=1)
        }
        itself = ranked.get(str(token_id), PromptTokenLogprob(logprob=own))
        entries.append({str(token_id): itself, **ranked})
    return entries
