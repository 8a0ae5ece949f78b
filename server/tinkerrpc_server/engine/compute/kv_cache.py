"""The sampler's KV cache: buffers with room to grow in rows and columns, and the decoding rows whose
per-row tensors move with their cache rows (rows leave, join, and shed leading padding)."""

from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Generic, TypeVar

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer

from tinkerrpc_server.engine.compute import cpu_kernels
from tinkerrpc_server.engine.compute.token_choice import RowSampling

RowT = TypeVar("RowT")


@dataclass
class DecodingRows(Generic[RowT]):
    """Rows and their per-row tensors, aligned on dim 0; the KV cache holds their left-padded keys and
    values (columns where `mask` is 0 are padding). `next_logits` are the logits to sample from next."""

    rows: list[RowT]
    cache: SamplerCache
    mask: torch.Tensor  # (rows, columns)
    last_positions: torch.Tensor  # (rows, 1)
    next_logits: torch.Tensor  # (rows, vocab)
    uniforms: torch.Tensor  # (rows, longest max_tokens)
    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor

    @functools.cached_property
    def sampling(self) -> RowSampling:
        """The rows' sampling settings as token choice takes them: made once for these rows (keep and
        merge make new DecodingRows)."""
        return RowSampling.of(self.temperatures, self.top_ks, self.top_ps)

    def keep(self, indices: list[int]) -> DecodingRows[RowT]:
        """Only the rows at `indices` (ascending). Kept rows past the new end move into the places the
        others left, so only they are copied; the leading columns none of the kept rows needs are cut
        off (a copy of every row) once they are a quarter of the width."""
        count = len(indices)
        kept = set(indices)
        holes = [i for i in range(count) if i not in kept]
        movers = [i for i in indices if i >= count]
        order = list(range(count))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        index = torch.tensor(order, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        first = int(mask.any(dim=0).to(torch.int8).argmax())
        if first * 4 >= mask.shape[1] > 0 and first > 0:
            for layer in self.cache.layers:
                layer.keep_rows(index, first)
            mask = mask[:, first:]
        else:
            for layer in self.cache.layers:
                layer.move_rows(holes, movers, count)
        return DecodingRows(
            [self.rows[i] for i in order],
            self.cache,
            mask,
            self.last_positions.index_select(0, index),
            self.next_logits.index_select(0, index),
            self.uniforms.index_select(0, index),
            self.temperatures.index_select(0, index),
            self.top_ks.index_select(0, index),
            self.top_ps.index_select(0, index),
        )

    def merge(self, other: DecodingRows[RowT]) -> DecodingRows[RowT]:
        """Both batches' rows in one, the narrower side's cache and mask left-padded to the same width."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.stack_rows(theirs, width)
        draws = max(self.uniforms.shape[1], other.uniforms.shape[1])
        return DecodingRows(
            self.rows + other.rows,
            self.cache,
            torch.cat([left_pad(self.mask, width), left_pad(other.mask, width)]),
            torch.cat([self.last_positions, other.last_positions]),
            torch.cat([self.next_logits, other.next_logits]),
            torch.cat([right_pad(self.uniforms, draws), right_pad(other.uniforms, draws)]),
            torch.cat([self.temperatures, other.temperatures]),
            torch.cat([self.top_ks, other.top_ks]),
            torch.cat([self.top_ps, other.top_ps]),
        )


class GrowingLayer(DynamicLayer):  # type: ignore[misc]  # transformers is untyped here
    """A cache layer whose keys and values are leading views (rows, columns) of buffers with room for
    more of both: a decode step writes its keys in place instead of copying the whole cache
    (DynamicLayer's torch.cat) every step; rows joining are written after the others and rows leaving
    are replaced by the last ones, copying only those rows; what does not fit is copied once, into new
    buffers with room."""

    keys: torch.Tensor
    values: torch.Tensor
    key_buffer: torch.Tensor | None
    value_buffer: torch.Tensor | None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        self._start(key_states)
        self.keys, self.key_buffer = _appended(self.keys, self.key_buffer, key_states)
        self.values, self.value_buffer = _appended(self.values, self.value_buffer, value_states)
        return self.keys, self.values

    def grow(self, like: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """Keys and values with one more column, which a decode step's kernel writes
        (cpu_kernels.decode_layers), for `like`'s rows, heads and head dim (rows, kv heads, any, dim), in
        its dtype and device where the layer starts now."""
        self._start(like)
        rows = like.shape[0]
        self.keys, self.key_buffer = _extended(self.keys, self.key_buffer, rows, 1, like)
        self.values, self.value_buffer = _extended(self.values, self.value_buffer, rows, 1, like)
        return self.keys, self.values

    def _start(self, like: torch.Tensor) -> None:
        """Empty keys and values in `like`'s dtype and device, without buffers, unless the layer holds some."""
        if not self.is_initialized:
            self.lazy_initialization(like, like)
            self.key_buffer = self.value_buffer = None

    def keep_rows(self, index: torch.Tensor, first_column: int = 0) -> None:
        """Only the rows at `index` (repeats allowed), from column `first_column` on (a copy of all)."""
        self.keys, self.key_buffer = _rows_kept(self.keys, index, first_column)
        self.values, self.value_buffer = _rows_kept(self.values, index, first_column)

    def move_rows(self, holes: list[int], movers: list[int], count: int) -> None:
        """Row `movers[i]` copied into row `holes[i]`, then only the first `count` rows kept."""
        for hole, mover in zip(holes, movers, strict=True):
            # One strided copy per row: index_select/index_copy_ on these views take a slow path.
            self.keys[hole].copy_(self.keys[mover])
            self.values[hole].copy_(self.values[mover])
        self.keys, self.values = self.keys[:count], self.values[:count]

    def stack_rows(self, other: GrowingLayer, width: int) -> None:
        """This layer's rows, then `other`'s, each left-padded with zeros to `width` columns."""
        self.keys, self.key_buffer = _stacked(self.keys, self.key_buffer, other.keys, width)
        self.values, self.value_buffer = _stacked(self.values, self.value_buffer, other.values, width)


def _room(columns: int) -> int:
    """Columns a buffer gets for `columns` in use: half as many again, so one is copied O(log) times as
    its sequences grow."""
    return columns + max(64, columns // 2)


def _row_room(rows: int) -> int:
    """Rows a buffer gets for `rows` in use: room for a few more to join without a copy."""
    return rows + max(4, rows // 4)


def _in_place(view: torch.Tensor, buffer: torch.Tensor | None, rows: int, columns: int) -> bool:
    """Whether `view` is the leading part of `buffer` and the buffer holds `rows` × `columns`."""
    return (
        buffer is not None
        and view.dim() == 4
        and view.data_ptr() == buffer.data_ptr()
        and view.stride() == buffer.stride()
        and buffer.shape[0] >= rows
        and buffer.shape[-2] >= columns
    )


def _rows_kept(
    tensor: torch.Tensor, index: torch.Tensor, first_column: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows at `index` of `tensor` from `first_column` on, as a view of a new buffer with room."""
    _, heads, columns, dim = tensor.shape
    width = columns - first_column
    buffer = tensor.new_empty((_row_room(len(index)), heads, _room(width), dim))
    kept = buffer[: len(index), :, :width]
    torch.index_select(tensor[:, :, first_column:], 0, index, out=kept)
    return kept, buffer


def _stacked(
    top: torch.Tensor, buffer: torch.Tensor | None, bottom: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`top`'s rows then `bottom`'s, right-aligned in `width` columns with zeros on the left (finite: a
    masked column's value is still multiplied by its zero weight). Written after `top` in its buffer when
    that has room and `top` needs no padding; else both are copied into a new buffer with room."""
    rows, joining = top.shape[0], bottom.shape[0]
    if top.shape[-2] == width and _in_place(top, buffer, rows + joining, width):
        assert buffer is not None
        parts = [(rows, bottom)]
    else:
        heads, dim = top.shape[1], top.shape[-1]
        buffer = top.new_empty((_row_room(rows + joining), heads, _room(width), dim))
        parts = [(0, top), (rows, bottom)]
    for start, part in parts:
        pad = width - part.shape[-2]
        buffer[start : start + part.shape[0], :, :pad].zero_()
        buffer[start : start + part.shape[0], :, pad:width].copy_(part)
    return buffer[: rows + joining, :, :width], buffer


def _extended(
    current: torch.Tensor, buffer: torch.Tensor | None, rows: int, added: int, like: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`current` for `rows` rows with `added` more columns along the sequence dimension (what they hold is
    left to the caller), as a view of a (new) buffer of `like`'s heads, head dim, dtype and device."""
    used = current.shape[-2] if current.dim() == 4 else 0
    total = used + added
    heads, dim = like.shape[1], like.shape[-1]
    if not _in_place(current, buffer, rows, total) or buffer is None or buffer.shape[1] != heads:
        buffer = like.new_empty((_row_room(rows), heads, _room(total), dim))
        if used:
            buffer[:rows, :, :used] = current
    return buffer[:rows, :, :total], buffer


def _appended(
    current: torch.Tensor, buffer: torch.Tensor | None, new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`current` with `new` appended along the sequence dimension, as a view of a (new) buffer."""
    extended, buffer = _extended(current, buffer, new.shape[0], new.shape[-2], new)
    extended[:, :, -new.shape[-2] :] = new
    return extended, buffer


class SamplerCache(DynamicCache):  # type: ignore[misc]  # transformers is untyped here
    """The sampler's KV cache. `shared_columns` (start, end), set before a decode step when every row
    holds a copy of one prompt's KV there, lets engine/compute/decoder.py read those columns once for all rows."""

    shared_columns: tuple[int, int] | None = None

    def grow(self, layers: int, like: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]]:
        """Each of `layers` layers' keys and values with one more column for a decode step's kernel to
        write, shaped and typed as `like` (rows, kv heads, any, dim) says; the layers a first pass meets
        (a one-token prompt's) start empty."""
        while len(self.layers) < layers:
            self.layers.append(self.layer_class_to_replicate())
        in_place = self._grown_in_place(like)
        if in_place is not None:
            return in_place
        grown = [layer.grow(like) for layer in self.layers]
        return [keys for keys, _ in grown], [values for _, values in grown]

    def _grown_in_place(self, like: torch.Tensor) -> tuple[list[torch.Tensor], list[torch.Tensor]] | None:
        """`grow` for the usual step, where every layer's buffers have the room: each layer's views in one
        kernel call for the keys and one for the values (cpu_kernels.grown_views); None otherwise."""
        layers: list[GrowingLayer] = self.layers
        # A layer a first pass has not met yet holds no buffers (nor their attributes).
        key_buffers = [b for layer in layers if layer.is_initialized and (b := layer.key_buffer) is not None]
        value_buffers = [
            b for layer in layers if layer.is_initialized and (b := layer.value_buffer) is not None
        ]
        if len(key_buffers) < len(layers) or len(value_buffers) < len(layers):
            return None
        rows, heads = like.shape[0], like.shape[1]
        keys = cpu_kernels.grown_views([layer.keys for layer in layers], key_buffers, rows, heads)
        values = cpu_kernels.grown_views([layer.values for layer in layers], value_buffers, rows, heads)
        if not keys or not values:
            return None
        for layer, layer_keys, layer_values in zip(layers, keys, values, strict=True):
            layer.keys, layer.values = layer_keys, layer_values
        return keys, values


def new_cache() -> SamplerCache:
    cache = SamplerCache()
    cache.layer_class_to_replicate = GrowingLayer
    return cache


def left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Zero columns on the left of the sequence dimension (-1 of a mask, -2 of keys/values)."""
    missing = width - tensor.shape[-1 if tensor.dim() == 2 else -2]
    if missing == 0:
        return tensor
    return F.pad(tensor, (missing, 0) if tensor.dim() == 2 else (0, 0, missing, 0))


def right_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(tensor, (0, width - tensor.shape[1]))
