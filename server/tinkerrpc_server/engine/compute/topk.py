"""Top-K logprobs of sampled positions (the SDK's `topk_sample_logprobs`).

They come from the distribution the sampled token's own logprob comes from (token_choice.choose):
log-softmax(logits / T) over the whole vocabulary, T = 1 for greedy rows, before top-k/top-p
truncation; so the sampled token's logprob, where it is among the K, is the one listed for it.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np
import torch

# One sampled position's top K: its token ids and their logprobs, most likely first.
TopkEntry = tuple[list[int], list[float]]


@dataclass(frozen=True)
class TopkRows:
    """A sequence's top-K logprobs, one row per sampled token, most likely first."""

    token_ids: np.ndarray  # int32, (tokens, k)
    logprobs: np.ndarray  # float32, (tokens, k)

    @classmethod
    def stack(cls, entries: list[TopkEntry], k: int) -> TopkRows:
        ids = np.asarray([entry[0] for entry in entries], dtype=np.int32).reshape(len(entries), k)
        logprobs = np.asarray([entry[1] for entry in entries], dtype=np.float32).reshape(len(entries), k)
        return cls(ids, logprobs)


def sampled_top_logprobs(
    logits: torch.Tensor, temperatures: torch.Tensor, wanted: list[int]
) -> list[TopkEntry | None]:
    """Per row of `logits`, its `wanted[i]` most likely tokens and their logprobs (None where 0).

    Only the rows that want some are computed; K is each row's own (at most the vocabulary, which the
    runtime checks when the job arrives)."""
    rows = [i for i, k in enumerate(wanted) if k > 0]
    answer: list[TopkEntry | None] = [None] * len(wanted)
    if not rows:
        return answer
    index = torch.tensor(rows, device=logits.device)
    temperature = temperatures.index_select(0, index)
    scale = torch.where(temperature <= 0, torch.ones_like(temperature), temperature).unsqueeze(-1)
    scaled = logits.index_select(0, index).float() / scale
    values, ids = scaled.topk(max(wanted), dim=-1)
    values -= torch.logsumexp(scaled, dim=-1, keepdim=True)
    for row, row_ids, row_values in zip(rows, ids.tolist(), values.tolist(), strict=True):
        k = wanted[row]
        answer[row] = (row_ids[:k], row_values[:k])
    return answer
