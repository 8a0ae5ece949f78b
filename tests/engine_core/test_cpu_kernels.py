"""The fused CPU kernels (engine/compute/cpu_kernels.cpp, decode_attention.cpp, panel_matmul.cpp,
decode_step.cpp) compute what the torch ops or the kernel calls they replace compute, at shapes that reach their vector tails and their threaded paths; they
refuse what they cannot compute; they build here; and the sampler's decoder runs on them (and equals
transformers with or without them)."""

from __future__ import annotations

from dataclasses import replace
from pathlib import Path

import pytest
import torch
import torch.nn.functional as F
from decoder_parity import assert_decoder_logits_equal_transformers, decoder_of, run_forward

from tinkerrpc_server.engine.compute import cpu_kernels
from tinkerrpc_server.engine.compute.attention import Rotary, one_query_attention
from tinkerrpc_server.engine.compute.execution_plan import TORCH_OPS, process_plan
from tinkerrpc_server.engine.runtime import BaseModelRuntime
from tinkerrpc_server.settings import KernelSettings

pytestmark = pytest.mark.unit

TOLERANCE = {"rtol": 2e-6, "atol": 2e-6}


@pytest.fixture(autouse=True)
def _inference() -> object:
    # The process's plan loads the kernels (built first where needed).
    assert process_plan().cpu_kernels
    with torch.inference_mode():
        yield


def test_the_kernels_build_and_load_here() -> None:
    plan = process_plan()
    assert plan.cpu_kernels
    assert plan.fused_kernels_for(torch.zeros(1))
    assert not plan.fused_kernels_for(torch.zeros(1, dtype=torch.bfloat16))
    with torch.inference_mode(False), torch.enable_grad():
        assert not plan.fused_kernels_for(torch.zeros(1))  # no backward
    assert not TORCH_OPS.fused_kernels_for(torch.zeros(1))


def test_the_settings_turn_the_kernels_off() -> None:
    assert not cpu_kernels.load(KernelSettings(enabled=False))


@pytest.mark.parametrize("tokens,hidden", [(1, 576), (16, 576), (3, 37), (700, 64)])
def test_residual_rms_norm(tokens: int, hidden: int) -> None:
    generator = torch.Generator().manual_seed(tokens)
    x, delta = (torch.randn(tokens, hidden, generator=generator) * 3 for _ in range(2))
    weight = torch.randn(hidden, generator=generator)
    expected_x = x + delta
    expected = weight * F.rms_norm(expected_x, (hidden,), eps=1e-6)
    out = cpu_kernels.residual_rms_norm(x, delta, weight, 1e-6)
    assert torch.equal(x, expected_x)  # the residual lands in x
    torch.testing.assert_close(out, expected, **TOLERANCE)
    torch.testing.assert_close(
        cpu_kernels.residual_rms_norm(x.clone(), None, weight, 1e-6), expected, **TOLERANCE
    )


@pytest.mark.parametrize("tokens,width", [(1, 1536), (16, 1536), (5, 13), (300, 256)])
def test_silu_and_multiply(tokens: int, width: int) -> None:
    gate_up = torch.randn(tokens, 2 * width, generator=torch.Generator().manual_seed(width)) * 4
    expected = F.silu(gate_up[:, :width]) * gate_up[:, width:]
    torch.testing.assert_close(cpu_kernels.silu_and_multiply(gate_up), expected, **TOLERANCE)
    # A column slice of a wider row (the fused projection's output has contiguous rows, not columns).
    wide = torch.randn(tokens, 2 * width + 8)
    torch.testing.assert_close(
        cpu_kernels.silu_and_multiply(wide[:, : 2 * width]),
        F.silu(wide[:, :width]) * wide[:, width : 2 * width],
        **TOLERANCE,
    )


@pytest.mark.parametrize("heads,dim", [(12, 64), (5, 12)])
@pytest.mark.parametrize("normed", [False, True])
def test_rotary_qk(heads: int, dim: int, normed: bool) -> None:
    rows = 9
    generator = torch.Generator().manual_seed(heads * dim)
    qkv = torch.randn(rows, (heads + 2) * dim, generator=generator)
    qk = qkv[:, : heads * dim].view(rows, heads, dim)  # rows of a wider tensor, as in the decoder
    angles = torch.rand(rows, 1, dim, generator=generator) * 6
    rotary = Rotary.of(angles.cos(), angles.sin())
    weight = torch.randn(heads, dim, generator=generator) if normed else None
    reference = qk if weight is None else weight * F.rms_norm(qk, (dim,), eps=1e-6)
    expected = rotary.apply(reference.unsqueeze(2).transpose(1, 2)).transpose(1, 2).reshape(rows, heads, dim)
    out = cpu_kernels.rotary_qk(
        qk, rotary.cos.reshape(rows, dim), rotary.signed_sin.reshape(rows, dim), weight, 1e-6
    )
    torch.testing.assert_close(out, expected, **TOLERANCE)


def _cache_views(rows: int, kv_heads: int, columns: int, dim: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Keys and values as the sampler's cache hands them over: leading views of larger buffers."""
    generator = torch.Generator().manual_seed(columns)
    buffers = [torch.randn(rows + 3, kv_heads, columns + 40, dim, generator=generator) for _ in range(2)]
    return buffers[0][:rows, :, :columns], buffers[1][:rows, :, :columns]


@pytest.mark.parametrize(
    "rows,heads,kv_heads,columns,dim",
    [(1, 9, 3, 70, 64), (16, 9, 3, 93, 64), (16, 16, 8, 40, 128), (5, 4, 4, 7, 12), (24, 6, 2, 301, 16)],
)
def test_decode_attention(rows: int, heads: int, kv_heads: int, columns: int, dim: int) -> None:
    k, v = _cache_views(rows, kv_heads, columns, dim)
    q = torch.randn(rows, heads, dim)
    padding = torch.ones(rows, columns, dtype=torch.long)
    padding[0, : columns // 3] = 0  # one left-padded row
    bias = torch.zeros(rows, columns).masked_fill_(padding == 0, float("-inf"))
    # Padding columns are not read: NaN there must not reach the output.
    k[0, :, : columns // 3] = float("nan")
    scale = dim**-0.5
    expected = one_query_attention(
        q.unsqueeze(2), k.nan_to_num(0.0), v, bias[:, None, None, :], scale, None
    ).reshape(rows, heads * dim)
    torch.testing.assert_close(
        cpu_kernels.decode_attention(q, k, v, bias, scale, None), expected, **TOLERANCE
    )


@pytest.mark.parametrize("padding", [1, 5, 8, 13])
def test_a_rows_attention_does_not_depend_on_the_batchs_padding(padding: int) -> None:
    """A row alone and the same row left-padded in a wider batch, its keys in other places of the
    kernel's blocks of 8 columns (and a last block short of 8): the same output to float32 rounding."""
    heads, kv_heads, columns, dim = 9, 3, 29, 64
    k, v = _cache_views(1, kv_heads, columns, dim)
    q = torch.randn(1, heads, dim, generator=torch.Generator().manual_seed(padding))
    alone = cpu_kernels.decode_attention(q, k, v, torch.zeros(1, columns), 0.125, None)
    wide_k, wide_v = (torch.cat([torch.zeros(1, kv_heads, padding, dim), t], dim=2) for t in (k, v))
    bias = torch.zeros(1, padding + columns)
    bias[:, :padding] = float("-inf")
    padded = cpu_kernels.decode_attention(q, wide_k, wide_v, bias, 0.125, None)
    torch.testing.assert_close(padded, alone, rtol=1e-6, atol=1e-6)


def test_decode_attention_reads_shared_columns_from_the_first_row() -> None:
    rows, heads, kv_heads, columns, dim = 8, 9, 3, 60, 64
    k, v = _cache_views(rows, kv_heads, columns, dim)
    start, end = 4, 40  # the prompt every row shares, after 4 columns of padding
    k[:, :, start:end] = k[:1, :, start:end].clone()
    v[:, :, start:end] = v[:1, :, start:end].clone()
    q = torch.randn(rows, heads, dim)
    bias = torch.zeros(rows, columns)
    bias[:, :start] = float("-inf")
    expected = one_query_attention(q.unsqueeze(2), k, v, bias[:, None, None, :], 0.125, (start, end)).reshape(
        rows, heads * dim
    )
    # The other rows' copies are never read: garbage there changes nothing.
    k[1:, :, start:end] = float("nan")
    v[1:, :, start:end] = float("nan")
    out = cpu_kernels.decode_attention(q, k, v, bias, 0.125, (start, end))
    torch.testing.assert_close(out, expected, **TOLERANCE)


@pytest.mark.parametrize(
    "rows,in_features,out_features",
    [
        *((rows, 37, 50) for rows in range(1, 18)),
        *((rows, 301, 33) for rows in (1, 2, 3, 5, 16, 17)),
        (1, 576, 960),
        (16, 1536, 576),
        (700, 96, 40),
        (2000, 7, 17),
    ],
)
def test_packed_linear(rows: int, in_features: int, out_features: int) -> None:
    """Any row count (each row block's kernel, 1 to 17 rows; several passes and sweeps of rows at 700 × 96
    and 2000 × 7), in features odd and fewer than a row's running sums, out features that end mid-panel,
    x as rows of a wider tensor."""
    if not cpu_kernels.has_packed_linear():
        pytest.skip("the panel matmul is built for AVX2 CPUs")
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(out_features, in_features, generator=generator)
    x = torch.randn(rows, in_features + 3, generator=generator)[:, :in_features]
    packed = cpu_kernels.pack_linear_weight(weight)
    # Four segments of the in features, each holding every panel's rows of it in turn.
    assert packed.shape == (4, -(-out_features // 16), -(-in_features // 4), 16)
    out = cpu_kernels.packed_linear(x, packed, out_features)
    torch.testing.assert_close(out, x @ weight.t(), rtol=1e-5, atol=1e-4)
    # The same weight given as the transpose of an (in, out) tensor packs to the same panels.
    assert torch.equal(cpu_kernels.pack_linear_weight(weight.t().contiguous().t()), packed)


def test_a_packed_product_row_does_not_depend_on_the_rows_beside_it() -> None:
    """A row's product is the same, bit for bit, alone or among 1 to 40 rows (each row block's kernel,
    its segments summed at once or one after another): a request's logprobs do not depend on its batch."""
    if not cpu_kernels.has_packed_linear():
        pytest.skip("the panel matmul is built for AVX2 CPUs")
    generator = torch.Generator().manual_seed(3)
    for in_features, out_features in ((37, 50), (576, 96)):
        weight = torch.randn(out_features, in_features, generator=generator)
        x = torch.randn(40, in_features, generator=generator)
        packed = cpu_kernels.pack_linear_weight(weight)
        alone = torch.cat([cpu_kernels.packed_linear(x[r : r + 1], packed, out_features) for r in range(40)])
        for rows in range(1, 41):
            assert torch.equal(cpu_kernels.packed_linear(x[:rows], packed, out_features), alone[:rows])


@pytest.mark.parametrize("rows", [1, 16, 17, 700])
def test_a_layers_two_calls_are_the_calls_they_replace(rows: int) -> None:
    """A layer's second half in one call computes, bit for bit, what its five calls compute, and so does
    its q/k/v projection with the residual add and norm before it; each adds into x in place as
    residual_rms_norm does (700 rows: its rows made in several sweeps, a barrier between them)."""
    if not cpu_kernels.has_packed_linear():
        pytest.skip("the panel matmul is built for AVX2 CPUs")
    generator = torch.Generator().manual_seed(4)
    hidden, heads_width, width = 96, 80, 160
    x = torch.randn(rows, hidden, generator=generator)
    attended = torch.randn(rows, heads_width, generator=generator)
    norm = torch.rand(hidden, generator=generator) + 0.5
    weights = [
        torch.randn(o, i, generator=generator)
        for o, i in ((hidden, heads_width), (2 * width, hidden), (hidden, width))
    ]
    o, gate_up, down = ((cpu_kernels.pack_linear_weight(w), w.shape[0]) for w in weights)
    separate_x = x.clone()
    normed = cpu_kernels.residual_rms_norm(separate_x, cpu_kernels.packed_linear(attended, *o), norm, 1e-5)
    gated = cpu_kernels.silu_and_multiply(cpu_kernels.packed_linear(normed, *gate_up))
    expected = cpu_kernels.packed_linear(gated, *down)
    out = cpu_kernels.decoder_mlp(x, attended, o, norm, 1e-5, gate_up, down)
    assert torch.equal(out, expected)
    assert torch.equal(x, separate_x)
    # The next layer's first call adds that output into x and projects its norm to q/k/v.
    qkv = (cpu_kernels.pack_linear_weight(torch.randn(120, hidden, generator=generator)), 120)
    expected = cpu_kernels.packed_linear(cpu_kernels.residual_rms_norm(separate_x, out, norm, 1e-5), *qkv)
    assert torch.equal(cpu_kernels.decoder_qkv(x, out, norm, 1e-5, qkv), expected)
    assert torch.equal(x, separate_x)


@pytest.mark.parametrize("rows,qk_norms,shared", [(1, False, None), (5, True, None), (16, False, (2, 9))])
def test_a_decode_steps_one_call_is_its_layers_calls(
    rows: int, qk_norms: bool, shared: tuple[int, int] | None
) -> None:
    """A decode step's layers in one call compute, bit for bit, what each layer's calls compute in turn
    (decoder_qkv, rotary_qk, the new key and value into the cache, decode_attention, decoder_mlp), and
    write the same keys and values into the cache's last column."""
    if not cpu_kernels.has_packed_linear():
        pytest.skip("the panel matmul is built for AVX2 CPUs")
    generator = torch.Generator().manual_seed(rows)
    layers, hidden, heads, kv_heads, dim, width, columns = 3, 96, 4, 2, 16, 160, 12

    def packed(out_features: int, in_features: int) -> tuple[torch.Tensor, int]:
        weight = torch.randn(out_features, in_features, generator=generator) / in_features**0.5
        return cpu_kernels.pack_linear_weight(weight), out_features

    norms = [torch.rand(hidden, generator=generator) + 0.5 for _ in range(2 * layers)]
    qkv_features = (heads + 2 * kv_heads) * dim
    projections = [
        (
            packed(qkv_features, hidden),
            packed(hidden, heads * dim),
            packed(2 * width, hidden),
            packed(hidden, width),
        )
        for _ in range(layers)
    ]
    head_norms = (
        [torch.rand(heads + kv_heads, dim, generator=generator) + 0.5 for _ in range(layers)]
        if qk_norms
        else []
    )
    cos, signed_sin = torch.randn(rows, dim, generator=generator), torch.randn(rows, dim, generator=generator)
    bias = torch.zeros(rows, columns)
    bias[rows // 2 :, :2] = float("-inf")  # the later rows' first columns are padding
    x = torch.randn(rows, hidden, generator=generator)
    caches = [_cache_views(rows, kv_heads, columns, dim) for _ in range(layers)]
    if shared is not None:
        for keys, values in caches:
            keys[:, :, shared[0] : shared[1]] = keys[:1, :, shared[0] : shared[1]]
            values[:, :, shared[0] : shared[1]] = values[:1, :, shared[0] : shared[1]]
    theirs = [(keys.clone(), values.clone()) for keys, values in caches]
    separate_x, residual = x.clone(), None
    for layer, ((qkv, o, gate_up, down), (keys, values)) in enumerate(zip(projections, theirs, strict=True)):
        projected = cpu_kernels.decoder_qkv(separate_x, residual, norms[2 * layer], 1e-5, qkv)
        qk = cpu_kernels.rotary_qk(
            projected[:, : (heads + kv_heads) * dim].view(rows, -1, dim),
            cos,
            signed_sin,
            head_norms[layer] if qk_norms else None,
            1e-5,
        )
        keys[:, :, -1] = qk[:, heads:]
        values[:, :, -1] = projected[:, (heads + kv_heads) * dim :].view(rows, kv_heads, dim)
        attended = cpu_kernels.decode_attention(qk[:, :heads], keys, values, bias, 0.25, shared)
        residual = cpu_kernels.decoder_mlp(separate_x, attended, o, norms[2 * layer + 1], 1e-5, gate_up, down)
    assert residual is not None
    expected = separate_x + residual
    weights = [
        tensor
        for layer, (qkv, o, gate_up, down) in enumerate(projections)
        for tensor in (norms[2 * layer], qkv[0], o[0], norms[2 * layer + 1], gate_up[0], down[0])
    ]
    out = cpu_kernels.decode_layers(
        x,
        weights,
        head_norms,
        [features for _, features in projections[0]],
        (cos, signed_sin),
        ([keys for keys, _ in caches], [values for _, values in caches]),
        bias,
        0.25,
        shared,
        heads,
        1e-5,
    )
    assert torch.equal(out, expected)
    assert torch.equal(x, separate_x)
    for (keys, values), (their_keys, their_values) in zip(caches, theirs, strict=True):
        assert torch.equal(keys, their_keys) and torch.equal(values, their_values)


def test_the_kernels_refuse_what_they_cannot_compute() -> None:
    with pytest.raises(RuntimeError, match="float32"):
        cpu_kernels.silu_and_multiply(torch.zeros(2, 8, dtype=torch.float64))
    with pytest.raises(RuntimeError, match="delta must match"):
        cpu_kernels.residual_rms_norm(torch.zeros(2, 8), torch.zeros(3, 8), torch.ones(8), 1e-6)
    with pytest.raises(RuntimeError, match="kv heads dividing heads"):
        q, (k, v) = torch.zeros(2, 5, 16), _cache_views(2, 2, 4, 16)
        cpu_kernels.decode_attention(q, k, v, torch.zeros(2, 4), 0.25, None)
    if cpu_kernels.has_packed_linear():
        with pytest.raises(RuntimeError, match="pack_linear_weight's layout"):
            cpu_kernels.packed_linear(
                torch.zeros(2, 8), cpu_kernels.pack_linear_weight(torch.zeros(20, 8)), 40
            )
    with pytest.raises(RuntimeError, match="shared columns"):
        q, (k, v) = torch.zeros(2, 4, 16), _cache_views(2, 2, 4, 16)
        cpu_kernels.decode_attention(q, k, v, torch.zeros(2, 4), 0.25, (3, 9))


def test_the_sampler_runs_on_the_kernels(runtime: BaseModelRuntime, monkeypatch: pytest.MonkeyPatch) -> None:
    """The decoder's decode steps call the fused attention; with the panel kernel a prefill chunk runs
    each layer as two calls around its attention and a decode step runs its layers as one call (so the
    parity tests below check the kernels); its logits equal transformers' with the kernels and without
    them."""
    calls: dict[str, int] = {}
    for name in ("decode_attention", "decoder_mlp", "decoder_qkv", "decode_layers"):
        real = getattr(cpu_kernels, name)

        def counted(*args: object, name: str = name, real: object = real) -> object:
            calls[name] = calls.get(name, 0) + 1
            return real(*args)  # type: ignore[operator]

        monkeypatch.setattr(cpu_kernels, name, counted)
    run_forward(decoder_of(runtime, None), steps=2)
    layers = len(runtime._base.model.layers)
    packing = runtime._plan.packing
    # Two prefill chunks, two steps.
    if packing is not None and packing.kernel == "panels":
        assert calls == {"decoder_qkv": 2 * layers, "decoder_mlp": 2 * layers, "decode_layers": 2}
    else:
        assert calls == {"decode_attention": 2 * layers}
    assert_decoder_logits_equal_transformers(runtime, None)
    # A first pass of one column (a one-token prompt's prefill) is shaped like a decode step but meets an
    # empty KV cache: the one call starts its layers, and the chunk after it runs layer by layer.
    calls.clear()
    assert_decoder_logits_equal_transformers(runtime, None, first_chunk=1)
    if packing is not None and packing.kernel == "panels":
        assert calls["decode_layers"] == 6 and calls["decoder_mlp"] == layers
    calls.clear()
    assert_decoder_logits_equal_transformers(runtime, None, replace(runtime._plan, cpu_kernels=False))
    assert not calls


@pytest.fixture(scope="module")
def runtime(tiny_model_path: Path) -> BaseModelRuntime:
    return BaseModelRuntime(tiny_model_path, device="cpu")
