"""The engine's own forward pass, for sampling and for learning: fewer, larger matmuls than
transformers + PEFT, for the model families architecture.py describes (one layer loop, parameterised
by their Architecture).

A decode step of a few dozen rows is skinny matmuls plus per-op overhead. This forward computes the
same function as the transformers model with one LoRA adapter active, but
- q/k/v and gate/up are one matmul each over the fused base weights, the sampler's adapter merged into
  a copy of the projections it changes, the learner's LoRA factors of a fused projection in one matmul
  (fused_weights.py). A sampler decoder lives for one sample batch of one sampler snapshot, so at most
  one merged copy of the layer weights exists at a time;
- the matmuls take only the real positions of a padded batch: the learner's right-padded one (1.3x a
  step of SmolLM2 at 16-128 tokens per sequence) and a prefill chunk of left-padded prompts (0.7x the
  time of 16 prompts of 16-48 tokens); attention alone sees the padded layout (attention.py);
- several calls run in one pass (a decode step's rows and a prefill chunk): their tokens share every
  matmul, and each attends over its own KV cache;
- which kernels run is the process's execution plan (execution_plan.py), handed to each sampler
  decoder: packed projections and unembedding (packing.py) once the decoder has lived long enough to
  earn the packing (memory for one more copy of those weights from then on), oneDNN's unembedding for
  decode-step rows, and for a float32 CPU pass the fused kernels for each layer's element-wise stretches
  (residual add + RMSNorm, silu·up, and a decode step's q/k norm + rotary and attention over the cache):
  four ops where torch takes ~30 (cpu_kernels.py). The learner's forward runs torch's ops only, so a
  datum's logprobs are the same whether or not its call trains.

It reads and writes the sampler's KV cache exactly as the transformers model does (`Cache.update` per
layer). Models it does not cover (architecture.describe gives None) and LoRA variants or dropout run
through transformers: `fuse_base_weights` or `build` returns None. tests/engine_core/test_decoder.py
checks its logits and LoRA gradients against transformers + PEFT for every family.
"""

from __future__ import annotations

from collections.abc import Callable, Sequence

import torch
import torch.nn.functional as F

from tinkerrpc_server.engine.compute import cpu_kernels
from tinkerrpc_server.engine.compute.architecture import Architecture
from tinkerrpc_server.engine.compute.attention import (
    FusedDecodeAttention,
    Rotary,
    RotaryTable,
    Segment,
    attention_bias,
    attention_mask,
    one_query_attention,
    segment_slices,
)
from tinkerrpc_server.engine.compute.execution_plan import ExecutionPlan
from tinkerrpc_server.engine.compute.forward_call import ForwardCall
from tinkerrpc_server.engine.compute.fused_weights import (
    BaseWeights,
    LayerWeights,
    Projection,
    TrainableLora,
    base_weight,
    merged_weight,
    plain_lora,
    unless_not_plain,
)
from tinkerrpc_server.engine.compute.packing import DecodingWeight, PackedWeight, PackingPlan, packed_in_order

# x (tokens, in) times a fused projection: (tokens, sum of its outs), its members' outputs side by side.
Project = Callable[[torch.Tensor, Projection], torch.Tensor]
# A packed weight for the panel kernel and its out features.
Panels = tuple[torch.Tensor, int]


class PanelLayers:
    """A decoder's layers whose weights the panel kernel holds: a layer's q/k/v projection with the
    residual add and norm before it, and its second half (o projection onward), one kernel call each; a
    decode step's layers, all of them, one call. At one row a decode step's ~9 calls per layer through
    Python cost ~5 µs each beside ~0.5 ms of weights."""

    def __init__(self, base: BaseWeights, weights: list[tuple[Panels, Panels, Panels, Panels]]) -> None:
        self._base = base
        self._weights = weights  # per layer: q/k/v, o, gate/up, down
        # The one-call decode step's arguments (cpu_kernels.decode_layers): every layer's norms and packed
        # weights in a row, the out features they share, the q/k norms where the family has them.
        self._step_weights = [
            tensor
            for layer, (qkv, o, gate_up, down) in zip(base.layers, weights, strict=True)
            for tensor in (layer.input_norm, qkv[0], o[0], layer.post_attention_norm, gate_up[0], down[0])
        ]
        self._features = [features for _, features in weights[0]]
        assert all([features for _, features in layer] == self._features for layer in weights)
        norms = [layer.qk_norm_weight for layer in base.layers]
        self._qk_norms = [norm for norm in norms if norm is not None]
        assert len(self._qk_norms) in (0, len(norms))

    def qkv(self, x: torch.Tensor, residual: torch.Tensor | None, index: int) -> torch.Tensor:
        """x += residual in place (the last layer's output, when given); layer `index`'s q/k/v of x."""
        norm = self._base.layers[index].input_norm
        return cpu_kernels.decoder_qkv(
            x, residual, norm, self._base.architecture.norm_eps, self._weights[index][0]
        )

    def second_half(self, x: torch.Tensor, attended: torch.Tensor, index: int) -> torch.Tensor:
        """x += attended's o projection in place; the layer's gated MLP of x's norm (the next residual)."""
        _, o, gate_up, down = self._weights[index]
        norm = self._base.layers[index].post_attention_norm
        return cpu_kernels.decoder_mlp(x, attended, o, norm, self._base.architecture.norm_eps, gate_up, down)

    def decode_step(self, x: torch.Tensor, attention: FusedDecodeAttention) -> torch.Tensor:
        """A decode step's layers over x (rows, hidden) in one kernel call: what `qkv`, `attention` and
        `second_half` compute layer after layer, the new keys and values written into the cache."""
        architecture = self._base.architecture
        # The cache's shape and type for these rows (a one-token prompt's first pass meets no layers yet).
        like = x.new_empty((len(x), architecture.num_kv_heads, 0, architecture.head_dim))
        return cpu_kernels.decode_layers(
            x,
            self._step_weights,
            self._qk_norms,
            self._features,
            (attention.cos, attention.signed_sin),
            attention.cache.grow(len(self._base.layers), like),
            attention.bias,
            attention.scale,
            attention.shared,
            architecture.num_heads,
            architecture.norm_eps,
        )


class FusedDecoder:
    """The sampler's model (a SamplingModel, forward_call.py) for one adapter on the base, running the
    kernels of `plan`."""

    runs_calls_together = True

    def __init__(self, base: BaseWeights, adapter: str | None, plan: ExecutionPlan) -> None:
        self._base = base
        self._plan = plan
        # Each projection's weight as the decoder multiplies by it: the adapter's merged copy
        # (W + scaling · B·A, transposed) where it changes the projection, the base weight elsewhere.
        self._weights: dict[int, DecodingWeight] = {}
        for layer in base.layers:
            for projection in layer.projections():
                merged = merged_weight(projection, adapter)
                self._weights[id(projection)] = DecodingWeight(
                    merged if merged is not None else projection.weight_t
                )
        self._packed_rows_passes = 0
        head = base.causal_lm.get_output_embeddings()
        self._head_weight = base_weight(head)
        self._head_packed: PackedWeight | None = None
        self._packed_rows = range(0)
        self._panel_layers: PanelLayers | None = None
        # The head stays unmerged: its weight is usually the input embedding too.
        self._head_lora = plain_lora(head, adapter)
        inner = base.causal_lm.model
        self._rotary_table = RotaryTable.of(inner.rotary_emb, inner.embed_tokens.weight)
        if plan.packing is not None and plan.packing.pack_after_passes == 0:
            self._pack(plan.packing)

    @classmethod
    def build(cls, base: BaseWeights | None, adapter: str | None, plan: ExecutionPlan) -> FusedDecoder | None:
        """The decoder for `adapter` (None: the bare base), or None when it cannot express it."""
        if base is None:
            return None
        return unless_not_plain(lambda: cls(base, adapter, plan))

    def forward(self, calls: Sequence[ForwardCall]) -> list[torch.Tensor]:
        """The logits of each of `calls`, in one pass: the calls' tokens (e.g. a decode step's rows and a
        prefill chunk) share every matmul, and each call attends over its own KV cache. At a few dozen
        rows a matmul costs about the same for 20 rows as for 60, so a prefill chunk run with a decode
        step costs a fraction of a pass."""
        embed = self._base.causal_lm.model.embed_tokens
        kernels = self._plan.fused_kernels_for(embed.weight)
        segments = [self._segment(call, kernels) for call in calls]
        flat = [
            embed(segment.unpadded(call.input_ids)) for call, segment in zip(calls, segments, strict=True)
        ]
        pass_tokens = sum(len(tokens) for tokens in flat)
        self._count_pass(pass_tokens)
        # The panel kernel's layers where its packed weights serve these rows, as `_project` would use them.
        panel_layers = self._panel_layers if kernels and pass_tokens in self._packed_rows else None
        x = _decoder_layers(
            self._base,
            flat[0] if len(flat) == 1 else torch.cat(flat),
            segments,
            self._project,
            kernels,
            panel_layers,
        )
        # Only the positions whose logits are wanted go through the final norm and the head, together
        # (a padding position's hidden state is zeros: its logits are never read).
        kept = []
        for call, segment, part in zip(calls, segments, segment_slices(x, segments), strict=True):
            keep = call.logits_to_keep
            shaped = segment.padded(part)
            kept.append(shaped[:, -keep:] if keep else shaped)
        hidden = torch.cat([k.reshape(-1, k.shape[-1]) for k in kept]) if len(kept) > 1 else kept[0]
        # On the kernels, one op where torch's norm is several: each cost ~40 us of a one-row decode step
        # with the step's weights through the caches.
        _, normed = _add_and_norm(
            hidden.reshape(-1, hidden.shape[-1]).contiguous(),
            None,
            self._base.final_norm,
            self._base.architecture.norm_eps,
            kernels,
        )
        logits = self._head(normed.view(hidden.shape))
        if len(kept) == 1:
            return [logits]
        outputs = []
        start = 0
        for part in kept:
            rows, length = part.shape[0], part.shape[1]
            outputs.append(logits[start : start + rows * length].view(rows, length, -1))
            start += rows * length
        return outputs

    def fused_kernels_for(self, tensor: torch.Tensor) -> bool:
        return self._plan.fused_kernels_for(tensor)

    def _segment(self, call: ForwardCall, kernels: bool) -> Segment:
        base = self._base
        padding, cache = call.attention_mask, call.cache
        rows, length = call.input_ids.shape
        inner = base.causal_lm.model
        if self._rotary_table is not None:
            # A token's position is below its row's columns: the real tokens before it are in them.
            rotary = self._rotary_table.rotary(call.position_ids, padding.shape[-1])
        else:
            # Takes the dtype and device of its first argument.
            rotary = Rotary.of(*inner.rotary_emb(inner.embed_tokens.weight, call.position_ids))
        # A decode step attends with two matmuls and a softmax under an additive mask.
        mask = attention_bias(padding) if length == 1 else attention_mask(padding, length)
        scale = base.architecture.head_dim**-0.5
        # Columns whose keys and values every row holds a copy of (the n samples of one prompt).
        shared = cache.shared_columns if length == 1 else None

        def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, index: int) -> torch.Tensor:
            k, v = cache.update(k, v, index)
            if length == 1:
                return one_query_attention(q, k, v, mask, scale, shared)
            return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=scale, enable_gqa=True)

        # A prefill chunk's matmuls take its real tokens only (left padding is up to a third of a
        # chunk of prompts of uneven lengths); a decode step's rows are all real.
        real = padding[:, -length:].reshape(-1).nonzero().squeeze(-1) if length > 1 else None
        if real is not None and len(real) == rows * length:
            real = None
        fused = (
            FusedDecodeAttention.of(base.architecture, rotary, cache, mask, shared)
            if length == 1 and kernels
            else None
        )
        return Segment(rows, length, rotary, attend, real, fused)

    def _head(self, hidden: torch.Tensor) -> torch.Tensor:
        if self._head_packed is not None and hidden.numel() // hidden.shape[-1] in self._packed_rows:
            # MKL's packed kernel: 1.1-1.5x oneDNN's plain one on a Xeon; oneDNN's packed: 1.1-1.5x on
            # an EPYC (`python -m bench.matmul_kernels`).
            logits = self._head_packed.times(hidden)
        else:
            logits = self._plan.unembed(hidden, self._head_weight)
        if self._head_lora is not None:
            a, scaled_b = self._head_lora
            # PEFT runs the LoRA branch in the adapter's dtype (float32 on a bf16 base) and casts it back.
            logits = logits + F.linear(F.linear(hidden.to(a.dtype), a), scaled_b).to(logits.dtype)
        return logits

    def _count_pass(self, tokens: int) -> None:
        """A decoder packs its weights once it has run the passes that packing costs (the packing
        plan's), i.e. once it has shown it lives long (a base model served, a snapshot evaluated at
        length): where packing gains little that is never for a short RL rollout."""
        packing = self._plan.packing
        if packing is not None and tokens in packing.rows:
            self._packed_rows_passes += 1
            if self._packed_rows_passes == packing.pack_after_passes:
                self._pack(packing)

    def _pack(self, packing: PackingPlan) -> None:
        # The layers' projections in order (base.layers', each layer's), then the unembedding: a decode
        # step's order.
        *layers, self._head_packed = packed_in_order(
            [weight.plain.t() for weight in self._weights.values()] + [self._head_weight], packing.kernel
        )
        self._weights = {
            key: weight.with_packed(packed, packing)
            for (key, weight), packed in zip(self._weights.items(), layers, strict=True)
        }
        self._packed_rows = packing.rows
        if packing.kernel != "panels" or self._base.architecture.activation != "silu":
            return
        weights = []
        for layer in self._base.layers:
            packed = [self._weights[id(p)].packed for p in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            if any(weight is None for weight in packed):
                return  # only float32 CPU weights are packed: a bf16 base keeps its separate calls
            qkv, o, gate_up, down = ((w.packed, w.out_features) for w in packed if w is not None)
            weights.append((qkv, o, gate_up, down))
        self._panel_layers = PanelLayers(self._base, weights)

    def _project(self, x: torch.Tensor, projection: Projection) -> torch.Tensor:
        return self._weights[id(projection)].times(x)


class FusedTrainingForward:
    """The learner's forward (last hidden states of a right-padded batch), differentiable in
    one adapter's LoRA weights; what transformers + PEFT compute, with the sampler decoder's fused base
    matmuls, the members' A factors in one matmul, LoRA scalings on the small B factors (not on the
    outputs), the matmuls over real positions only, and causal attention without a mask: in a
    right-padded batch every real position sees only real positions before it, and what padding
    positions compute is never read."""

    def __init__(self, base: BaseWeights, adapter: str) -> None:
        self._base = base
        self._lora: dict[int, TrainableLora] = {}
        for layer in base.layers:
            for projection in layer.projections():
                lora = TrainableLora.of(projection, adapter)
                if lora is not None:
                    self._lora[id(projection)] = lora

    @classmethod
    def build(cls, base: BaseWeights | None, adapter: str) -> FusedTrainingForward | None:
        """The forward for `adapter`, or None when it cannot express it (transformers runs it then)."""
        if base is None:
            return None
        return unless_not_plain(lambda: cls(base, adapter))

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

        segment = Segment(rows, length, Rotary.of(*inner.rotary_emb(x, positions)), attend, real)
        x = _decoder_layers(base, x, [segment], self._project, kernels=False)
        return rms_norm(x, base.final_norm, base.architecture.norm_eps)

    def _project(self, x: torch.Tensor, projection: Projection) -> torch.Tensor:
        out = x @ projection.weight_t
        lora = self._lora.get(id(projection))
        return out if lora is None else out + lora.update(x).to(out.dtype)


def _decoder_layers(
    base: BaseWeights,
    x: torch.Tensor,
    segments: Sequence[Segment],
    project: Project,
    kernels: bool,
    panel_layers: PanelLayers | None = None,
) -> torch.Tensor:
    """The decoder layers over embeddings `x` (tokens, hidden): the segments' tokens one after the
    other, each segment's row by row. `project` computes a fused projection over all tokens at once;
    each segment attends on its own. With `kernels` the element-wise stretches run on the fused CPU
    kernels (cpu_kernels.py), which add the residual into `x` in place; with `panel_layers` (kernels
    only) a layer is two such calls around its attention, and a decode step's layers are one call."""
    if panel_layers is not None and len(segments) == 1 and segments[0].fused_attention is not None:
        return panel_layers.decode_step(x, segments[0].fused_attention)
    gate_kernel = kernels and base.architecture.activation == "silu"
    eps = base.architecture.norm_eps
    residual: torch.Tensor | None = None
    for index, layer in enumerate(base.layers):
        if panel_layers is not None:
            qkv = panel_layers.qkv(x, residual, index)
        else:
            x, normed = _add_and_norm(x, residual, layer.input_norm, eps, kernels)
            qkv = project(normed, layer.qkv)
        attended = [
            _attend(base.architecture, layer, index, segment, part)
            for segment, part in zip(segments, segment_slices(qkv, segments), strict=True)
        ]
        attention = attended[0] if len(attended) == 1 else torch.cat(attended)
        if panel_layers is not None:
            residual = panel_layers.second_half(x, attention, index)
            continue
        x, normed = _add_and_norm(x, project(attention, layer.o), layer.post_attention_norm, eps, kernels)
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
    return x, rms_norm(x, weight, eps)


def _attend(
    architecture: Architecture, layer: LayerWeights, index: int, segment: Segment, qkv: torch.Tensor
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
        qk = rms_norm(qk, layer.qk_norm_weight, architecture.norm_eps)
    v = qkv[:, qk_width:].view(tokens, architecture.num_kv_heads, dim)
    qk, v = (segment.padded(t).transpose(1, 2) for t in (qk, v))
    qk = segment.rotary.apply(qk)
    out = segment.attend(qk[:, :heads], qk[:, heads:], v, index)
    return segment.unpadded(out.transpose(1, 2)).flatten(1)


def rms_norm(x: torch.Tensor, weight: torch.Tensor, eps: float) -> torch.Tensor:
    """transformers' RMSNorm over the last dim (normalized in float32, scaled in the input's dtype) as
    one fused op."""
    normalized = F.rms_norm(x.float(), (x.shape[-1],), eps=eps)
    return weight * normalized.to(x.dtype)
