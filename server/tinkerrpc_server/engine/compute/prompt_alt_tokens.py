"""K alternative tokens per prompt position (the SDK's `prompt_alt_tokens_k`).

At every prompt position after the first, K independent draws with replacement from the model's
next-token distribution at the request's temperature, taken in the prefill that serves the request
(prefill.py), with each draw's logprob. The distribution and the logprob follow the sampled tokens'
convention (token_choice.choose): log-softmax(logits / T) over the whole vocabulary, so a draw's logprob
is the one the token would have if sampled there; a greedy request (T = 0) draws the most likely token K
times, with its logprob at T = 1. The draws come from the request's own generator: with a seed they are
the same each time the same prompt is served alone.
"""

from __future__ import annotations

import os
from dataclasses import dataclass

import numpy as np
import torch

# Mixed into a request's seed so its alternative draws are not the uniforms of its first sample.
_ALT_SEED_SALT = 0x5EED_A17


@dataclass(frozen=True)
class PromptAltTokens:
    """A request's draws: `[len(prompt) - 1, K]` token ids and their logprobs."""

    tokens: np.ndarray  # int64
    logprobs: np.ndarray  # float32


class PromptAltDraws:
    """One request's draws, gathered chunk by chunk over the prefill's columns of its prompt."""

    def __init__(
        self,
        k: int,
        temperature: float,
        seed: int | None,
        prompt_length: int,
        width: int,
        device: torch.device,
    ) -> None:
        """`width`: the prefill's columns, the prompt right-aligned in them (left padding before it)."""
        self.k = k
        self.first = width - prompt_length  # the prompt's first column
        self.temperature = temperature
        self.generator = torch.Generator(device=device)
        start = (seed ^ _ALT_SEED_SALT) if seed is not None else int.from_bytes(os.urandom(8), "little")
        self.generator.manual_seed(start % (2**63))
        self.tokens = torch.zeros((prompt_length - 1, k), dtype=torch.long, device=device)
        self.logprobs = torch.zeros((prompt_length - 1, k), device=device)

    def record(self, logits: torch.Tensor, start: int, stop: int) -> None:
        """Draw at columns [start, stop) from their logits (stop - start, vocabulary): column j's
        distribution is over the token at j + 1. Padding columns are skipped (their logits are no
        distribution)."""
        skip = max(0, self.first - start)
        if skip >= stop - start:
            return
        logits, start = logits[skip:], start + skip
        if self.temperature <= 0:
            logprobs = torch.log_softmax(logits.float(), dim=-1)
            drawn = logprobs.argmax(dim=-1, keepdim=True).expand(-1, self.k)
        else:
            logprobs = torch.log_softmax(logits.float() / self.temperature, dim=-1)
            drawn = torch.multinomial(logprobs.exp(), self.k, replacement=True, generator=self.generator)
        rows = slice(start - self.first, stop - self.first)
        self.tokens[rows] = drawn
        self.logprobs[rows] = logprobs.gather(-1, drawn)

    def answer(self) -> PromptAltTokens:
        return PromptAltTokens(
            self.tokens.cpu().numpy().astype(np.int64), self.logprobs.cpu().numpy().astype(np.float32)
        )
