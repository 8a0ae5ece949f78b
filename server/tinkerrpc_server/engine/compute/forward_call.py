"""The sampler's model call as one typed object, and the two models that answer it: the engine's own
decoder (decoder.py) and a transformers (+ PEFT) causal LM (`TransformersSampler`)."""

from __future__ import annotations

from collections.abc import Sequence
from dataclasses import dataclass
from typing import Any, Protocol

import torch

from tinkerrpc_server.engine.compute.kv_cache import SamplerCache


@dataclass(frozen=True)
class ForwardCall:
    """One forward pass of `input_ids` (rows, length) that extends `cache` in place: `attention_mask`
    (rows, the cache's columns + length) is 0 on left padding, `position_ids` (rows, length) are the
    tokens' positions, and the logits of the last `logits_to_keep` positions come back (0: all)."""

    input_ids: torch.Tensor
    attention_mask: torch.Tensor
    position_ids: torch.Tensor
    cache: SamplerCache
    logits_to_keep: int = 0


class SamplingModel(Protocol):
    """A causal LM as the scheduler runs it: the logits (rows, kept positions, vocabulary) of each call,
    each call's cache extended in place."""

    @property
    def runs_calls_together(self) -> bool:
        """Whether `forward` runs its calls in one pass (their tokens sharing every matmul)."""
        ...

    def forward(self, calls: Sequence[ForwardCall]) -> list[torch.Tensor]: ...

    def fused_kernels_for(self, tensor: torch.Tensor) -> bool:
        """Whether work on `tensor` (its logits: the token choice) runs on the fused CPU kernels."""
        ...


class TransformersSampler:
    """A transformers (+ PEFT) causal LM as a SamplingModel: one model call per ForwardCall."""

    runs_calls_together = False

    def __init__(self, model: Any) -> None:  # transformers' model classes are untyped
        self._model = model

    def fused_kernels_for(self, tensor: torch.Tensor) -> bool:
        return False

    def forward(self, calls: Sequence[ForwardCall]) -> list[torch.Tensor]:
        logits = []
        for call in calls:
            out = self._model(
                input_ids=call.input_ids,
                attention_mask=call.attention_mask,
                position_ids=call.position_ids,
                past_key_values=call.cache,
                use_cache=True,
                logits_to_keep=call.logits_to_keep,
            )
            if out.past_key_values is not call.cache:
                raise RuntimeError("the model replaced its KV cache instead of extending it")
            logits.append(out.logits)
        return logits
