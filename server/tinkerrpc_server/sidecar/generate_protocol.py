"""vLLM's tokens-in, tokens-out generate: the shapes of `/inference/v1/generate` (GenerateRequest,
GenerateResponse, and GenerateStreamResponse for each `data:` frame of its stream), as the `renderers`
package's client (verifiers' and prime-rl's training client) sends and reads them and vLLM's
serve/disagg protocol declares them. No `openai` type describes them; the logprobs are OpenAI's chat
ChoiceLogprobs shape (`openai_shapes`).
"""

from __future__ import annotations

from typing import Any, Literal

from pydantic import BaseModel, Field

from tinkerrpc.contract.limits import (
    MAX_INT32,
    MAX_INT64,
    MAX_STOP_TOKEN_IDS,
    MAX_TOP_LOGPROBS,
    MIN_INT64,
    SIDECAR_MAX_N,
    SIDECAR_MAX_TAG_CHARS,
    SIDECAR_MAX_TEMPERATURE,
)
from tinkerrpc_server.sidecar.openai_shapes import ChoiceLogprobs
from tinkerrpc_server.sidecar.prompt_logprobs import PromptLogprobs
from tinkerrpc_server.sidecar.protocol import StreamOptions, StrictRequest, TokenId, Usage


class GenerateSamplingParams(StrictRequest):
    """vLLM's SamplingParams, the subset the sampler honours; knobs it lacks are declared so that the
    route names them in a 400 (accepted only at their neutral values)."""

    n: int = Field(1, ge=1, le=SIDECAR_MAX_N)
    max_tokens: int | None = Field(None, ge=1, le=MAX_INT32)
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    temperature: float | None = Field(None, ge=0.0, le=SIDECAR_MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # -1 or 0 disables top-k.
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    seed: int | None = Field(None, ge=MIN_INT64, le=MAX_INT64)
    stop: str | list[str] | None = None
    stop_token_ids: list[TokenId] | None = Field(None, max_length=MAX_STOP_TOKEN_IDS)
    ignore_eos: bool = False
    # Top alternatives per sampled token (the sampled token's own logprob always comes with them).
    logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Each prompt token's own logprob and its top k alternatives (vLLM's shape, prompt_logprobs.py).
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    # The answer carries no text: these change nothing but are what vLLM clients send.
    include_stop_str_in_output: bool = False
    detokenize: bool = True
    # prime-rl's vLLM: where in the prompt the MoE routing data starts; no routing data is returned here.
    routed_experts_prompt_start: int | None = Field(None, ge=0, le=MAX_INT32)
    # Honoured only at their neutral values (checked by name so the 400 says which one).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    min_p: float | None = Field(None, ge=0.0, le=1.0)
    logit_bias: dict[str, float] | None = None
    allowed_token_ids: list[TokenId] | None = None
    bad_words: list[str] | None = None
    structured_outputs: dict[str, Any] | None = None


class GenerateStreamOptions(StreamOptions):
    # vLLM: with include_usage, every chunk also carries the usage of its choice so far.
    continuous_usage_stats: bool = False


class GenerateRequest(StrictRequest):
    model: str = Field(min_length=1)
    token_ids: list[TokenId] = Field(min_length=1)
    sampling_params: GenerateSamplingParams
    request_id: str | None = Field(None, min_length=1, max_length=SIDECAR_MAX_TAG_CHARS)
    stream: bool = False
    stream_options: GenerateStreamOptions | None = None
    # Accepted and ignored: it keeps one caller's prompts out of another's prefix cache, and no KV cache
    # outlives a Sample call here.
    cache_salt: str | None = Field(None, max_length=SIDECAR_MAX_TAG_CHARS)
    # vLLM refuses any other priority unless it schedules by priority, as this server does not.
    priority: int = Field(0, ge=MIN_INT64, le=MAX_INT64)


GenerateFinishReason = Literal["stop", "length"]


class GenerateChoice(BaseModel):
    index: int
    logprobs: ChoiceLogprobs | None
    finish_reason: GenerateFinishReason
    token_ids: list[int]
    # RL extensions, as on the other routes.
    policy_version: int
    sample_key: str | None = None


class GenerateResponse(BaseModel):
    request_id: str
    model: str
    created: int
    choices: list[GenerateChoice]
    usage: Usage
    # vLLM's shape (prompt_logprobs.py).
    prompt_logprobs: PromptLogprobs | None = None
    # RL extensions (vLLM names), as on the other routes.
    prompt_token_ids: list[int]
    policy_version: int


class GenerateStreamChoice(BaseModel):
    """New tokens of one choice; its last chunk has the finish_reason (vLLM's shape) and the sample_key."""

    index: int
    logprobs: ChoiceLogprobs | None = None
    finish_reason: GenerateFinishReason | None = None
    token_ids: list[int]
    # RL extensions, as on the plain choice.
    policy_version: int
    sample_key: str | None = None


class GenerateStreamResponse(BaseModel):
    request_id: str
    choices: list[GenerateStreamChoice]
    usage: Usage | None = None
    # RL extensions: the prompt as sampled on the first chunk, the version on every one.
    prompt_token_ids: list[int] | None = None
    policy_version: int

    def frame_json(self) -> str:
        """vLLM's framing: token chunks with their nulls, the usage chunk without them."""
        return self.model_dump_json(exclude_none=not self.choices)
