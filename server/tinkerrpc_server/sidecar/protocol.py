"""What the sidecar's endpoint families share: the strict base of every request (a typo never silently
changes sampling), the sampling fields of chat and legacy completions, token ids and usage. Each family's
own request and response models live beside its route: chat_protocol, completions_protocol,
responses_protocol, generate_protocol, models_protocol.

Nested objects forbid unknown fields and requests validate strictly: `true` is no integer and `1.0` no
count. An unknown top-level field is a vendor extension, ignored as vLLM ignores it (`extensions`).
Fields that do not affect sampling are declared and ignored; fields the sampler cannot honour are
declared so that the endpoint modules can name them in a 400.
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import BaseModel, ConfigDict, Field

# The bounds are the contract's (tinkerrpc.contract.limits): token counts and ids are int32 on the wire,
# seeds int64; n and temperature keep one request from monopolising the sampler.
from tinkerrpc.contract.limits import (
    MAX_INT32,
    MAX_INT64,
    MAX_TOP_LOGPROBS,
    MIN_INT64,
    SIDECAR_MAX_N,
    SIDECAR_MAX_TEMPERATURE,
)
from tinkerrpc_server.sidecar.extensions import ExtensibleRequest


class StrictRequest(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(StrictRequest):
    include_usage: bool = False
    # Accepted for compatibility; the stream is produced after sampling, so it changes nothing.
    include_obfuscation: bool | None = None


# Structured-output formats OpenAI names; only "text" is served (refused by name otherwise).
OutputFormatType = Literal["text", "json_object", "json_schema"]


ServiceTier = Literal["auto", "default", "flex", "scale", "priority"]


class SamplingFields(ExtensibleRequest, StrictRequest):
    """Parameters shared by chat and legacy completions."""

    model: str = Field(min_length=1)
    n: int = Field(1, ge=1, le=SIDECAR_MAX_N)
    temperature: float | None = Field(None, ge=0.0, le=SIDECAR_MAX_TEMPERATURE)
    top_p: float | None = Field(None, gt=0.0, le=1.0)
    # Extension (vLLM): -1 or 0 disables top-k.
    top_k: int | None = Field(None, ge=-1, le=MAX_INT32)
    stop: str | list[str] | None = None
    seed: int | None = Field(None, ge=MIN_INT64, le=MAX_INT64)
    stream: bool = False
    stream_options: StreamOptions | None = None
    # Honoured only at their neutral values (checked by name so the 400 says which one).
    presence_penalty: float | None = None
    frequency_penalty: float | None = None
    repetition_penalty: float | None = None
    logit_bias: dict[str, float] | None = None
    # RL extensions (vLLM): logprob tokens as `token_id:N`, extra stop token ids, no end-of-turn stop.
    return_tokens_as_token_ids: bool = False
    # Negative ids are refused by name with the other sampling checks.
    stop_token_ids: list[Annotated[int, Field(le=MAX_INT32)]] | None = None
    ignore_eos: bool = False
    # vLLM: true returns `token_ids`/`prompt_token_ids`/`policy_version` (also on a stream's last
    # chunk), false leaves them out; unset keeps them on plain responses.
    return_token_ids: bool | None = None
    # vLLM: no stop (stop token or stop string) before this many tokens.
    min_tokens: int = Field(0, ge=0, le=MAX_INT32)
    # vLLM: how the returned text is decoded from the tokens (special tokens dropped or kept, and
    # kept ones spaced from their neighbours), and whether the matched stop string stays in it.
    skip_special_tokens: bool = True
    spaces_between_special_tokens: bool = True
    include_stop_str_in_output: bool = False
    # vLLM: each prompt token's logprob and its top k alternatives (prompt_logprobs.py); not in streams.
    prompt_logprobs: int | None = Field(None, ge=0, le=MAX_TOP_LOGPROBS)
    # Accepted and ignored: they do not change what is sampled.
    user: str | None = None


TokenId = Annotated[int, Field(ge=0, le=MAX_INT32)]


# Not openai's CompletionUsage: its optional token-detail fields would add nulls to every plain reply.
class Usage(BaseModel):
    prompt_tokens: int
    completion_tokens: int
    total_tokens: int


FinishReason = Literal["stop", "length", "tool_calls"]
