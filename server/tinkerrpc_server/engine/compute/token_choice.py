"""Token choice: one token per row from its logits, temperature, top-k, top-p and its own uniform draw,
and whether a row stops there (stop token, stop string, or its max_tokens)."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

import torch

from tinkerrpc_server.engine.compute import cpu_kernels
from tinkerrpc_server.engine.compute.samples import SampleJob, StopReason

# Tokens decoded before the ones that can hold a new stop string: a token holds at least one byte of
# text, and the text of a tail that starts inside a UTF-8 character differs from the whole row's text
# in its first 3 bytes at most (the decoder is in step again at the next character).
_RESYNC_TOKENS = 3
# A stop string with this character could match a tail's broken first character, not the row's text.
_REPLACEMENT_CHARACTER = "\ufffd"


# Vocabulary positions per block of the two-level inverse CDF (see _inverse_cdf).
_CDF_BLOCK = 1024


@dataclass(frozen=True)
class RowSampling:
    """What choosing each row's token takes besides its logits and uniform draw, from the rows'
    temperatures, top-k and top-p: made once per batch of rows (DecodingRows.sampling), which changes only
    as rows join or leave, not every decode step (its ~8 small ops cost ~0.1 ms of a one-row SmolLM2 step,
    the step's weights having passed through the caches)."""

    scale: torch.Tensor  # the temperature; 1 for a greedy row
    greedy: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor
    truncated: torch.Tensor | None  # the rows with top-k or top-p, greedy ones aside; None where none has

    @classmethod
    def of(cls, temperatures: torch.Tensor, top_ks: torch.Tensor, top_ps: torch.Tensor) -> RowSampling:
        greedy = temperatures <= 0
        scale = torch.where(greedy, torch.ones_like(temperatures), temperatures)
        truncated = ((top_ks > 0) | (top_ps < 1)) & ~greedy
        return cls(scale, greedy, top_ks, top_ps, truncated if bool(truncated.any()) else None)


def choose(
    logits: torch.Tensor, rows: RowSampling, uniforms: torch.Tensor, kernels: bool = False
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return it with its logprob. With `kernels` (the fused CPU kernels are
    loaded and the logits are float32 on the CPU) the rows without top-k/top-p are one kernel call
    (cpu_kernels.choose_tokens), which computes what `_untruncated` computes.

    The logprob is log-softmax(logits / T) over the whole vocabulary (T = 1 for greedy rows):
    the model's distribution with temperature applied, before top-k/top-p truncation — the same
    number the learner computes at T = 1, which is what importance ratios compare against.
    """
    scale, truncated = rows.scale, rows.truncated
    if kernels:
        tokens, chosen, peak, log_total = cpu_kernels.choose_tokens(
            logits, scale, rows.greedy, uniforms, _CDF_BLOCK
        )
    else:
        tokens, chosen, peak, log_total = _untruncated(logits, scale, rows.greedy, uniforms)
    # Rows with top-k/top-p always take the sorted path; either way a row's token depends on its own
    # logits and uniform only.
    if truncated is None:
        return tokens, chosen
    top_ks, top_ps = rows.top_ks, rows.top_ps
    # (rows, 1) as _untruncated gives them.
    peak, log_total = peak.view(-1, 1), log_total.view(-1, 1)
    vocab = logits.shape[-1]
    scaled = _scaled(logits, scale)
    logprobs = scaled - peak - log_total
    sorted_logprobs, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    sorted_probs = sorted_logprobs.exp()
    ranks = torch.arange(vocab, device=logits.device).unsqueeze(0)
    keep = (top_ks.unsqueeze(-1) <= 0) | (ranks < top_ks.unsqueeze(-1))
    # Nucleus: keep a token while the mass strictly before it is under top_p (the first always stays).
    keep &= (sorted_probs.cumsum(-1) - sorted_probs) < top_ps.unsqueeze(-1)
    kept_cdf = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs)).cumsum(-1)
    picked = _searchsorted(kept_cdf, uniforms)
    tokens = torch.where(truncated, order.gather(-1, picked.unsqueeze(-1)).squeeze(-1), tokens)
    chosen = scaled.gather(-1, tokens.unsqueeze(-1)) - peak - log_total
    return tokens, chosen.squeeze(-1)


def _scaled(logits: torch.Tensor, scale: torch.Tensor) -> torch.Tensor:
    """logits / T per row (the logits themselves where every T is 1)."""
    return logits if bool((scale == 1).all()) else logits / scale.unsqueeze(-1)


def _untruncated(
    logits: torch.Tensor, scale: torch.Tensor, greedy: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Every row's token without top-k/top-p (the argmax for a greedy row), its logprob, and the row's
    peak of logits / T and log of the softmax normalizer, each (rows, 1)."""
    scaled = _scaled(logits, scale)
    rows, vocab = scaled.shape
    # exp(scaled - peak) once, into a buffer padded with zeros to whole blocks: the unnormalised
    # distribution, from which both the draw and the logprob follow (log-softmax = scaled - peak - log Σ).
    peak = scaled.amax(dim=-1, keepdim=True)
    blocks = -(-vocab // _CDF_BLOCK)
    weights = scaled.new_zeros((rows, blocks * _CDF_BLOCK))
    torch.sub(scaled, peak, out=weights[:, :vocab]).exp_()
    log_total = weights.sum(dim=-1, keepdim=True).log_()
    # The cumulative distribution in vocabulary order needs no sort over the vocabulary.
    tokens = _inverse_cdf(weights.view(rows, blocks, _CDF_BLOCK), uniforms).clamp_(max=vocab - 1)
    if bool(greedy.any()):
        tokens = torch.where(greedy, logits.argmax(dim=-1), tokens)
    chosen = scaled.gather(-1, tokens.unsqueeze(-1)) - peak - log_total
    return tokens, chosen.squeeze(-1), peak, log_total


def _inverse_cdf(blocks: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row of the unnormalised weights `blocks` (rows, blocks, block), the first index whose
    cumulative mass exceeds uniform × the row's total: the block from the blocks' cumulative sums, then
    the position inside it from that one block's. The same token as one cumulative sum over the whole
    vocabulary (up to rounding), at a fraction of the cost: a sequential scan of 150 k positions per
    row is most of a token choice, a sum over blocks is not."""
    rows, _, size = blocks.shape
    block_sums = blocks.sum(dim=-1)
    block_cdf = block_sums.cumsum(dim=-1)
    targets = (uniforms * block_cdf[:, -1]).unsqueeze(-1)
    block = torch.searchsorted(block_cdf, targets, right=True).clamp_(max=block_cdf.shape[-1] - 1)
    before = block_cdf.gather(-1, block) - block_sums.gather(-1, block)
    within = blocks[torch.arange(rows, device=blocks.device), block.squeeze(-1)].cumsum(dim=-1)
    position = torch.searchsorted(within, targets - before, right=True).clamp_(max=size - 1)
    return (block * size + position).squeeze(-1)


def _searchsorted(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass exceeds uniform × the row's total mass."""
    targets = (uniforms * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


class StopCheck:
    """Whether a row of `job` stops at the token it just sampled.

    A row stops on a stop token, once its decoded text contains a stop string, or at max_tokens. The
    stop strings are checked after every token, so a match is new: it ends in the new token's text or
    in the last broken character before it. Only the tail that can hold such a match is decoded (the
    whole row would make a row's checks quadratic in its length)."""

    def __init__(self, job: SampleJob, stop_token_ids: frozenset[int], tokenizer: Any) -> None:
        self.stop_token_ids = stop_token_ids
        self.stop_strings = list(job.stop_strings)
        self.max_tokens = job.max_tokens
        self._tokenizer = tokenizer
        longest = max((len(stop.encode()) for stop in self.stop_strings), default=0)
        exact_tail = not any(_REPLACEMENT_CHARACTER in stop for stop in self.stop_strings)
        # None: the whole row. Else the new token, the broken character before it, the longest stop
        # string's bytes and the resync margin.
        self.tail_tokens: int | None = 1 + 3 + longest + _RESYNC_TOKENS if exact_tail else None

    def reason(self, tokens: list[int]) -> StopReason | None:
        if tokens[-1] in self.stop_token_ids:
            return "stop"
        if self.stop_strings:
            tail = tokens if self.tail_tokens is None else tokens[-self.tail_tokens :]
            text: str = self._tokenizer.decode(tail)
            if any(stop in text for stop in self.stop_strings):
                return "stop"
        if len(tokens) >= self.max_tokens:
            return "length"
        return None
