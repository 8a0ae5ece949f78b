"""The base model's weights re-laid for the engine's forward (decoder.py), and one adapter's LoRA taken
from PEFT's modules: merged into a copy of the projections it changes (the sampler) or read as live
parameters (the learner).

- q/k/v and gate/up are one matmul each: `fuse_base_weights` stores those weights, once when the base
  model loads, as column blocks of one (in, out) buffer that the transformers modules keep using as
  views (no extra memory; training reads the same tensors). o/down are stored transposed the same way:
  MKL's sgemm is up to 2x slower for 9-48 rows when the weight is the transposed operand;
- the sampler's adapter is merged into a copy of the projections it changes (W + scaling·B·A, summed in
  float32, `merged_weight`); the unembedding stays unmerged (it is usually the input embedding too, and
  it is the largest matrix): `plain_lora` gives its factors;
- only plain LoRA is read (no variant, dropout, bias or merged module): anything else raises
  NotPlainLora, and transformers + PEFT run that adapter instead.
"""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
from peft.tuners.lora import LoraLayer
from transformers.activations import ACT2FN

from tinkerrpc_server.engine.compute.architecture import Architecture, describe

_ATTENTION = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class Projection:
    """Modules `parent.<name>` whose outputs are concatenated column blocks of `x @ weight_t`."""

    parent: Any
    names: tuple[str, ...]
    weight_t: torch.Tensor  # (in, sum of outs), contiguous
    splits: tuple[int, ...]

    def modules(self) -> tuple[Any, ...]:
        """Looked up on use: PEFT replaces the Linear modules by LoRA layers wrapping them."""
        return tuple(getattr(self.parent, name) for name in self.names)


@dataclass(frozen=True)
class LayerWeights:
    qkv: Projection
    o: Projection
    gate_up: Projection
    down: Projection
    input_norm: torch.Tensor  # RMSNorm weights
    post_attention_norm: torch.Tensor
    # With q/k norm: q_norm's weight once per query head, then k_norm's once per kv head, so q and k
    # are normalized together; (heads + kv heads, head_dim).
    qk_norm_weight: torch.Tensor | None

    def projections(self) -> tuple[Projection, ...]:
        return (self.qkv, self.o, self.gate_up, self.down)


@dataclass(frozen=True)
class BaseWeights:
    """The base model as the decoder reads it (tensors shared with the transformers modules)."""

    causal_lm: Any  # transformers' model classes are untyped
    architecture: Architecture
    layers: tuple[LayerWeights, ...]
    final_norm: torch.Tensor
    activation: Callable[[torch.Tensor], torch.Tensor]


def fuse_base_weights(causal_lm: Any) -> BaseWeights | None:
    """Re-lay a freshly loaded model's Linear weights (see the module docstring); None (and nothing
    changed) when the decoder does not cover the model."""
    architecture = describe(causal_lm)
    if architecture is None:
        return None
    layers = []
    for block in causal_lm.model.layers:
        attn, mlp = block.self_attn, block.mlp
        layers.append(
            LayerWeights(
                qkv=_fused(attn, _ATTENTION),
                o=_fused(attn, ("o_proj",)),
                gate_up=_fused(mlp, _GATE_UP),
                down=_fused(mlp, ("down_proj",)),
                input_norm=block.input_layernorm.weight,
                post_attention_norm=block.post_attention_layernorm.weight,
                qk_norm_weight=_qk_norm_weight(attn, architecture) if architecture.qk_norm else None,
            )
        )
    return BaseWeights(
        causal_lm=causal_lm,
        architecture=architecture,
        layers=tuple(layers),
        final_norm=causal_lm.model.norm.weight,
        activation=ACT2FN[architecture.activation],
    )


def _qk_norm_weight(attention: Any, architecture: Architecture) -> torch.Tensor:
    return torch.cat(
        [
            attention.q_norm.weight.detach().expand(architecture.num_heads, -1),
            attention.k_norm.weight.detach().expand(architecture.num_kv_heads, -1),
        ]
    )


def _fused(parent: Any, names: tuple[str, ...]) -> Projection:
    """One contiguous (in, sum of outs) buffer; each module's weight becomes its transposed column block."""
    modules = tuple(getattr(parent, name) for name in names)
    weight_t = torch.cat([m.weight.data.t() for m in modules], dim=1).contiguous()
    splits = tuple(int(m.weight.shape[0]) for m in modules)
    start = 0
    for module, width in zip(modules, splits, strict=True):
        module.weight.data = weight_t[:, start : start + width].t()
        start += width
    return Projection(parent, names, weight_t, splits)


def base_weight(module: Any) -> torch.Tensor:
    """The weight of a Linear module as the base model holds it, whether or not PEFT wraps it."""
    linear: Any = module.base_layer if isinstance(module, LoraLayer) else module
    weight: torch.Tensor = linear.weight
    return weight


class NotPlainLora(Exception):
    """The adapter is not plain LoRA on some module (a variant, dropout, a bias, merged)."""


Built = TypeVar("Built")


def unless_not_plain(make: Callable[[], Built]) -> Built | None:
    """`make()`, or None when the adapter it reads is not plain LoRA."""
    try:
        return make()
    except NotPlainLora:
        return None


def plain_lora(module: Any, adapter: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A, scaling · B) of the adapter on `module`; None when it has none there."""
    if adapter is None or not isinstance(module, LoraLayer) or adapter not in module.lora_A:
        return None
    a: Any = module.lora_A[adapter]
    b: Any = module.lora_B[adapter]
    _check_plain(module, adapter, a, b)
    return a.weight, b.weight * float(module.scaling[adapter])


def merged_weight(projection: Projection, adapter: str | None) -> torch.Tensor | None:
    """The projection's weight_t with the adapter merged in (summed in float32); None if it has none."""
    merged = None
    start = 0
    for module, width in zip(projection.modules(), projection.splits, strict=True):
        lora = plain_lora(module, adapter)
        if lora is not None:
            if merged is None:
                merged = projection.weight_t.clone()
            a, scaled_b = lora
            columns = merged[:, start : start + width]
            delta = a.t().float() @ scaled_b.t().float()
            if columns.dtype == torch.float32:
                torch.add(columns, delta, out=columns)  # the same sum, without a copy of the columns
            else:
                columns.copy_(columns.float() + delta)
        start += width
    return merged


@dataclass(frozen=True)
class TrainableLora:
    """One adapter's LoRA over every member of a fused projection, as the live (trained) parameters:
    A of the members stacked (one matmul for all), each member's B with its scaling."""

    a: tuple[torch.Tensor, ...]
    scaled_b: tuple[tuple[torch.Tensor, float], ...]

    @classmethod
    def of(cls, projection: Projection, adapter: str) -> TrainableLora | None:
        """The adapter's LoRA on `projection`; None where it adapts none of its members (NotPlainLora
        where only some: one matmul cannot leave the others out)."""
        found = [_trainable_lora(module, adapter) for module in projection.modules()]
        if all(lora is None for lora in found):
            return None
        if any(lora is None for lora in found):
            raise NotPlainLora(adapter)
        pairs = [lora for lora in found if lora is not None]
        return cls(tuple(a for a, _, _ in pairs), tuple((b, scale) for _, b, scale in pairs))

    def down(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x·Aᵀ of every member, from one matmul (differentiable in each A)."""
        stacked = x.to(self.a[0].dtype) @ torch.cat(self.a, dim=0).t()
        return list(torch.split(stacked, [int(a.shape[0]) for a in self.a], dim=-1))

    def update(self, x: torch.Tensor) -> torch.Tensor:
        """The LoRA term of the projection of x: every member's x·Aᵀ·(scaling·B)ᵀ side by side. The
        scaling goes on B (rank × out), not on the output (positions × out)."""
        updates = [
            reduced @ (b.t() * scale) for reduced, (b, scale) in zip(self.down(x), self.scaled_b, strict=True)
        ]
        return updates[0] if len(updates) == 1 else torch.cat(updates, dim=-1)


def _trainable_lora(module: Any, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A, B, scaling) of the adapter on `module` as live parameters; None when it has none there."""
    if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
        return None
    a: Any = module.lora_A[adapter]
    b: Any = module.lora_B[adapter]
    _check_plain(module, adapter, a, b)
    return a.weight, b.weight, float(module.scaling[adapter])


def _check_plain(module: Any, adapter: str, a: Any, b: Any) -> None:
    """Raise NotPlainLora unless the adapter on `module` is x·Aᵀ·Bᵀ·scaling (no variant, dropout or bias)."""
    plain = (
        adapter not in module.lora_variant
        and isinstance(module.lora_dropout[adapter], torch.nn.Identity)
        and isinstance(a, torch.nn.Linear)
        and isinstance(b, torch.nn.Linear)
        and b.bias is None
        and not module.merged
    )
    if not plain:
        raise NotPlainLora(adapter)
