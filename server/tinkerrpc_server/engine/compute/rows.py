"""A sample job while it decodes: its rows (one per sample, each with the uniform draws of its own seed),
what they sampled, and the output they make once all have stopped."""

from __future__ import annotations

import os
from dataclasses import dataclass, field
from typing import Any

import torch

from tinkerrpc_server.engine.compute.prompt_alt_tokens import PromptAltTokens
from tinkerrpc_server.engine.compute.prompt_targets import PromptTargetLogprobs
from tinkerrpc_server.engine.compute.samples import SampledSeq, SampleJob, SampleOutput, StopReason
from tinkerrpc_server.engine.compute.token_choice import StopCheck
from tinkerrpc_server.engine.compute.topk import TopkEntry, TopkRows


@dataclass(eq=False)
class DecodingJob:
    key: int
    job: SampleJob
    stop: StopCheck
    rows: list[Row] = field(default_factory=list)
    unfinished: int = 0
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    target_prompt_logprobs: PromptTargetLogprobs | None = None
    prompt_alt_tokens: PromptAltTokens | None = None
    prompt_cache_hit_tokens: int = 0
    dropped: bool = False

    @classmethod
    def start(cls, key: int, job: SampleJob, tokenizer: Any) -> DecodingJob:
        """`job` as checked by the runtime: its stop_token_ids are the complete set."""
        decoding = cls(key, job, StopCheck(job, frozenset(job.stop_token_ids or ()), tokenizer))
        for sample_index in range(job.num_samples):
            seed = job.seed + sample_index if job.seed is not None else _fresh_seed()
            generator = torch.Generator(device="cpu")
            generator.manual_seed(seed % (2**63))
            decoding.rows.append(
                Row(decoding, torch.rand(job.max_tokens, generator=generator), sample_index=sample_index)
            )
        decoding.unfinished = job.num_samples
        return decoding

    def output(self) -> SampleOutput:
        job = self.job
        prompt_logprobs = self.prompt_logprobs if job.include_prompt_logprobs else None
        last_n = job.prompt_logprobs_last_n
        if last_n is not None and prompt_logprobs is not None:
            keep_from = len(prompt_logprobs) - last_n
            prompt_logprobs = [None if j < keep_from else lp for j, lp in enumerate(prompt_logprobs)]
        return SampleOutput(
            sequences=[
                SampledSeq(
                    r.tokens,
                    r.logprobs,
                    r.stop_reason or "length",
                    TopkRows.stack(r.topk, job.topk_sample_logprobs) if job.topk_sample_logprobs else None,
                )
                for r in self.rows
            ],
            prompt_logprobs=prompt_logprobs,
            topk_prompt_logprobs=self.topk_prompt_logprobs if job.topk_prompt_logprobs else None,
            target_prompt_logprobs=self.target_prompt_logprobs,
            prompt_alt_tokens=self.prompt_alt_tokens,
            prompt_cache_hit_tokens=self.prompt_cache_hit_tokens,
        )


@dataclass(eq=False)
class Row:
    owner: DecodingJob
    uniforms: torch.Tensor  # one draw per token it may sample, from its own seed
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    topk: list[TopkEntry] = field(default_factory=list)  # one per token when the job asks for them
    stop_reason: StopReason | None = None
    # The prefill whose prompt KV the row holds a copy of (rows of one prompt share it), and its length.
    prefix: tuple[int, int] | None = None
    prefix_length: int = 0
    sample_index: int = 0  # its place among its job's samples


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little")
