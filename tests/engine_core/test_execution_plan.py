"""The execution plan (engine/compute/execution_plan.py): chosen once per process from the kernel
settings, it picks the kernels a sampler decoder runs. torch's private ops (MKL's and oneDNN's packed
kernels, oneDNN's unembedding) and the engine's CPU kernels are each optional: on the plan that uses
none of them (`TORCH_OPS`, what a torch build without them gets) the decoder runs torch's public ops
only and computes what the chosen plan and transformers compute."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from decoder_parity import (
    VALUES_TOLERANCE,
    assert_close_at_scale,
    assert_decoder_logits_equal_transformers,
    decoder_of,
    run_forward,
)

from tinkerrpc_server.engine.compute.execution_plan import (
    ONEDNN_UNEMBEDDING_ROWS,
    TORCH_OPS,
    ExecutionPlan,
    choose_execution_plan,
    process_plan,
)
from tinkerrpc_server.engine.compute.packing import (
    PACK_AFTER_PASSES,
    PACKED_ROWS,
    private_ops_present,
    usable_kernels,
)
from tinkerrpc_server.engine.compute.samples import SampleJob
from tinkerrpc_server.engine.runtime import BaseModelRuntime
from tinkerrpc_server.settings import KernelSettings

pytestmark = pytest.mark.unit

# The ops that are not torch's public API, as torch's profiler names them.
PRIVATE_OPS = ("mkl::", "mkldnn::", "tinkerrpc_cpu::")
ONEDNN_UNEMBEDDING = ExecutionPlan(cpu_kernels=False, packing=None, onednn_unembedding=True)


def test_the_plan_is_chosen_once_per_process() -> None:
    """Under the default settings here: the CPU kernels loaded, a packed kernel this torch build has and
    multiplies with (its rows and passes), oneDNN's unembedding; the same plan every time."""
    plan = process_plan()
    assert plan is process_plan() is choose_execution_plan(KernelSettings())
    assert plan.cpu_kernels and plan.onednn_unembedding  # torch's CPU builds have oneDNN
    assert plan.packing is not None
    assert plan.packing.kernel in usable_kernels(panels=True)
    assert plan.packing.rows == PACKED_ROWS[plan.packing.kernel]
    assert plan.packing.pack_after_passes == PACK_AFTER_PASSES[plan.packing.kernel]
    with pytest.raises(ValueError, match="chosen under"):
        choose_execution_plan(KernelSettings(enabled=False))


def test_a_packed_kernel_whose_ops_are_missing_is_not_a_candidate() -> None:
    assert private_ops_present((("mkldnn", "_linear_pointwise"),))
    assert not private_ops_present((("mkldnn", "_linear_pointwise"), ("mkldnn", "_no_such_op")))


@pytest.mark.parametrize("rows", [1, 7, 8, 16, 64, 65, 300])
def test_the_samplers_unembedding_equals_torchs_at_every_row_count(rows: int) -> None:
    """Decode-step row counts (8-64) go through oneDNN's kernel where the plan allows it, the others (and
    every count under TORCH_OPS) through torch's; the logits are the same numbers, with any leading
    shape."""
    generator = torch.Generator().manual_seed(rows)
    weight = torch.randn(3000, 96, generator=generator)
    hidden = torch.randn(rows, 1, 96, generator=generator)
    for plan in (ONEDNN_UNEMBEDDING, TORCH_OPS):
        with torch.inference_mode(), torch.profiler.profile() as profiled:
            logits = plan.unembed(hidden, weight)
        assert logits.shape == (rows, 1, 3000)
        assert_close_at_scale(logits, torch.nn.functional.linear(hidden, weight), 1e-5)
        kernels = {event.key for event in profiled.key_averages()}
        onednn = plan.onednn_unembedding and rows in ONEDNN_UNEMBEDDING_ROWS
        assert ("mkldnn::_linear_pointwise" in kernels) == onednn


def test_the_unembedding_keeps_torchs_kernel_where_a_gradient_is_wanted() -> None:
    weight = torch.randn(3000, 96, requires_grad=True)
    logits = ONEDNN_UNEMBEDDING.unembed(torch.randn(16, 96), weight)
    logits.sum().backward()
    assert weight.grad is not None and weight.grad.shape == weight.shape


def test_the_decoder_on_torchs_public_ops_equals_the_chosen_plan_and_transformers(
    runtime: BaseModelRuntime, sampler_dir: Path
) -> None:
    """No private op and no CPU kernel runs under TORCH_OPS (at prefill and decode-step sizes alike), and
    the logits are transformers' and the chosen plan's."""
    peft_name = runtime._sampler_adapter(sampler_dir)
    with torch.profiler.profile() as profiled:
        assert_decoder_logits_equal_transformers(runtime, peft_name, TORCH_OPS)
    ran = {event.key for event in profiled.key_averages()}
    assert not [op for op in ran if op.startswith(PRIVATE_OPS)]
    fallback = run_forward(decoder_of(runtime, peft_name, TORCH_OPS), steps=5)
    chosen = run_forward(decoder_of(runtime, peft_name), steps=5)
    for mine, expected in zip(fallback, chosen, strict=True):
        assert_close_at_scale(mine[:, -1], expected[:, -1], VALUES_TOLERANCE)


def test_sampling_on_torchs_public_ops_gives_the_chosen_plans_tokens(
    runtime: BaseModelRuntime, sampler_dir: Path, tiny_model_path: Path
) -> None:
    """A runtime handed TORCH_OPS samples, and its greedy tokens are those of the runtime on the
    process's plan."""
    fallback = BaseModelRuntime(tiny_model_path, device="cpu", plan=TORCH_OPS)
    job = SampleJob([5, 17, 300, 42, 8], 2, 12, temperature=0.0, stop_token_ids=[])
    (expected,) = runtime.sample(None, [job])
    (ours,) = fallback.sample(None, [job])
    assert [s.tokens for s in ours.sequences] == [s.tokens for s in expected.sequences]
