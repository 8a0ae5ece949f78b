"""The engine's own forward pass, for sampling and for learning: fewer, larger matmuls than
transformers + PEFT, for the model families architecture.py describes (one layer loop, parameterised
by their Architecture).

A decode step of a few dozen rows is skinny matmuls plus per-op overhead. This forward computes the
same function as the transformers model with one LoRA adapter active, but
- q/k/v and gate/up are one matmul each: `fuse_base_weights` stores those weights, once when the base
  model loads, as column blocks of one (in, out) buffer that the transformers modules keep using as
  views (no extra memory; training reads the same tensors). o/down are stored transposed the same way:
  MKL's sgemm is up to 2x slower for 9-48 rows when the weight is the transposed operand;
- the adapter is merged into a copy of the projections it changes (W + scaling·B·A, summed in float32),
  built once per decoder: a decoder lives for one sample batch of one sampler snapshot, so at most one
  merged copy of the layer weights exists at a time (the unembedding stays unmerged: it is usually the
  input embedding too, and it is the largest matrix);
- the matmuls take only the real positions of a padded batch: the learner's right-padded one (1.3x a
  step of SmolLM2 at 16-128 tokens per sequence) and a prefill chunk of left-padded prompts (0.7x the
  time of 16 prompts of 16-48 tokens); attention alone sees the padded layout;
- a decode step attends with two matmuls under an additive mask (no repeat_kv copy, no SDPA set-up);
- a decode step's unembedding (8-64 rows by the (vocabulary, hidden) weight, most of a step at a large
  vocabulary) runs oneDNN's kernel instead of MKL's on the CPU (`unembed_for_sampling`);
- the sampler's projections and unembedding run a packed kernel, MKL's (2-64 rows) or oneDNN's (every
  row count), whichever this CPU runs faster (`compute/packing.py`), once the decoder has lived long
  enough to earn the packing (`DecodingWeight`, `PackedWeight`): memory for one more copy of those
  weights from then on; on AVX2 CPUs that kernel is usually the engine's own (compute/cpu_kernels.cpp);
- a float32 sampler pass on the CPU runs each layer's element-wise stretches as fused kernels (residual
  add + RMSNorm, silu·up, and a decode step's q/k norm + rotary and attention over the cache): four ops
  where torch takes ~30 (`cpu_kernels.apply_to`).

It reads and writes the sampler's KV cache exactly as the transformers model does (`Cache.update` per
layer). Models it does not cover (architecture.describe gives None) and LoRA variants or dropout run
through transformers: `fuse_base_weights` or `build` returns None. tests/engine_core/test_decoder.py
checks its logits and LoRA gradients against transformers + PEFT for every family.
"""

from __future__ import annotations

from collections.abc import Callable, Mapping, Sequence
from dataclasses import dataclass
from typing import Any, TypeVar

import torch
import torch.nn.functional as F
from peft.tuners.lora import LoraLayer
from transformers.activations import ACT2FN

from tinkerrpc_server.engine.compute import cpu_kernels
from tinkerrpc_server.engine.compute.architecture import Architecture, describe
from tinkerrpc_server.engine.compute.packing import PackedWeight, PackingPlan, packing_plan

_ATTENTION = ("q_proj", "k_proj", "v_proj")
_GATE_UP = ("gate_proj", "up_proj")


@dataclass(frozen=True)
class _Projection:
    """Modules `parent.<name>` whose outputs are concatenated column blocks of `x @ weight_t`."""

    parent: Any
    names: tuple[str, ...]
    weight_t: torch.Tensor  # (in, sum of outs), contiguous
    splits: tuple[int, ...]

    def modules(self) -> tuple[Any, ...]:
        """Looked up on use: PEFT replaces the Linear modules by LoRA layers wrapping them."""
        return tuple(getattr(self.parent, name) for name in self.names)


@dataclass(frozen=True)
class _Layer:
    qkv: _Projection
    o: _Projection
    gate_up: _Projection
    down: _Projection
    input_norm: torch.Tensor  # RMSNorm weights
    post_attention_norm: torch.Tensor
    # With q/k norm: q_norm's weight once per query head, then k_norm's once per kv head, so q and k
    # are normalized together; (heads + kv heads, head_dim).
    qk_norm_weight: torch.Tensor | None


@dataclass(frozen=True)
class BaseWeights:
    """The base model as the decoder reads it (tensors shared with the transformers modules)."""

    causal_lm: Any  # transformers' model classes are untyped
    architecture: Architecture
    layers: tuple[_Layer, ...]
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
            _Layer(
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


def _fused(parent: Any, names: tuple[str, ...]) -> _Projection:
    """One contiguous (in, sum of outs) buffer; each module's weight becomes its transposed column block."""
    modules = tuple(getattr(parent, name) for name in names)
    weight_t = torch.cat([m.weight.data.t() for m in modules], dim=1).contiguous()
    splits = tuple(int(m.weight.shape[0]) for m in modules)
    start = 0
    for module, width in zip(modules, splits, strict=True):
        module.weight.data = weight_t[:, start : start + width].t()
        start += width
    return _Projection(parent, names, weight_t, splits)


@dataclass
class DecoderOutput:
    logits: torch.Tensor
    past_key_values: Any


class FusedDecoder:
    """Callable like the transformers model in the sampler (same keyword arguments and output fields)."""

    def __init__(self, base: BaseWeights, adapter: str | None) -> None:
        self._base = base
        # Each projection's weight as the decoder multiplies by it: the adapter's merged copy
        # (W + scaling · B·A, transposed) where it changes the projection, the base weight elsewhere.
        self._weights: dict[int, DecodingWeight] = {}
        for layer in base.layers:
            for projection in (layer.qkv, layer.o, layer.gate_up, layer.down):
                merged = _merged_weight(projection, adapter)
                self._weights[id(projection)] = DecodingWeight(
                    merged if merged is not None else projection.weight_t
                )
        self._packed_rows_passes = 0
        head: Any = base.causal_lm.get_output_embeddings()
        head_linear: Any = head.base_layer if isinstance(head, LoraLayer) else head
        self._head_weight: torch.Tensor = head_linear.weight
        self._head_packed: PackedWeight | None = None
        self._packed_rows = range(0)
        # The head stays unmerged: its weight is usually the input embedding too.
        self._head_lora = _plain_lora(head, adapter)
        plan = packing_plan()
        if plan is not None and plan.pack_after_passes == 0:
            self._pack(plan)

    @classmethod
    def build(cls, base: BaseWeights | None, adapter: str | None) -> FusedDecoder | None:
        """The decoder for `adapter` (None: the bare base), or None when it cannot express it."""
        return _built(cls, base, adapter)

    def __call__(
        self,
        input_ids: torch.Tensor,
        attention_mask: torch.Tensor,
        position_ids: torch.Tensor,
        past_key_values: Any,
        use_cache: bool = True,
        logits_to_keep: int = 0,
    ) -> DecoderOutput:
        (output,) = self.forward_together(
            [
                {
                    "input_ids": input_ids,
                    "attention_mask": attention_mask,
                    "position_ids": position_ids,
                    "past_key_values": past_key_values,
                    "logits_to_keep": logits_to_keep,
                }
            ]
        )
        return output

    def forward_together(self, calls: Sequence[Mapping[str, Any]]) -> list[DecoderOutput]:
        """What calling the decoder with each of `calls` (the keyword arguments of `__call__`) returns, in
        one pass: the calls' tokens (e.g. a decode step's rows and a prefill chunk) share every matmul,
        and each call attends over its own KV cache. At a few dozen rows a matmul costs about the same
        for 20 rows as for 60, so a prefill chunk run with a decode step costs a fraction of a pass."""
        embed = self._base.causal_lm.model.embed_tokens
        # The sampler only: the learner's forward stays on torch ops, so a datum's logprobs are the same
        # whether or not its call trains.
        kernels = cpu_kernels.apply_to(embed.weight)
        segments = [self._segment(call, kernels) for call in calls]
        flat = [
            embed(segment.unpadded(call["input_ids"])) for call, segment in zip(calls, segments, strict=True)
        ]
        self._count_pass(sum(len(tokens) for tokens in flat))
        x = _decoder_layers(
            self._base, flat[0] if len(flat) == 1 else torch.cat(flat), segments, self._project, kernels
        )
        # Only the positions whose logits are wanted go through the final norm and the head, together
        # (a padding position's hidden state is zeros: its logits are never read).
        kept = []
        for call, segment, part in zip(calls, segments, _segment_slices(x, segments), strict=True):
            keep = int(call.get("logits_to_keep", 0))
            shaped = segment.padded(part)
            kept.append(shaped[:, -keep:] if keep else shaped)
        hidden = torch.cat([k.reshape(-1, k.shape[-1]) for k in kept]) if len(kept) > 1 else kept[0]
        logits = self._head(_rms_norm(hidden, self._base.final_norm, self._base.architecture.norm_eps))
        if len(kept) == 1:
            return [DecoderOutput(logits, calls[0]["past_key_values"])]
        outputs = []
        start = 0
        for call, part in zip(calls, kept, strict=True):
            rows, length = part.shape[0], part.shape[1]
            outputs.append(
                DecoderOutput(
                    logits[start : start + rows * length].view(rows, length, -1), call["past_key_values"]
                )
            )
            start += rows * length
        return outputs

    def _segment(self, call: Mapping[str, Any], kernels: bool) -> _Segment:
        base = self._base
        input_ids, padding, cache = call["input_ids"], call["attention_mask"], call["past_key_values"]
        rows, length = input_ids.shape
        inner = base.causal_lm.model
        # Takes the dtype and device of its first argument.
        rotary = Rotary.of(*inner.rotary_emb(inner.embed_tokens.weight, call["position_ids"]))
        # A decode step attends with two matmuls and a softmax under an additive mask: SDPA's CPU kernel
        # costs ~1.5x that for one query per row.
        mask = _attention_bias(padding) if length == 1 else _attention_mask(padding, length)
        scale = base.architecture.head_dim**-0.5
        # Columns whose keys and values every row holds a copy of (the n samples of one prompt).
        shared = getattr(cache, "shared_columns", None) if length == 1 else None

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int) -> torch.Tensor:
            k, v = cache.update(k, v, index)
            if length == 1:
                return _one_query_attention(q, k, v, mask, scale, shared)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

        # A prefill chunk's matmuls take its real tokens only (left padding is up to a third of a
        # chunk of prompts of uneven lengths); a decode step's rows are all real.
        real = padding[:, -length:].reshape(-1).nonzero().squeeze(-1) if length > 1 else None
        if real is not None and len(real) == rows * length:
            real = None
        fused = (
            _fused_decode_attention(base.architecture, rotary, cache, mask, shared)
            if length == 1 and kernels
            else None
        )
        return _Segment(rows, length, rotary, attend, real, fused)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._head_packed is not None and hidden.numel() // hidden.shape[-1] in self._packed_rows:
            # MKL's packed kernel: 1.1-1.5x oneDNN's plain one on a Xeon; oneDNN's packed: 1.1-1.5x on
            # an EPYC (`python -m bench.matmul_kernels`).
            logits = self._head_packed.times(hidden)
        else:
            logits = unembed_for_sampling(hidden, self._head_weight)
        if self._head_lora is not None:
            a, scaled_b = self._head_lora
            # PEFT runs the LoRA branch in the adapter's dtype (float32 on a bf16 base) and casts it back.
            logits = logits + F.linear(F.linear(hidden.to(a.dtype), a), scaled_b).to(logits.dtype)
        return logits

    def _count_pass(self, tokens: int) -> None:
        """A decoder packs its weights once it has run the passes that packing costs (the packing
        plan's), i.e. once it has shown it lives long (a base model served, a snapshot evaluated at
        length): where packing gains little that is never for a short RL rollout."""
        plan = packing_plan()
        if plan is not None and tokens in plan.rows:
            self._packed_rows_passes += 1
            if self._packed_rows_passes == plan.pack_after_passes:
                self._pack(plan)

    def _pack(self, plan: PackingPlan) -> None:
        self._weights = {key: weight.packed_copy(plan) for key, weight in self._weights.items()}
        self._head_packed = PackedWeight.of(self._head_weight, plan.kernel)
        self._packed_rows = plan.rows

    def _project(self, x: torch.Tensor, projection: _Projection) -> torch.Tensor:
        return self._weights[id(projection)].times(x)


@dataclass(frozen=True)
class DecodingWeight:
    """An (in, out) projection weight as the sampler's decoder multiplies by it: plainly, and once
    packed (`packed_copy`) by the plan's packed kernel for the plan's rows."""

    plain: torch.Tensor
    packed: PackedWeight | None = None
    packed_rows: range = range(0)

    def packed_copy(self, plan: PackingPlan) -> DecodingWeight:
        """This weight with its packed layout; itself where no packed kernel applies."""
        if self.packed is not None:
            return self
        return DecodingWeight(self.plain, PackedWeight.of(self.plain.t(), plan.kernel), plan.rows)

    def times(self, x: torch.Tensor) -> torch.Tensor:
        """x @ weight for x (tokens, in)."""
        if self.packed is None or x.shape[0] not in self.packed_rows:
            return x @ self.plain
        return self.packed.times(x)


# Rows of a decode step whose unembedding goes through oneDNN (see unembed_for_sampling).
ONEDNN_UNEMBEDDING_ROWS = range(8, 65)
_ONEDNN: bool = torch.backends.mkldnn.is_available()  # type: ignore[no-untyped-call]


def unembed_for_sampling(hidden: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    """hidden · weightᵀ for the (vocabulary, hidden) unembedding. On the CPU in float32, torch's matmul is
    MKL's sgemm, whose kernel for a few dozen rows against a (vocabulary, hidden) weight (the transposed
    operand) takes up to 2-2.8x the time of oneDNN's inner product in the same torch build; below 8 rows
    and at prefill sizes they are about even (`python -m bench.matmul_kernels`). oneDNN reads the weight
    as stored, without a packed copy. Only the sampler calls this, without grad (oneDNN's kernel has
    none). The layers' (in, out) weights stay on MKL until packed: oneDNN re-lays that layout on every
    call."""
    rows = hidden.numel() // hidden.shape[-1]
    if (
        _ONEDNN
        and rows in ONEDNN_UNEMBEDDING_ROWS
        and hidden.device.type == "cpu"
        and hidden.dtype == weight.dtype == torch.float32
        and weight.is_contiguous()
        and not torch.is_grad_enabled()
    ):
        flat = hidden.reshape(rows, hidden.shape[-1])
        logits: torch.Tensor = torch.ops.mkldnn._linear_pointwise(flat, weight, None, "none", [], "")
        return logits.view(*hidden.shape[:-1], weight.shape[0])
    return F.linear(hidden, weight)


# x (tokens, in) times a fused projection: (tokens, sum of its outs), its members' outputs side by side.
Project = Callable[[torch.Tensor, "_Projection"], torch.Tensor]
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]
# One segment's qkv (rows, q/k/v widths) of layer `index`, with the layer's q/k norm weight (or None) ->
# attention output (rows, heads · head_dim).
FusedAttention = Callable[[torch.Tensor, int, "torch.Tensor | None"], torch.Tensor]


@dataclass(frozen=True)
class _Segment:
    """`rows` × `length` tokens of one batch in a forward pass: their rotary (`Rotary`) and how they
    attend: `attend(q, k, v, layer index)` over (rows, heads, length, head_dim) tensors. With `real` (the
    flat indices of its real positions in rows × length), the pass carries only those tokens: padding
    costs no matmul, and attention alone sees the (rows, length) layout, zeros where padding would be."""

    rows: int
    length: int
    rotary: Rotary
    attend: Attend
    real: torch.Tensor | None = None
    # A decode step's whole attention on the CPU kernels (set where they apply; `attend` is then unused).
    fused_attention: FusedAttention | None = None

    @property
    def tokens(self) -> int:
        return self.rows * self.length if self.real is None else len(self.real)

    def padded(self, x: torch.Tensor) -> torch.Tensor:
        """The segment's tokens `x` (tokens, ...) laid out as (rows, length, ...)."""
        if self.real is not None:
            x = x.new_zeros((self.rows * self.length, *x.shape[1:])).index_copy(0, self.real, x)
        return x.view(self.rows, self.length, *x.shape[1:])

    def unpadded(self, x: torch.Tensor) -> torch.Tensor:
        """The segment's tokens of `x` (rows, length, ...) as (tokens, ...)."""
        flat = x.reshape(self.rows * self.length, *x.shape[2:])
        return flat if self.real is None else flat.index_select(0, self.real)


def _fused_decode_attention(
    architecture: Architecture,
    rotary: Rotary,
    cache: Any,
    bias: torch.Tensor,
    shared: tuple[int, int] | None,
) -> FusedAttention:
    """A decode step's attention on the CPU kernels: q/k norm and rotary in one op, the new keys and values
    into the cache, one op over the cache (reading the `shared` columns once)."""
    rows, dim, heads = bias.shape[0], architecture.head_dim, architecture.num_heads
    kv_heads = architecture.num_kv_heads
    qk_width = (heads + kv_heads) * dim
    cos, signed_sin = rotary.cos.reshape(rows, dim), rotary.signed_sin.reshape(rows, dim)
    bias = bias.view(rows, -1)
    scale = dim**-0.5

    def attend(qkv: torch.Tensor, index: int, qk_norm_weight: torch.Tensor | None) -> torch.Tensor:
        qk = cpu_kernels.rotary_qk(
            qkv[:, :qk_width].view(rows, -1, dim), cos, signed_sin, qk_norm_weight, architecture.norm_eps
        )
        v = qkv[:, qk_width:].view(rows, kv_heads, 1, dim)
        keys, values = cache.update(qk[:, heads:].unsqueeze(2), v, index)
        return cpu_kernels.decode_attention(qk[:, :heads], keys, values, bias, scale, shared)

    return attend


def _segment_slices(x: torch.Tensor, segments: Sequence[_Segment]) -> list[torch.Tensor]:
    """The tokens of each segment in `x` (tokens, ...), in order."""
    if len(segments) == 1:
        return [x]
    parts = []
    start = 0
    for segment in segments:
        end = start + segment.tokens
        parts.append(x[start:end])
        start = end
    return parts


def _decoder_layers(
    base: BaseWeights, x: torch.Tensor, segments: Sequence[_Segment], project: Project, kernels: bool
) -> torch.Tensor:
    """The decoder layers over embeddings `x` (tokens, hidden): the segments' tokens one after the
    other, each segment's row by row. `project` computes a fused projection over all tokens at once;
    each segment attends on its own. With `kernels` the element-wise stretches run on the fused CPU
    kernels (cpu_kernels.py), which add the residual into `x` in place."""
    gate_kernel = kernels and base.architecture.activation == "silu"
    eps = base.architecture.norm_eps
    residual: torch.Tensor | None = None
    for index, layer in enumerate(base.layers):
        x, normed = _add_and_norm(x, residual, layer.input_norm, eps, kernels)
        qkv = project(normed, layer.qkv)
        attended = [
            _attend(base.architecture, layer, index, segment, part)
            for segment, part in zip(segments, _segment_slices(qkv, segments), strict=True)
        ]
        x, normed = _add_and_norm(
            x,
            project(attended[0] if len(attended) == 1 else torch.cat(attended), layer.o),
            layer.post_attention_norm,
            eps,
            kernels,
        )
        gate_up = project(normed, layer.gate_up)
        if gate_kernel:
            gated = cpu_kernels.silu_and_multiply(gate_up)
        else:
            gate_width = layer.gate_up.splits[0]
            gated = base.activation(gate_up[:, :gate_width]) * gate_up[:, gate_width:]
        residual = project(gated, layer.down)
    return x if residual is None else x + residual


def _add_and_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float, kernels: bool
) -> tuple[torch.Tensor, torch.Tensor]:
    """x + delta (x when delta is None) and its RMSNorm; the kernel adds into x in place."""
    if kernels:
        return x, cpu_kernels.residual_rms_norm(x, delta, weight, eps)
    if delta is not None:
        x = x + delta
    return x, _rms_norm(x, weight, eps)


def _attend(
    architecture: Architecture, layer: _Layer, index: int, segment: _Segment, qkv: torch.Tensor
) -> torch.Tensor:
    """Attention of one segment's tokens in layer `index`: qkv (tokens, q/k/v widths) -> (tokens, heads ·
    head_dim)."""
    if segment.fused_attention is not None:
        return segment.fused_attention(qkv, index, layer.qk_norm_weight)
    tokens, dim, heads = qkv.shape[0], architecture.head_dim, architecture.num_heads
    qk_width = (heads + architecture.num_kv_heads) * dim
    # q and k are adjacent heads of one view: they take their norm and rotary together, half the ops.
    qk = qkv[:, :qk_width].view(tokens, -1, dim)
    if layer.qk_norm_weight is not None:
        qk = _rms_norm(qk, layer.qk_norm_weight, architecture.norm_eps)
    v = qkv[:, qk_width:].view(tokens, architecture.num_kv_heads, dim)
    qk, v = (segment.padded(t).transpose(1, 2) for t in (qk, v))
    qk = segment.rotary.apply(qk)
    out = segment.attend(qk[:, :heads], qk[:, heads:], v, index)
    return segment.unpadded(out.transpose(1, 2)).flatten(1)


@dataclass(frozen=True)
class _TrainableLora:
    """One adapter's LoRA over every member of a fused projection, as the live (trained) parameters:
    A of the members stacked (one matmul for all), each member's B with its scaling."""

    a: tuple[torch.Tensor, ...]
    scaled_b: tuple[tuple[torch.Tensor, float], ...]

    def down(self, x: torch.Tensor) -> list[torch.Tensor]:
        """x·Aᵀ of every member, from one matmul (differentiable in each A)."""
        stacked = x.to(self.a[0].dtype) @ torch.cat(self.a, dim=0).t()
        return list(torch.split(stacked, [int(a.shape[0]) for a in self.a], dim=-1))


class FusedTrainingForward:
    """The learner's forward (last hidden states of a right-padded batch), differentiable in
    one adapter's LoRA weights; what transformers + PEFT compute, with the sampler decoder's fused base
    matmuls, the members' A factors in one matmul, LoRA scalings on the small B factors (not on the
    outputs), the matmuls over real positions only, and causal attention without a mask: in a
    right-padded batch every real position sees only real positions before it, and what padding
    positions compute is never read."""

    def __init__(self, base: BaseWeights, adapter: str) -> None:
        self._base = base
        self._lora: dict[int, _TrainableLora] = {}
        for layer in base.layers:
            for projection in (layer.qkv, layer.o, layer.gate_up, layer.down):
                found = [_trainable_lora(module, adapter) for module in projection.modules()]
                if all(lora is None for lora in found):
                    continue
                if any(lora is None for lora in found):
                    raise _NotPlainLora(adapter)  # only part of a fused projection is adapted
                pairs = [lora for lora in found if lora is not None]
                self._lora[id(projection)] = _TrainableLora(
                    tuple(a for a, _, _ in pairs), tuple((b, scale) for _, b, scale in pairs)
                )

    @classmethod
    def build(cls, base: BaseWeights | None, adapter: str) -> FusedTrainingForward | None:
        """The forward for `adapter`, or None when it cannot express it (transformers runs it then)."""
        return _built(cls, base, adapter)

    def hidden_states(self, input_ids: torch.Tensor, attention_mask: torch.Tensor) -> torch.Tensor:
        """The final-norm hidden states (real positions, hidden) of a right-padded batch, row by row:
        the padding positions of `attention_mask` run through attention only."""
        base = self._base
        inner = base.causal_lm.model
        rows, length = input_ids.shape
        real = attention_mask.reshape(-1).nonzero().squeeze(-1)
        x = inner.embed_tokens(input_ids.reshape(-1).index_select(0, real))
        positions = torch.arange(length, device=input_ids.device).unsqueeze(0)
        scale = base.architecture.head_dim**-0.5

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int) -> torch.Tensor:
            return F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=scale, enable_gqa=True)

        segment = _Segment(rows, length, Rotary.of(*inner.rotary_emb(x, positions)), attend, real)
        x = _decoder_layers(base, x, [segment], self._project, kernels=False)
        return _rms_norm(x, base.final_norm, base.architecture.norm_eps)

    def _project(self, x: torch.Tensor, projection: _Projection) -> torch.Tensor:
        out = x @ projection.weight_t
        lora = self._lora.get(id(projection))
        if lora is None:
            return out
        # The scaling goes on B (rank × out), not on the output (positions × out).
        updates = [
            reduced @ (b.t() * scale) for reduced, (b, scale) in zip(lora.down(x), lora.scaled_b, strict=True)
        ]
        return out + (updates[0] if len(updates) == 1 else torch.cat(updates, dim=-1)).to(out.dtype)


def _trainable_lora(module: Any, adapter: str) -> tuple[torch.Tensor, torch.Tensor, float] | None:
    """(A, B, scaling) of the adapter on `module` as live parameters; None when it has none there."""
    if not isinstance(module, LoraLayer) or adapter not in module.lora_A:
        return None
    a: Any = module.lora_A[adapter]
    b: Any = module.lora_B[adapter]
    _check_plain(module, adapter, a, b)
    return a.weight, b.weight, float(module.scaling[adapter])


class _NotPlainLora(Exception):
    pass


Built = TypeVar("Built")


def _built(
    make: Callable[[BaseWeights, Any], Built], base: BaseWeights | None, adapter: str | None
) -> Built | None:
    """`make(base, adapter)`, or None without a covered base or when the adapter is not plain LoRA."""
    if base is None:
        return None
    try:
        return make(base, adapter)
    except _NotPlainLora:
        return None


def _plain_lora(module: Any, adapter: str | None) -> tuple[torch.Tensor, torch.Tensor] | None:
    """(A, scaling · B) of the adapter on `module`; None when it has none there."""
    if adapter is None or not isinstance(module, LoraLayer) or adapter not in module.lora_A:
        return None
    a: Any = module.lora_A[adapter]
    b: Any = module.lora_B[adapter]
    _check_plain(module, adapter, a, b)
    return a.weight, b.weight * float(module.scaling[adapter])


def _check_plain(module: Any, adapter: str, a: Any, b: Any) -> None:
    """Raise _NotPlainLora unless the adapter on `module` is x·Aᵀ·Bᵀ·scaling (no variant, dropout or bias)."""
    plain = (
        adapter not in module.lora_variant
        and isinstance(module.lora_dropout[adapter], torch.nn.Identity)
        and isinstance(a, torch.nn.Linear)
        and isinstance(b, torch.nn.Linear)
        and b.bias is None
        and not module.merged
    )
    if not plain:
        raise _NotPlainLora(adapter)


def _merged_weight(projection: _Projection, adapter: str | None) -> torch.Tensor | None:
    """The projection's weight_t with the adapter merged in (summed in float32); None if it has none."""
    merged = None
    start = 0
    for module, width in zip(projection.modules(), projection.splits, strict=True):
        lora = _plain_lora(module, adapter)
        if lora is not None:
            if merged is None:
                merged = projection.weight_t.clone()
            a, scaled_b = lora
            columns = merged[:, start : start + width]
            columns.copy_(columns.float() + a.t().float() @ scaled_b.t().float())
        start += width
    return merged


def _rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm over the last dim (normalized in float32, scaled in the input's dtype) as
    one fused op."""
    normalized = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normalized.to(x.dtype)


@dataclass(frozen=True)
class Rotary:
    """The rotary embedding of a segment's positions, for (rows, heads, length, head_dim) tensors:
    x·cos + rotate_half(x)·sin as transformers computes it, where rotate_half pairs the halves of the
    last dim as (x1, x2) -> (-x2, x1). That is x rolled by half a head (x2, x1) times the sine with the
    sign of its first half flipped: two ops fewer per layer, the same numbers (a sign flip is exact)."""

    cos: torch.Tensor  # (rows, 1, length, head_dim)
    signed_sin: torch.Tensor

    @classmethod
    def of(cls, cos: torch.Tensor, sin: torch.Tensor) -> Rotary:
        """From transformers' (cos, sin), each (rows, length, head_dim)."""
        half = sin.shape[-1] // 2
        return cls(cos.unsqueeze(1), torch.cat((-sin[..., :half], sin[..., half:]), dim=-1).unsqueeze(1))

    def apply(self, x: torch.Tensor) -> torch.Tensor:
        return x * self.cos + x.roll(x.shape[-1] // 2, dims=-1) * self.signed_sin


def _attention_bias(padding: torch.Tensor) -> torch.Tensor:
    """Additive mask (rows, 1, 1, columns) of one query per row: 0 where it may attend, -inf on padding."""
    bias = torch.zeros(padding.shape, dtype=torch.float32, device=padding.device)
    return bias.masked_fill_(padding == 0, float("-inf"))[:, None, None, :]


def _one_query_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    shared: tuple[int, int] | None,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale + bias)·v for q (rows, heads, 1, d) over grouped k, v (rows, kv heads, columns,
    d). With `shared` columns (identical in every row, none of them padding), those are read once, from
    row 0, for all rows' queries, and the two parts are combined by their softmax normalizers."""
    rows, heads, _, dim = q.shape
    kv_heads = k.shape[1]
    groups = heads // kv_heads
    grouped = q.view(rows, kv_heads, groups, dim)
    if shared is None:
        scores = torch.matmul(grouped, k.transpose(-1, -2)).float().mul_(scale).add_(bias)
        attended = torch.matmul(torch.softmax(scores, dim=-1).to(v.dtype), v)
        return attended.view(rows, heads, 1, dim)
    start, end = shared
    # Prefix: every query of a kv head against that head's shared keys, as one matmul per head.
    queries = grouped.permute(1, 0, 2, 3).reshape(kv_heads, rows * groups, dim)
    prefix_scores = torch.matmul(queries, k[0, :, start:end].transpose(-1, -2)).float().mul_(scale)
    prefix_scores = prefix_scores.view(kv_heads, rows, groups, -1).permute(1, 0, 2, 3)
    # Suffix: each row's own columns (what it sampled); the columns before `start` are padding.
    own_scores = torch.matmul(grouped, k[:, :, end:].transpose(-1, -2)).float().mul_(scale)
    own_scores = own_scores.add_(bias[..., end:])
    peak = torch.maximum(prefix_scores.amax(dim=-1), own_scores.amax(dim=-1)).unsqueeze(-1)
    prefix_weights = (prefix_scores - peak).exp_()
    own_weights = (own_scores - peak).exp_()
    total = prefix_weights.sum(dim=-1, keepdim=True) + own_weights.sum(dim=-1, keepdim=True)
    prefix_part = torch.matmul(
        prefix_weights.permute(1, 0, 2, 3).reshape(kv_heads, rows * groups, -1).to(v.dtype),
        v[0, :, start:end],
    )
    prefix_part = prefix_part.view(kv_heads, rows, groups, dim).permute(1, 0, 2, 3)
    own_part = torch.matmul(own_weights.to(v.dtype), v[:, :, end:])
    attended = (prefix_part + own_part) / total.to(v.dtype)
    return attended.reshape(rows, heads, 1, dim)


def _attention_mask(padding: torch.Tensor, length: int) -> torch.Tensor:
    """Boolean SDPA mask (rows, 1, length, columns): causal over the last `length` columns and blind to
    left padding. A padding query also sees itself, so no softmax row is empty (an empty one gives NaN,
    and NaN in the cache would reach every later query through 0 × NaN)."""
    keys = padding.bool()[:, None, None, :]
    if length == 1:
        return keys
    columns = padding.shape[-1]
    query_columns = torch.arange(columns - length, columns, device=padding.device)[:, None]
    key_columns = torch.arange(columns, device=padding.device)[None, :]
    causal = key_columns <= query_columns
    return (keys & causal) | (key_columns == query_columns)
