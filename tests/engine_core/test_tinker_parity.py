"""The engine's LoRA parametrization, optimizer and sampling defaults against Tinker's (docs/tinker_parity.md
names the source of each fact)."""

from __future__ import annotations

import math

import pytest
import torch
from peft.tuners.lora import LoraLayer
from tinker import types

from tinkerrpc_server.engine.protocol import BadRequest, sample_job
from tinkerrpc_server.engine.runtime import LORA_ALPHA, BaseModelRuntime, LoraSpec


def _lora_layers(runtime: BaseModelRuntime) -> list[LoraLayer]:
    assert runtime._peft is not None
    return [m for m in runtime._peft.modules() if isinstance(m, LoraLayer)]


def _peft_name(runtime: BaseModelRuntime, model_id: str) -> str:
    return runtime._require_adapter(model_id).peft_name


@pytest.mark.parametrize("rank", [1, 8, 32, 64])
def test_lora_alpha_is_fixed_at_32_so_the_scale_is_alpha_over_rank(
    runtime: BaseModelRuntime, rank: int
) -> None:
    model_id = f"alpha-r{rank}"
    runtime.create_adapter(model_id, LoraSpec(rank=rank, seed=1))
    try:
        name = _peft_name(runtime, model_id)
        layers = [layer for layer in _lora_layers(runtime) if name in layer.scaling]
        assert layers and LORA_ALPHA == 32
        for layer in layers:
            assert layer.r[name] == rank and layer.lora_alpha[name] == 32
            assert layer.scaling[name] == pytest.approx(32 / rank)
    finally:
        runtime.delete_adapter(model_id)


def test_lora_init_b_zero_a_uniform_with_scale_one_over_sqrt_fan_in(runtime: BaseModelRuntime) -> None:
    """B = 0, so a new adapter is the base model; A ~ U(-1/sqrt(d_in), 1/sqrt(d_in)) (Kaiming-uniform, a=sqrt(5))."""
    runtime.create_adapter("init", LoraSpec(rank=16, seed=5))
    try:
        name = _peft_name(runtime, "init")
        layers = [layer for layer in _lora_layers(runtime) if name in layer.lora_A]
        for layer in layers:
            a = layer.lora_A[name].weight.detach()
            b = layer.lora_B[name].weight.detach()
            assert torch.count_nonzero(b) == 0
            bound = 1 / math.sqrt(a.shape[1])
            assert float(a.abs().max()) <= bound
            # A uniform distribution on [-bound, bound] has standard deviation bound / sqrt(3).
            assert float(a.std()) == pytest.approx(bound / math.sqrt(3), rel=0.25)
    finally:
        runtime.delete_adapter("init")


def test_adam_defaults_are_the_sdk_s_and_reach_the_optimizer(runtime: BaseModelRuntime) -> None:
    """The engine's optim_step body is the SDK's: an empty adam_params means Tinker's documented defaults,
    and those are what torch's AdamW (decoupled weight decay) runs with; grad_clip_norm 0 is no clipping."""
    request = types.OptimStepRequest.model_validate({"model_id": "m", "adam_params": {}})
    adam = request.optim_params
    assert isinstance(adam, types.AdamParams)
    assert (adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay, adam.grad_clip_norm) == (
        1e-4,
        0.9,
        0.95,
        1e-12,
        0.0,
        0.0,
    )
    runtime.create_adapter("adam", LoraSpec(rank=4, seed=2))
    try:
        runtime.optim_step(
            "adam",
            adam.learning_rate,
            adam.beta1,
            adam.beta2,
            adam.eps,
            adam.weight_decay,
            adam.grad_clip_norm,
        )
        optimizer = runtime._require_adapter("adam").optimizer
        assert isinstance(optimizer, torch.optim.AdamW)
        for group in optimizer.param_groups:
            assert group["lr"] == 1e-4 and group["betas"] == (0.9, 0.95)
            assert group["eps"] == 1e-12 and group["weight_decay"] == 0.0
    finally:
        runtime.delete_adapter("adam")


def test_sampling_defaults_are_the_sdk_s() -> None:
    """Default SamplingParams: temperature 1, no top-k (tinker's -1, the engine's 0), no nucleus (top_p 1),
    EOS stops (stop None), and no max_tokens means until the context is full (-1, filled in when the
    model is known)."""
    request = types.SampleRequest(
        sampling_session_id="s:sample:0",
        seq_id=0,
        num_samples=1,
        prompt=types.ModelInput.from_ints([1, 2, 3]),
        sampling_params=types.SamplingParams(),
    )
    job = sample_job(request)
    assert (job.temperature, job.top_k, job.top_p, job.max_tokens) == (1.0, 0, 1.0, -1)
    # tinker's top_k convention is converted once, here; a value it does not define is refused here.
    assert (
        sample_job(request.model_copy(update={"sampling_params": types.SamplingParams(top_k=5)})).top_k == 5
    )
    with pytest.raises(BadRequest, match="top_k must be -1"):
        sample_job(request.model_copy(update={"sampling_params": types.SamplingParams(top_k=-2)}))
    assert job.stop_token_ids is None and job.stop_strings == [] and job.seed is None
