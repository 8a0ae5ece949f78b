"""What differs between the model families the engine's fused forward (decoder.py) covers, as data.

A family is one entry of FAMILIES (how to read its config and modules) plus a parity test against
transformers + PEFT (tests/engine_core/test_decoder.py); the layer loop reads only the Architecture.
`describe` returns None for a model it cannot vouch for (another family, biases, sliding windows, a
rotary variant whose frequencies change with the sequence length, modules that disagree with the
config): the engine runs such a model through transformers.
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from typing import Any

import torch
from transformers.activations import ACT2FN


@dataclass(frozen=True)
class Architecture:
    """One decoder-only transformer: pre-norm RMSNorm blocks, grouped-query attention with rotary
    positions, a gated MLP, no biases."""

    num_heads: int
    num_kv_heads: int  # grouped heads: each kv head serves num_heads // num_kv_heads query heads
    head_dim: int
    # Each q and k head is RMS-normed (a learned weight per head dim) before the rotary (Qwen3).
    qk_norm: bool
    # The unembedding is the input embedding's tensor.
    tied_embeddings: bool
    rope_type: str  # one of STATIC_ROPE_TYPES
    rope_theta: float
    activation: str  # transformers' hidden_act: the gate's activation
    norm_eps: float  # every RMSNorm's (the blocks', the final one and q/k's)


@dataclass(frozen=True)
class Family:
    """How a model_type's modules differ from the common layout (model.layers[i].self_attn.{q,k,v,o}_proj,
    .mlp.{gate,up,down}_proj, .input_layernorm, .post_attention_layernorm, model.norm)."""

    qk_norm: bool  # self_attn has q_norm and k_norm


FAMILIES: Mapping[str, Family] = {
    "qwen3": Family(qk_norm=True),
    "llama": Family(qk_norm=False),
}

# Rotary types whose cos/sin are a function of the position alone, so keys cached at one step stay
# right at the next; "dynamic" and "longrope" rescale the frequencies with the sequence length.
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3"})


def describe(causal_lm: Any) -> Architecture | None:
    """The architecture of a loaded transformers causal LM, or None when the fused forward does not
    cover it (see the module docstring)."""
    config = causal_lm.config
    family = FAMILIES.get(getattr(config, "model_type", ""))
    if family is None or _has_sliding_window(config):
        return None
    rope = getattr(config, "rope_parameters", None) or {}
    rope_type = rope.get("rope_type", "default")
    if rope_type not in STATIC_ROPE_TYPES or "rope_theta" not in rope:
        return None
    if config.hidden_act not in ACT2FN:
        return None
    layers = causal_lm.model.layers
    if any(m.bias is not None for m in layers.modules() if isinstance(m, torch.nn.Linear)):
        return None
    num_heads = int(config.num_attention_heads)
    num_kv_heads = int(config.num_key_value_heads)
    head_dim = int(getattr(config, "head_dim", None) or config.hidden_size // num_heads)
    for block in layers:
        attention = block.self_attn
        shaped = (
            attention.q_proj.weight.shape[0] == num_heads * head_dim
            and attention.k_proj.weight.shape[0] == num_kv_heads * head_dim
            and float(attention.scaling) == head_dim**-0.5
            and all(hasattr(attention, norm) == family.qk_norm for norm in ("q_norm", "k_norm"))
        )
        if not shaped:
            return None
    if num_heads % num_kv_heads:
        return None
    embedding = causal_lm.get_input_embeddings().weight
    head = causal_lm.get_output_embeddings().weight
    return Architecture(
        num_heads=num_heads,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        qk_norm=family.qk_norm,
        tied_embeddings=head.data_ptr() == embedding.data_ptr(),
        rope_type=rope_type,
        rope_theta=float(rope["rope_theta"]),
        activation=str(config.hidden_act),
        norm_eps=float(config.rms_norm_eps),
    )


def _has_sliding_window(config: Any) -> bool:
    layer_types = getattr(config, "layer_types", None) or ()
    return bool(getattr(config, "use_sliding_window", False)) or "sliding_attention" in layer_types
