"""The legacy completions request and its answer, with vLLM-style RL extensions.

The logprobs are OpenAI's legacy Logprobs shape (`openai_shapes`). The envelopes are ours: openai's
CompletionChoice has no null finish_reason (a stream chunk's) and Completion's choices list cannot be
narrowed to ours with the RL fields (a list is invariant).
"""

from __future__ import annotations

from typing import Literal

from pydantic import BaseModel, Field

from tinkerrpc.contract.limits import MAX_INT32, MAX_TOP_LOGPROBS, SIDECAR_MAX_N
from tinkerrpc.contract.sampling import SIDECAR_COMPLETION_MAX_TOKENS
from tinkerrpc_server.sidecar.openai_shapes import Logprobs
from tinkerrpc_server.sidecar.prompt_logprobs import PromptLogprobs
from tinkerrpc_server.sidecar.protocol import SamplingFields, TokenId, Usage


class CompletionRequest(SamplingFields):
    prompt: str | list[TokenId] | list[str] | list[list[TokenId]]
    # OpenAI's legacy default.
    max_tokens: int | None = Field(SIDECAR_COMPLETION_MAX_TOKENS, ge=1, le=MAX_INT32)
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    echo: bool = False
    best_of: int | None = Field(None, ge=1, le=SIDECAR_MAX_N)
    suffix: str | None = None


class CompletionChoice(BaseModel):
    index: int
    text: str
    finish_reason: Literal["stop", "length"] | None
    logprobs: Logprobs | None
    token_ids: list[int] | None = None
    policy_version: int | None = None
    sample_key: str | None = None
    # vLLM's prompt_logprobs, when asked (prompt_logprobs.py); never in stream chunks.
    prompt_logprobs: PromptLogprobs | None = None


class Completion(BaseModel):
    id: str
    object: Literal["text_completion"] = "text_completion"
    created: int
    model: str
    choices: list[CompletionChoice]
    usage: Usage | None = None
    system_fingerprint: str | None = None
    prompt_token_ids: list[int] | None = None
    # Set on plain responses; on stream chunks only when asked (see completions.completion_stream_chunks).
    policy_version: int | None = None
