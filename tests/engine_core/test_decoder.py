"""The engine's own forward (engine/compute/decoder.py) computes what transformers + PEFT compute, for
every family in architecture.FAMILIES (a tiny model of each): same logits over a chunked, left-padded
prefill and the decode steps after it, with and without an adapter, same learner logprobs and LoRA
gradients, on fused weights that share memory with the transformers modules; what it cannot express
falls back."""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import pytest
import torch
from decoder_parity import (
    PROMPTS,
    VALUES_TOLERANCE,
    assert_close_at_scale,
    assert_decoder_logits_equal_transformers,
    assert_training_forward_equals_transformers,
    build_tiny_llama,
    decoder_of,
    left_padded_prompts,
    run_forward,
)
from peft import LoraConfig

from tinkerrpc_server.engine.compute.decoder import FusedDecoder, FusedTrainingForward
from tinkerrpc_server.engine.compute.forward_call import ForwardCall, SamplingModel, TransformersSampler
from tinkerrpc_server.engine.compute.kv_cache import new_cache
from tinkerrpc_server.engine.compute.packing import PACKED_ROWS, DecodingWeight, PackedWeight, PackingPlan
from tinkerrpc_server.engine.compute.samples import SampleJob
from tinkerrpc_server.engine.compute.scheduler import generate
from tinkerrpc_server.engine.runtime import SAMPLER_CACHE_SIZE, BaseModelRuntime, LoraSpec

pytestmark = pytest.mark.unit


@pytest.fixture(scope="module", params=["qwen3", "llama"])
def runtime(
    request: pytest.FixtureRequest, tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> BaseModelRuntime:
    """tiny-chat (Qwen3), or a tiny Llama (grouped heads, tied embeddings, rope theta 1e5)."""
    if request.param == "qwen3":
        return BaseModelRuntime(tiny_model_path, device="cpu")
    directory = tmp_path_factory.mktemp("tiny-llama")
    path = build_tiny_llama(directory, tiny_model_path, {"rope_type": "default", "rope_theta": 1e5})
    return BaseModelRuntime(path, device="cpu")


def test_decoder_equals_transformers_with_an_adapter(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    assert_decoder_logits_equal_transformers(runtime, runtime._sampler_adapter(sampler_dir))


def test_decoder_equals_transformers_on_the_bare_base(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    assert_decoder_logits_equal_transformers(runtime, None)


def test_the_adapter_changes_the_decoders_logits(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    peft_name = runtime._sampler_adapter(sampler_dir)
    with_adapter = run_forward(decoder_of(runtime, peft_name), steps=0)
    bare = run_forward(decoder_of(runtime, None), steps=0)
    assert (with_adapter[1][:, -1] - bare[1][:, -1]).abs().max() > 0.1


def test_fused_weights_are_the_modules_weights(runtime: BaseModelRuntime) -> None:
    """No copy: the transformers modules read their weights from the decoder's fused buffers."""
    weights = runtime._decoder_weights
    assert weights is not None
    attention = runtime._base.model.layers[0].self_attn
    fused = weights.layers[0].qkv.weight_t
    q_proj = attention.q_proj.base_layer if hasattr(attention.q_proj, "base_layer") else attention.q_proj
    k_proj = attention.k_proj.base_layer if hasattr(attention.k_proj, "base_layer") else attention.k_proj
    assert q_proj.weight.data_ptr() == fused.data_ptr()
    assert k_proj.weight.untyped_storage().data_ptr() == fused.untyped_storage().data_ptr()
    torch.testing.assert_close(
        k_proj.weight, fused[:, q_proj.weight.shape[0] : q_proj.weight.shape[0] + k_proj.weight.shape[0]].t()
    )


def test_sampling_runs_on_the_decoder(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    with runtime._sampling_model(sampler_dir)() as model:
        assert isinstance(model, FusedDecoder)


def test_sampling_through_transformers_gives_the_decoders_greedy_tokens(
    runtime: BaseModelRuntime, sampler_dir: Path
) -> None:
    """What the decoder cannot express samples through transformers + PEFT (TransformersSampler: one model
    call per ForwardCall, its cache extended in place): the same greedy tokens as the decoder's."""
    peft_name = runtime._sampler_adapter(sampler_dir)
    jobs = [SampleJob(prompt, 2, 8, temperature=0.0, stop_token_ids=[]) for prompt in PROMPTS]

    @contextmanager
    def on_transformers() -> Iterator[SamplingModel]:
        with runtime._active(peft_name) as model, torch.inference_mode():
            yield TransformersSampler(model)

    theirs = generate(on_transformers, jobs, runtime.tokenizer, runtime.device, runtime.policy)
    ours = runtime.sample(sampler_dir, jobs)
    assert [[s.tokens for s in out.sequences] for out in theirs] == [
        [s.tokens for s in out.sequences] for out in ours
    ]
    assert all(len(s.tokens) == 8 for out in theirs for s in out.sequences)


def test_an_adapter_it_cannot_express_falls_back(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    runtime._sampler_adapter(sampler_dir)  # the PEFT model exists
    assert runtime._peft is not None
    runtime._peft.add_adapter("with-dropout", LoraConfig(r=4, lora_dropout=0.1, target_modules=["q_proj"]))
    try:
        assert FusedDecoder.build(runtime._decoder_weights, "with-dropout", runtime._plan) is None
    finally:
        runtime._peft.delete_adapter("with-dropout")


def test_shared_prompt_columns_are_read_once_with_the_same_result(
    runtime: BaseModelRuntime, sampler_dir: Path
) -> None:
    """Rows holding copies of one prompt's KV: attention over those columns read once (from row 0) for
    every row gives what reading each row's own copy gives."""
    decoder = decoder_of(runtime, runtime._sampler_adapter(sampler_dir))
    prompt, rows, steps = PROMPTS[0], 4, 6
    logits_by_mode = []
    for shared in (False, True):
        ids = torch.tensor([prompt] * rows)
        mask = torch.ones_like(ids)
        positions = (mask.cumsum(-1) - 1).expand(rows, -1)
        cache = new_cache()
        seen = []
        with torch.inference_mode():
            decoder.forward([ForwardCall(ids, mask, positions, cache)])
            last = positions[:, -1:]
            # Different tokens per row from the first step on, so the rows' own columns differ.
            token = torch.arange(rows)[:, None] + 7
            for _ in range(steps):
                cache.shared_columns = (0, len(prompt)) if shared else None
                mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
                last = last + 1
                (logits,) = decoder.forward([ForwardCall(token, mask, last, cache)])
                seen.append(logits.float())
                token = logits[:, -1].argmax(-1, keepdim=True)
        logits_by_mode.append(torch.stack(seen))
    plain, shared_read = logits_by_mode
    assert (plain[:, 0] - plain[:, 1]).abs().max() > 1e-3  # the rows really differ
    assert_close_at_scale(shared_read, plain, VALUES_TOLERANCE)


def test_training_forward_equals_transformers(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    assert_training_forward_equals_transformers(runtime, "policy")


def test_training_runs_on_the_engines_forward(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    assert (
        FusedTrainingForward.build(runtime._decoder_weights, runtime._adapters["policy"].peft_name)
        is not None
    )


def test_calls_run_together_return_what_each_returns_alone(
    runtime: BaseModelRuntime, sampler_dir: Path
) -> None:
    """A decode step and a prefill chunk in one pass (their tokens share the matmuls, each attends over
    its own cache): the same logits, and the same keys and values in each cache, as two passes."""
    decoder = decoder_of(runtime, runtime._sampler_adapter(sampler_dir))

    def calls() -> list[ForwardCall]:
        """A 2-row batch one decode step in (after a prefill of PROMPTS) and a new 3-token prompt."""
        ids, mask, positions = left_padded_prompts()
        cache = new_cache()
        decoder.forward([ForwardCall(ids, mask, positions, cache)])
        step_mask = torch.cat([mask, torch.ones((len(PROMPTS), 1), dtype=mask.dtype)], dim=-1)
        new_prompt = torch.tensor([[9, 250, 31]])
        return [
            ForwardCall(torch.tensor([[3], [4]]), step_mask, positions[:, -1:] + 1, cache),
            ForwardCall(
                new_prompt,
                torch.ones_like(new_prompt),
                torch.arange(3).unsqueeze(0),
                new_cache(),
                logits_to_keep=1,
            ),
        ]

    with torch.inference_mode():
        alone_calls, together_calls = calls(), calls()
        alone = [decoder.forward([call])[0] for call in alone_calls]
        together = decoder.forward(together_calls)
    assert [logits.shape for logits in together] == [logits.shape for logits in alone]
    assert together[1].shape[1] == 1  # logits_to_keep held per call
    for mine, expected, my_call, their_call in zip(together, alone, together_calls, alone_calls, strict=True):
        assert_close_at_scale(mine, expected, VALUES_TOLERANCE)
        for my_layer, their_layer in zip(my_call.cache.layers, their_call.cache.layers, strict=True):
            assert_close_at_scale(my_layer.keys, their_layer.keys, VALUES_TOLERANCE)
            assert_close_at_scale(my_layer.values, their_layer.values, VALUES_TOLERANCE)


def test_one_decoder_is_kept_for_the_sampler_weights_sampled_last(
    runtime: BaseModelRuntime, sampler_dir: Path, tmp_path: Path
) -> None:
    """Sample batches in a row on the same weights reuse their decoder (its merged layers are built
    once); other weights replace it, and it goes when its adapter leaves the sampler cache."""

    def decoder_of(weights: Path | None) -> object:
        with runtime._sampling_model(weights)() as model:
            return model

    first = decoder_of(sampler_dir)
    assert decoder_of(sampler_dir) is first
    assert decoder_of(None) is not first
    rebuilt = decoder_of(sampler_dir)
    assert rebuilt is not first and isinstance(rebuilt, FusedDecoder)
    runtime.create_adapter("other", LoraSpec(rank=4, seed=9))
    for index in range(SAMPLER_CACHE_SIZE):  # other sampler weights push the first out of the cache
        runtime.save_state("other", tmp_path / f"other-{index}", include_optimizer=False)
        runtime._sampler_adapter(tmp_path / f"other-{index}")
    assert runtime._last_decoder is None
    assert decoder_of(sampler_dir) is not rebuilt


# What each packed kernel shows in torch's profiler.
KERNEL_OPS = {
    "mkl": "mkl::_mkl_linear",
    "onednn": "mkldnn::_linear_pointwise",
    "panels": "tinkerrpc_cpu::packed_linear",
}
PLANS = [PackingPlan(kernel, PACKED_ROWS[kernel], 2) for kernel in ("mkl", "onednn", "panels")]


def _out_features(kernel: str, input_shapes: list[list[int]]) -> int:
    """The weight's out features from the shapes a packed kernel's op was called with: MKL's zero-stride
    (out, in) stand-in, oneDNN's packed (out, in), or the panels (segments, out / 16 rounded up, segment
    rows, 16): rounded up to whole panels there."""
    if kernel == "mkl":
        return input_shapes[2][0]
    if kernel == "onednn":
        return input_shapes[1][0]
    return input_shapes[1][1] * input_shapes[1][3]


def _whole_panels(kernel: str, out_features: int) -> int:
    return -(-out_features // 16) * 16 if kernel == "panels" else out_features


@pytest.mark.parametrize("plan", PLANS, ids=lambda plan: plan.kernel)
@pytest.mark.parametrize("rows", [1, 2, 5, 16, 33, 64, 65, 130])
@pytest.mark.parametrize("shape", [(576, 960), (1536, 576), (96, 3000)])
def test_a_packed_projection_multiplies_any_row_count_as_a_matmul(
    plan: PackingPlan, rows: int, shape: tuple[int, int]
) -> None:
    """The decoder's projections: the plan's packed kernel for its rows (a layout made for one row count
    serves every count), a plain matmul for the others; the same numbers either way."""
    generator = torch.Generator().manual_seed(rows)
    weight_t = torch.randn(*shape, generator=generator)
    x = torch.randn(rows, shape[0], generator=generator)
    projection = DecodingWeight(weight_t).with_packed(PackedWeight.of(weight_t.t(), plan.kernel), plan)
    with torch.inference_mode(), torch.profiler.profile() as profiled:
        product = projection.times(x)
    assert product.shape == (rows, shape[1])
    assert_close_at_scale(product, x @ weight_t, 1e-5)
    kernels = {event.key for event in profiled.key_averages()}
    assert (KERNEL_OPS[plan.kernel] in kernels) == (rows in plan.rows)


@pytest.mark.parametrize("plan", PLANS, ids=lambda plan: plan.kernel)
def test_a_decoder_that_packs_its_weights_midway_keeps_transformers_logits(
    runtime: BaseModelRuntime, sampler_dir: Path, plan: PackingPlan
) -> None:
    """After the plan's passes of its rows a decoder packs its projections and its unembedding and runs
    the plan's packed kernel from then on: its logits stay those of transformers + PEFT."""
    execution = replace(runtime._plan, packing=plan)
    with torch.profiler.profile(record_shapes=True) as profiled:
        assert_decoder_logits_equal_transformers(runtime, runtime._sampler_adapter(sampler_dir), execution)
    # The unembedding's (vocabulary, hidden) product ran packed too (two rows: below the rows for which
    # the unpacked unembedding takes oneDNN's kernel).
    out_features = [
        _out_features(plan.kernel, event.input_shapes)
        for event in profiled.events()
        if event.name == KERNEL_OPS[plan.kernel] and event.input_shapes
    ]
    assert out_features
    assert _whole_panels(plan.kernel, runtime.vocab_size) in out_features
