"""The engine's one sample request and one sample result, from the HTTP route to the decode loop and back.

The route translates the tinker wire types into a `SampleJob` once (engine/protocol.py); the runtime
checks it, the scheduler decodes it and answers with a `SampleOutput`, which the route encodes.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass, field, replace
from typing import Literal

from tinkerrpc_server.engine.compute.prompt_alt_tokens import PromptAltTokens
from tinkerrpc_server.engine.compute.prompt_targets import PromptTargetLogprobs, PromptTargets
from tinkerrpc_server.engine.compute.topk import TopkRows

StopReason = Literal["stop", "length"]


@dataclass(frozen=True)
class TokenEvent:
    """One token a row of a job just sampled, as its stream reports it (on the compute thread)."""

    sample_index: int
    token: int
    logprob: float
    # Its top-K alternatives (ids, logprobs) when the job asks for topk_sample_logprobs.
    top: tuple[list[int], list[float]] | None
    stop_reason: StopReason | None  # set on the row's last token


@dataclass
class SampleJob:
    prompt_tokens: list[int]
    num_samples: int
    # -1: until the context is full (filled in once the base model is known).
    max_tokens: int
    temperature: float = 1.0  # 0 = greedy
    top_k: int = 0  # 0 = off (tinker's -1 is converted at the edge)
    top_p: float = 1.0
    # None: the model's default stops (its EOS tokens); a list, [] included, replaces them.
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = None
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0
    topk_sample_logprobs: int = 0
    target_prompt_logprobs: PromptTargets | None = None
    # K draws per prompt position after the first (prompt_alt_tokens.py); 0: none.
    prompt_alt_tokens_k: int = 0
    # Only the last N prompt positions get a logprob (the others are None); None: all of them.
    prompt_logprobs_last_n: int | None = None
    # Keep each sequence's stability information (engine/sampled.py) for stable_reinforce.
    record_stability_info: bool = False
    # Told each token as it is sampled, on the compute thread (a token stream, engine/token_streams.py);
    # it must not block.
    on_token: Callable[[TokenEvent], None] | None = None

    def with_max_tokens_filled(self, max_context_length: int) -> SampleJob:
        """An unset max_tokens (-1) samples until the context is full (the runtime rejects a too-long
        prompt)."""
        if self.max_tokens >= 0:
            return self
        return replace(self, max_tokens=max(1, max_context_length - len(self.prompt_tokens)))


@dataclass
class SampledSeq:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: StopReason
    topk_logprobs: TopkRows | None = None


@dataclass
class SampleOutput:
    sequences: list[SampledSeq]
    prompt_logprobs: list[float | None] | None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None
    target_prompt_logprobs: PromptTargetLogprobs | None = None
    prompt_alt_tokens: PromptAltTokens | None = None
    # Prompt tokens whose KV this request reused instead of computing: its prompt was prefilled for an
    # earlier request of the same prefill (not counted per sample: a request's n samples share one).
    prompt_cache_hit_tokens: int = 0
