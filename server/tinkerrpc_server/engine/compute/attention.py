"""Attention as the engine's forward (decoder.py) computes it: the rotary embedding, the masks of a
left-padded batch, one query per row over a KV cache, and a segment of a pass (the tokens of one call,
padded or not, and how they attend).

A decode step attends with two matmuls and a softmax under an additive mask (no repeat_kv copy, no SDPA
set-up: SDPA's CPU kernel costs ~1.5x that for one query per row), reading columns every row holds a
copy of (the n samples of one prompt) once; on the fused CPU kernels (cpu_kernels.py) its q/k norm,
rotary and attention over the cache are two ops (`FusedDecodeAttention`).
"""

from __future__ import annotations

from collections.abc import Callable, Sequence
from dataclasses import dataclass

import torch

from tinkerrpc_server.engine.compute import cpu_kernels
from tinkerrpc_server.engine.compute.architecture import Architecture
from tinkerrpc_server.engine.compute.kv_cache import SamplerCache

# attend(q, k, v, layer index) over (rows, heads, length, head_dim) tensors.
Attend = Callable[[torch.Tensor, torch.Tensor, torch.Tensor, int], torch.Tensor]


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


# transformers' rope types whose inverse frequencies never depend on the sequence's length (the dynamic
# ones, e.g. "dynamic" and "longrope", recompute them past the trained length).
STATIC_ROPE_TYPES = frozenset({"default", "linear", "llama3", "yarn"})
# Positions a RotaryTable first holds; it doubles as longer sequences need.
_FIRST_TABLE_POSITIONS = 256


class RotaryTable:
    """The Rotary of positions [0, n), computed once by the model's rotary embedding (`embedding(like,
    position_ids)`, transformers' module) and looked up per pass. Each position's (cos, sin) is the same
    elementwise computation whichever positions a call holds (its frequency times the position, one product),
    so a lookup equals the per-pass call; the call's ~10 small ops took ~0.16 ms of a one-row decode step
    with the step's weights through the caches, the lookup four. Only for STATIC_ROPE_TYPES (`of` gives None
    for the others)."""

    def __init__(self, embedding: torch.nn.Module, like: torch.Tensor) -> None:
        self._embedding = embedding
        self._like = like
        self._cos = self._signed_sin = like.new_empty((0, 0))

    @classmethod
    def of(cls, embedding: torch.nn.Module, like: torch.Tensor) -> RotaryTable | None:
        return cls(embedding, like) if getattr(embedding, "rope_type", None) in STATIC_ROPE_TYPES else None

    def rotary(self, position_ids: torch.Tensor, bound: int) -> Rotary:
        """The Rotary of `position_ids` (rows, length), each below `bound`."""
        if self._cos.shape[0] < bound:
            positions = max(bound, 2 * self._cos.shape[0], _FIRST_TABLE_POSITIONS)
            ids = torch.arange(positions, device=self._like.device).unsqueeze(0)
            table = Rotary.of(*self._embedding(self._like, ids))
            self._cos, self._signed_sin = table.cos[0, 0], table.signed_sin[0, 0]
        return Rotary(self._cos[position_ids].unsqueeze(1), self._signed_sin[position_ids].unsqueeze(1))


@dataclass(frozen=True)
class Segment:
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
    fused_attention: FusedDecodeAttention | None = None

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


def segment_slices(x: torch.Tensor, segments: Sequence[Segment]) -> list[torch.Tensor]:
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


def attention_bias(padding: torch.Tensor) -> torch.Tensor:
    """Additive mask (rows, 1, 1, columns) of one query per row: 0 where it may attend, -inf on padding."""
    bias = torch.zeros(padding.shape, dtype=torch.float32, device=padding.device)
    return bias.masked_fill_(padding == 0, float("-inf"))[:, None, None, :]


def attention_mask(padding: torch.Tensor, length: int) -> torch.Tensor:
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


def one_query_attention(
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


@dataclass(frozen=True)
class FusedDecodeAttention:
    """A decode step's attention on the CPU kernels: q/k norm and rotary in one op, the new keys and
    values into the cache, one op over the cache (reading the `shared` columns once). Its pieces are also
    what the decode step's one-call layers read (decoder.PanelLayers)."""

    architecture: Architecture
    cos: torch.Tensor  # (rows, head_dim)
    signed_sin: torch.Tensor
    cache: SamplerCache
    bias: torch.Tensor  # (rows, columns)
    shared: tuple[int, int] | None

    @classmethod
    def of(
        cls,
        architecture: Architecture,
        rotary: Rotary,
        cache: SamplerCache,
        bias: torch.Tensor,
        shared: tuple[int, int] | None,
    ) -> FusedDecodeAttention:
        rows, dim = bias.shape[0], architecture.head_dim
        cos, signed_sin = rotary.cos.reshape(rows, dim), rotary.signed_sin.reshape(rows, dim)
        return cls(architecture, cos, signed_sin, cache, bias.view(rows, -1), shared)

    @property
    def scale(self) -> float:
        scale: float = self.architecture.head_dim**-0.5
        return scale

    def __call__(self, qkv: torch.Tensor, index: int, qk_norm_weight: torch.Tensor | None) -> torch.Tensor:
        architecture = self.architecture
        rows, dim, heads = qkv.shape[0], architecture.head_dim, architecture.num_heads
        kv_heads = architecture.num_kv_heads
        qk_width = (heads + kv_heads) * dim
        qk = cpu_kernels.rotary_qk(
            qkv[:, :qk_width].view(rows, -1, dim),
            self.cos,
            self.signed_sin,
            qk_norm_weight,
            architecture.norm_eps,
        )
        v = qkv[:, qk_width:].view(rows, kv_heads, 1, dim)
        keys, values = self.cache.update(qk[:, heads:].unsqueeze(2), v, index)
        return cpu_kernels.decode_attention(qk[:, :heads], keys, values, self.bias, self.scale, self.shared)
