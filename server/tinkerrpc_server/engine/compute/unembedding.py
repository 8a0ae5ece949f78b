"""The learner logprob of each target token, computed through the unembedding in chunks of positions.

At a real vocabulary (Qwen3: 151,936 rows) the unembedding is most of a training step, and the plain
`log_softmax(model(...).logits).gather(target)` keeps several fp32 copies of the whole [positions ×
vocabulary] logits alive for backward (the logits, PEFT's LoRA term and its scaled copy, their sum, the
log-softmax, the dense gradient of the gather). Here the logits of padding positions are never
computed, each chunk of real positions is one matmul (plus the LoRA term added in place), only the
logits and their log-sum-exp are kept for backward, and backward turns each chunk into its gradient
in place. The numbers are the plain computation's: logit[target] − logsumexp(logits), with the
gradient onehot(target) − softmax(logits) per unit of upstream gradient. A position may have K targets
(soft targets, `[positions, K]`): each is scored from the same logits, and their gradients add up.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch
from peft import PeftModel
from peft.tuners.lora import LoraLayer

# Architectures whose logits are exactly lm_head(the decoder's last hidden state): no soft-capping
# or logit scale (Gemma 2, Cohere, Granite have one), so the unembedding can be taken apart here
# (when it has no bias); any other model runs the plain computation.
PLAIN_UNEMBEDDING_MODEL_TYPES = frozenset({"llama", "mistral", "qwen2", "qwen3"})
# fp32 logits computed at once: bounds the working memory of a chunk of positions. 256 MiB is 441
# positions at Qwen3's vocabulary, where a 2-core CPU's matmul is ~25% faster than at half of it.
CHUNK_LOGITS_BYTES = 256 * 2**20
# fp32 logits kept for backward; past it, backward computes each chunk's logits again (one more
# matmul) instead. The engine keeps its micro-batches under it (saved_logits_positions).
SAVED_LOGITS_BYTES = 2**30


def saved_logits_positions(vocab_size: int) -> int:
    """Positions whose logits fit SAVED_LOGITS_BYTES."""
    return max(1, SAVED_LOGITS_BYTES // (4 * vocab_size))


@dataclass(frozen=True)
class _Lora:
    a: torch.Tensor  # [rank, hidden]
    b: torch.Tensor  # [vocab, rank]
    scale: float


@dataclass(frozen=True)
class _Unembedding:
    weight: torch.Tensor  # [vocab, hidden]
    lora: _Lora | None


def target_logprobs(
    model: torch.nn.Module,
    input_ids: torch.Tensor,
    attention_mask: torch.Tensor,
    targets: torch.Tensor,
    hidden_states: Callable[[torch.Tensor, torch.Tensor], torch.Tensor] | None = None,
) -> torch.Tensor:
    """Logprobs of `targets` (one per real position of the right-padded batch, row by row, or K per
    position as `[positions, K]`; the result has their shape) under `model` (a causal LM, or a PeftModel
    around one) as fp32, differentiable. `hidden_states(input_ids,
    attention_mask)`, when given, computes the decoder's last hidden states in its place (the engine's
    own forward, engine/compute/decoder.py), those of the real positions only, row by row."""
    real = attention_mask.bool()
    per_position = targets.reshape(targets.shape[0], -1)  # [positions, K]; K = 1 for one target each
    causal_lm: Any = model.get_base_model() if isinstance(model, PeftModel) else model
    unembedding = _plain_unembedding(causal_lm)
    if unembedding is None:
        logits = model(input_ids=input_ids, attention_mask=attention_mask, use_cache=False).logits
        return torch.log_softmax(logits[real].float(), dim=-1).gather(-1, per_position).reshape(targets.shape)
    if hidden_states is not None:
        hidden = hidden_states(input_ids, attention_mask)
    else:
        decoder = causal_lm.get_decoder()
        hidden = decoder(
            input_ids=input_ids, attention_mask=attention_mask, use_cache=False
        ).last_hidden_state[real]
    lora = unembedding.lora
    args = (
        hidden,
        per_position,
        unembedding.weight,
        None if lora is None else lora.a,
        None if lora is None else lora.b,
        0.0 if lora is None else lora.scale,
    )
    if not torch.is_grad_enabled():
        return _chunked_forward(*args, keep_logits=False).logprobs.reshape(targets.shape)
    # torch leaves Function.apply untyped.
    logprobs: torch.Tensor = _TargetLogprobs.apply(*args)  # type: ignore[no-untyped-call]
    return logprobs.reshape(targets.shape)


def _plain_unembedding(causal_lm: Any) -> _Unembedding | None:
    """The unembedding's weights when its logits are h·Wᵀ (+ one plain LoRA term); None otherwise."""
    if getattr(causal_lm.config, "model_type", None) not in PLAIN_UNEMBEDDING_MODEL_TYPES:
        return None
    head = causal_lm.get_output_embeddings()
    if isinstance(head, torch.nn.Linear):
        return _Unembedding(head.weight, None) if head.bias is None else None
    if not isinstance(head, LoraLayer) or not isinstance(head.base_layer, torch.nn.Linear):
        return None
    base = head.base_layer
    if base.bias is not None:
        return None
    if head.disable_adapters or head.merged:
        return _Unembedding(base.weight, None)
    active = [name for name in head.active_adapters if name in head.lora_A]
    if not active:
        return _Unembedding(base.weight, None)
    if len(active) > 1:
        return None
    name = active[0]
    lora_a, lora_b = head.lora_A[name], head.lora_B[name]
    if not isinstance(lora_a, torch.nn.Linear) or not isinstance(lora_b, torch.nn.Linear):
        return None
    plain = (
        name not in head.lora_variant
        and isinstance(head.lora_dropout[name], torch.nn.Identity)
        and lora_b.bias is None
    )
    if not plain:
        return None
    return _Unembedding(base.weight, _Lora(lora_a.weight, lora_b.weight, float(head.scaling[name])))


def _chunks(positions: int, vocab_size: int) -> list[tuple[int, int]]:
    step = max(1, CHUNK_LOGITS_BYTES // (4 * vocab_size))
    return [(start, min(start + step, positions)) for start in range(0, positions, step)]


def _logits(
    hidden: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    scale: float,
) -> tuple[torch.Tensor, torch.Tensor | None]:
    """fp32 logits of a chunk of hidden states, and the LoRA down-projection (x·Aᵀ) when there is one:
    x·Wᵀ + scale·(x·Aᵀ)·Bᵀ as PEFT computes it, the LoRA term in the LoRA weights' dtype."""
    if lora_a is None or lora_b is None:
        return (hidden.to(weight.dtype) @ weight.t()).float(), None
    down = hidden.to(lora_a.dtype) @ lora_a.t()
    logits = (down * scale).float() @ lora_b.float().t()
    if weight.dtype == torch.float32:
        # The base matmul accumulates into the LoRA term: one pass over the logits fewer.
        logits.addmm_(hidden.float(), weight.t())
    else:
        logits += (hidden.to(weight.dtype) @ weight.t()).float()
    return logits, down


@dataclass
class _Forward:
    logprobs: torch.Tensor
    log_normalizers: torch.Tensor
    # Per chunk: its logits (None when not kept) and its LoRA down-projection (None without LoRA).
    logits: list[torch.Tensor | None]
    downs: list[torch.Tensor | None]


def _chunked_forward(
    hidden: torch.Tensor,
    targets: torch.Tensor,
    weight: torch.Tensor,
    lora_a: torch.Tensor | None,
    lora_b: torch.Tensor | None,
    scale: float,
    keep_logits: bool,
) -> _Forward:
    positions = hidden.shape[0]
    logprobs = torch.empty(targets.shape, dtype=torch.float32, device=hidden.device)
    log_normalizers = torch.empty(positions, dtype=torch.float32, device=hidden.device)
    result = _Forward(logprobs, log_normalizers, [], [])
    for start, end in _chunks(positions, weight.shape[0]):
        logits, down = _logits(hidden[start:end], weight, lora_a, lora_b, scale)
        chunk_normalizers = torch.logsumexp(logits, dim=-1)
        picked = logits.gather(-1, targets[start:end])
        logprobs[start:end] = picked - chunk_normalizers.unsqueeze(-1)
        result.log_normalizers[start:end] = chunk_normalizers
        result.logits.append(logits if keep_logits else None)
        result.downs.append(down)
    return result


class _TargetLogprobs(torch.autograd.Function):
    @staticmethod
    def forward(
        ctx: Any,
        hidden: torch.Tensor,
        targets: torch.Tensor,
        weight: torch.Tensor,
        lora_a: torch.Tensor | None,
        lora_b: torch.Tensor | None,
        scale: float,
    ) -> torch.Tensor:
        keep_logits = hidden.shape[0] <= saved_logits_positions(weight.shape[0])
        forward = _chunked_forward(hidden, targets, weight, lora_a, lora_b, scale, keep_logits)
        ctx.save_for_backward(hidden, targets, weight, lora_a, lora_b, forward.log_normalizers)
        ctx.scale = scale
        # Not save_for_backward: backward overwrites each chunk's logits with their gradient.
        ctx.kept_logits = forward.logits
        ctx.downs = forward.downs
        return forward.logprobs

    @staticmethod
    def backward(ctx: Any, grad_logprobs: torch.Tensor) -> tuple[torch.Tensor | None, ...]:
        hidden, targets, weight, lora_a, lora_b, log_normalizers = ctx.saved_tensors
        scale: float = ctx.scale
        needs_hidden, _, needs_weight, needs_a, needs_b, _ = ctx.needs_input_grad
        grad_hidden = torch.zeros_like(hidden) if needs_hidden else None
        grad_weight = torch.zeros_like(weight, dtype=torch.float32) if needs_weight else None
        grad_a = torch.zeros_like(lora_a, dtype=torch.float32) if needs_a else None
        grad_b = torch.zeros_like(lora_b, dtype=torch.float32) if needs_b else None
        for index, (start, end) in enumerate(_chunks(hidden.shape[0], weight.shape[0])):
            chunk = hidden[start:end]
            logits = ctx.kept_logits[index]
            # Used up here (a second backward, under retain_graph, computes them again).
            ctx.kept_logits[index] = None
            if logits is None:
                logits, _ = _logits(chunk, weight, lora_a, lora_b, scale)
            upstream = grad_logprobs[start:end].float()  # [chunk, K]
            # d logprob / d logits = onehot(target) − softmax, in place of the logits; a position's K
            # targets add their upstream gradients (a repeated target gets each of its shares).
            grad_logits = logits.sub_(log_normalizers[start:end].unsqueeze(-1)).exp_()
            grad_logits.mul_(-upstream.sum(-1, keepdim=True))
            grad_logits.scatter_add_(-1, targets[start:end], upstream)
            if grad_hidden is not None:
                grad_hidden[start:end] = (grad_logits.to(weight.dtype) @ weight).to(hidden.dtype)
            if grad_weight is not None:
                grad_weight.addmm_(grad_logits.t(), chunk.float())
            if lora_a is not None and lora_b is not None:
                down = ctx.downs[index]
                assert down is not None
                if grad_b is not None:
                    grad_b.addmm_(grad_logits.t(), down.float(), alpha=scale)
                grad_down = (grad_logits @ lora_b.float()).mul_(scale)
                if grad_a is not None:
                    grad_a.addmm_(grad_down.t(), chunk.float())
                if grad_hidden is not None:
                    grad_hidden[start:end] += (grad_down @ lora_a.float()).to(hidden.dtype)
        return (
            grad_hidden,
            None,
            None if grad_weight is None else grad_weight.to(weight.dtype),
            None if grad_a is None or lora_a is None else grad_a.to(lora_a.dtype),
            None if grad_b is None or lora_b is None else grad_b.to(lora_b.dtype),
            None,
        )
