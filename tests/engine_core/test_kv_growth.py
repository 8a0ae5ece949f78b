"""A decode step's KV cache growth (kv_cache.SamplerCache.grow): where every layer's buffers have room, one
kernel call per keys and values (cpu_kernels.grown_views) gives each layer the view the layer-by-layer
growth gives, in place, keeping what the cache held; where any layer lacks the room, the layers grow one
by one into new buffers."""

from __future__ import annotations

import pytest
import torch

from tinkerrpc_server.engine.compute import cpu_kernels
from tinkerrpc_server.engine.compute.execution_plan import process_plan
from tinkerrpc_server.engine.compute.kv_cache import GrowingLayer, new_cache

pytestmark = pytest.mark.unit

LAYERS, ROWS, KV_HEADS, DIM = 3, 4, 2, 8


@pytest.fixture(autouse=True)
def _kernels() -> None:
    if not (process_plan().cpu_kernels and cpu_kernels.has_packed_linear()):
        pytest.skip("the decode step's kernels are built for AVX2 CPUs")


def like(rows: int = ROWS, heads: int = KV_HEADS) -> torch.Tensor:
    return torch.empty(rows, heads, 0, DIM)


def test_growth_in_place_gives_each_layer_one_more_column_of_its_buffer(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    cache = new_cache()
    keys, values = cache.grow(LAYERS, like())  # the first growth allocates, layer by layer
    for index, (layer_keys, layer_values) in enumerate(zip(keys, values, strict=True)):
        layer_keys[:, :, -1] = index
        layer_values[:, :, -1] = -index
    buffers = [(layer.key_buffer, layer.value_buffer) for layer in cache.layers]

    def layer_by_layer(*args: object) -> None:
        raise AssertionError("a step with room grew its layers one by one")

    monkeypatch.setattr(GrowingLayer, "grow", layer_by_layer)
    keys, values = cache.grow(LAYERS, like())

    for index, layer in enumerate(cache.layers):
        assert isinstance(layer, GrowingLayer)
        key_buffer, value_buffer = buffers[index]
        assert key_buffer is not None and value_buffer is not None
        assert (layer.key_buffer, layer.value_buffer) == (key_buffer, value_buffer)  # no new buffers
        for view, buffer in ((keys[index], key_buffer), (values[index], value_buffer)):
            expected = buffer[:ROWS, :, :2]
            assert view.shape == expected.shape and view.stride() == expected.stride()
            assert view.data_ptr() == expected.data_ptr()
        assert layer.keys is keys[index] and layer.values is values[index]
        assert torch.equal(keys[index][:, :, 0], torch.full((ROWS, KV_HEADS, DIM), float(index)))
        assert torch.equal(values[index][:, :, 0], torch.full((ROWS, KV_HEADS, DIM), float(-index)))


def test_a_layer_without_room_makes_every_layer_grow_on_its_own() -> None:
    cache = new_cache()
    cache.grow(LAYERS, like())
    last = cache.layers[-1]
    room = last.key_buffer.shape[2]
    # The last layer's view fills its buffer's columns: the next column needs a new buffer.
    last.keys = last.key_buffer[:ROWS, :, :room]
    last.keys[:, :, -1] = 7.0
    old_buffer = last.key_buffer

    keys, _ = cache.grow(LAYERS, like())

    assert last.key_buffer is not old_buffer
    assert keys[-1].shape == (ROWS, KV_HEADS, room + 1, DIM)
    assert torch.equal(keys[-1][:, :, room - 1], torch.full((ROWS, KV_HEADS, DIM), 7.0))
    assert keys[0].shape == (ROWS, KV_HEADS, 2, DIM)


def test_the_kernel_refuses_views_outside_their_buffers_or_room() -> None:
    buffer = torch.zeros(ROWS + 2, KV_HEADS, 6, DIM)
    view = buffer[:ROWS, :, :3]
    assert len(cpu_kernels.grown_views([view], [buffer], ROWS + 2, KV_HEADS)) == 1
    assert cpu_kernels.grown_views([view], [buffer], ROWS + 3, KV_HEADS) == []  # rows past the buffer
    assert cpu_kernels.grown_views([view], [buffer], ROWS, KV_HEADS + 1) == []  # other heads
    assert cpu_kernels.grown_views([buffer[:ROWS, :, :6]], [buffer], ROWS, KV_HEADS) == []  # no column left
    assert cpu_kernels.grown_views([buffer[1:3, :, :3]], [buffer], 2, KV_HEADS) == []  # not the leading part
    assert cpu_kernels.grown_views([view.clone()], [buffer], ROWS, KV_HEADS) == []  # another tensor
    for rows, heads in ((0, KV_HEADS), (-1, KV_HEADS), (ROWS, 0)):
        with pytest.raises(RuntimeError, match="rows and heads must be positive"):
            cpu_kernels.grown_views([view], [buffer], rows, heads)
