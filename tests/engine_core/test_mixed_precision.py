"""The engine's mixed-precision path (the CUDA default) run on the CPU: bfloat16 base weights, float32
LoRA weights, gradients and AdamW state; training, sampling and checkpoints work in it, and its logprobs
stay near the float32 engine's. Also how the device and dtype are chosen (resolve_placement)."""

from __future__ import annotations

import os
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest
import torch
from safetensors.torch import load_file
from test_non_finite_guard import state_of

from tinkerrpc_server.engine.auth import generate_api_key
from tinkerrpc_server.engine.compute.samples import SampleJob
from tinkerrpc_server.engine.runtime import (
    ADAPTER_WEIGHTS_FILE,
    OPTIMIZER_FILE,
    BaseModelRuntime,
    DatumArrays,
    LoraSpec,
    PlacementError,
    resolve_placement,
)
from tinkerrpc_server.settings import ENGINE_API_KEY_ENV, ENGINE_DEVICE_ENV, ENGINE_DTYPE_ENV

pytestmark = pytest.mark.process

ADAM = {
    "learning_rate": 1e-2,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.0,
    "grad_clip_norm": 1.0,
}
PROMPT = [1, 291, 201, 420, 311, 408, 14, 338]
# bfloat16 keeps 8 significant bits. On tiny-chat with a random adapter, measured: the bf16 engine's
# logprobs differ from the fp32 engine's by 0.04 on average, 0.2 at most over 39 tokens; the bf16
# sampler's from the bf16 learner's (other batch shapes, a KV cache) by at most 0.06.
BF16_VS_FP32_MEAN_ATOL = 0.1
BF16_VS_FP32_MAX_ATOL = 0.4
BF16_SAMPLER_VS_LEARNER_ATOL = 0.15


@pytest.fixture(scope="module")
def bf16_runtime(tiny_model_path: Path) -> BaseModelRuntime:
    return BaseModelRuntime(tiny_model_path, device="cpu", dtype="bfloat16")


def sft_datum(vocab_size: int, length: int = 40) -> DatumArrays:
    tokens = np.random.default_rng(3).integers(0, vocab_size, length)
    return DatumArrays(
        tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(length - 1, dtype=np.float32)}
    )


def randomize(runtime: BaseModelRuntime, model_id: str) -> None:
    """Non-zero LoRA B as well as A, so the adapter changes every logprob."""
    generator = torch.Generator().manual_seed(5)
    with torch.no_grad():
        for param in runtime.adapter_parameters(model_id).values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.1)


def test_placement_defaults_settings_and_errors(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENGINE_DEVICE_ENV, raising=False)
    monkeypatch.delenv(ENGINE_DTYPE_ENV, raising=False)
    assert resolve_placement("cpu") == (torch.device("cpu"), torch.float32)
    assert resolve_placement("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    if torch.cuda.is_available():
        assert resolve_placement() == (torch.device("cuda"), torch.bfloat16)
    else:
        assert resolve_placement() == (torch.device("cpu"), torch.float32)
        with pytest.raises(PlacementError, match="no usable CUDA device"):
            resolve_placement("cuda")
    with pytest.raises(PlacementError, match="expected one of float32, bfloat16"):
        resolve_placement("cpu", "float16")
    with pytest.raises(PlacementError, match="runs on cpu or cuda"):
        resolve_placement("meta")
    with pytest.raises(PlacementError, match="not a torch device"):
        resolve_placement("gpu")
    # The settings are read by the entry points (the CLI, `serve`'s engine child), which pass them in:
    # the engine's compute code never reads the environment.
    monkeypatch.setenv(ENGINE_DEVICE_ENV, "meta")
    monkeypatch.setenv(ENGINE_DTYPE_ENV, "float16")
    assert resolve_placement("cpu", "bfloat16") == (torch.device("cpu"), torch.bfloat16)
    assert resolve_placement("cpu") == (torch.device("cpu"), torch.float32)


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_serve_s_engine_child_without_the_device_stops_at_start(tmp_path: Path) -> None:
    """What `TINKERRPC_ENGINE_DEVICE=cuda tinkerrpc serve` starts on a machine without a GPU."""
    env = {**os.environ, ENGINE_DEVICE_ENV: "cuda", ENGINE_API_KEY_ENV: generate_api_key()}
    args = ["--parent-pid", str(os.getpid()), "--host", "127.0.0.1", "--port", "0"]
    args += ["--data-dir", str(tmp_path / "data"), "--model-dir", str(tmp_path / "models")]
    child = [sys.executable, "-m", "tinkerrpc_server.local.engine_child", *args]
    run = subprocess.run(child, env=env, capture_output=True, text=True, timeout=120)
    assert run.returncode == 1
    assert "cannot start: engine device 'cuda': this machine has no usable CUDA device" in run.stderr
    assert not (tmp_path / "models").exists()  # stopped before preparing any model


def test_base_is_bf16_while_lora_gradients_and_adam_state_are_fp32_and_training_learns(
    bf16_runtime: BaseModelRuntime,
) -> None:
    runtime = bf16_runtime
    runtime.create_adapter("learner", LoraSpec(rank=8, seed=1))
    assert runtime._peft is not None
    base_dtypes = {p.dtype for name, p in runtime._peft.named_parameters() if ".lora_" not in name}
    assert base_dtypes == {torch.bfloat16}
    assert runtime._peft.config._attn_implementation == "sdpa"
    lora = runtime.adapter_parameters("learner")
    assert lora and {p.dtype for p in lora.values()} == {torch.float32}

    datum = sft_datum(runtime.vocab_size)
    losses = []
    for _ in range(6):
        result = runtime.forward_backward("learner", [datum], "cross_entropy", None, backward=True)
        assert result.logprobs[0].dtype == np.float32
        losses.append(result.metrics["loss:sum"])
        assert {p.grad.dtype for p in lora.values() if p.grad is not None} == {torch.float32}
        runtime.optim_step("learner", **ADAM)
    assert losses[-1] < 0.8 * losses[0], losses
    moments = {k: v for k, v in state_of(runtime, "learner").items() if k.endswith(("exp_avg", "exp_avg_sq"))}
    assert len(moments) == 2 * len(lora)
    assert {v.dtype for v in moments.values()} == {torch.float32}
    assert {p.dtype for p in lora.values()} == {torch.float32}
    runtime.delete_adapter("learner")


def test_fp32_checkpoint_round_trips_and_bf16_logprobs_stay_near_fp32(
    runtime: BaseModelRuntime, bf16_runtime: BaseModelRuntime, tmp_path: Path
) -> None:
    # A float32 engine's checkpoint, with optimizer state, loads into the bfloat16 engine unchanged.
    runtime.create_adapter("origin", LoraSpec(rank=4, seed=2))
    randomize(runtime, "origin")
    datum = sft_datum(runtime.vocab_size)
    runtime.forward_backward("origin", [datum], "cross_entropy", None, backward=True)
    runtime.optim_step("origin", **ADAM)
    runtime.save_state("origin", tmp_path / "fp32", include_optimizer=True)
    bf16_runtime.load_state("copy", tmp_path / "fp32", include_optimizer=True)
    assert_same_state(state_of(bf16_runtime, "copy"), state_of(runtime, "origin"))

    # The bfloat16 engine's logprobs are the float32 engine's within bfloat16 rounding.
    fp32 = runtime.forward_backward("origin", [datum], "cross_entropy", None, backward=False).logprobs[0]
    bf16 = bf16_runtime.forward_backward("copy", [datum], "cross_entropy", None, backward=False).logprobs[0]
    assert np.abs(bf16 - fp32).mean() < BF16_VS_FP32_MEAN_ATOL
    np.testing.assert_allclose(bf16, fp32, atol=BF16_VS_FP32_MAX_ATOL)

    # It trains on, and its checkpoint holds float32 weights and moments that load back exactly.
    bf16_runtime.forward_backward("copy", [datum], "cross_entropy", None, backward=True)
    bf16_runtime.optim_step("copy", **ADAM)
    bf16_runtime.save_state("copy", tmp_path / "bf16", include_optimizer=True)
    for file in (ADAPTER_WEIGHTS_FILE, OPTIMIZER_FILE):
        assert {t.dtype for t in load_file(str(tmp_path / "bf16" / file)).values()} == {torch.float32}
    bf16_runtime.load_state("reloaded", tmp_path / "bf16", include_optimizer=True)
    assert_same_state(state_of(bf16_runtime, "reloaded"), state_of(bf16_runtime, "copy"))
    runtime.delete_adapter("origin")
    for model_id in ("copy", "reloaded"):
        bf16_runtime.delete_adapter(model_id)


def assert_same_state(got: dict[str, torch.Tensor], expected: dict[str, torch.Tensor]) -> None:
    assert got.keys() == expected.keys()
    for name, value in expected.items():
        assert got[name].dtype == torch.float32 or name.endswith(".step"), name
        assert torch.equal(got[name], value), name


def test_sampling_with_bf16_base_weights(bf16_runtime: BaseModelRuntime, tmp_path: Path) -> None:
    runtime = bf16_runtime
    runtime.create_adapter("policy", LoraSpec(rank=4, seed=4))
    randomize(runtime, "policy")
    runtime.save_state("policy", tmp_path / "sampler", include_optimizer=False)
    jobs = [
        SampleJob(PROMPT, num_samples=2, max_tokens=8, seed=11, stop_token_ids=[]),
        SampleJob(PROMPT[:5], num_samples=1, max_tokens=5, seed=12, stop_token_ids=[], temperature=0.0),
    ]
    first = runtime.sample(tmp_path / "sampler", jobs)
    again = runtime.sample(tmp_path / "sampler", jobs)
    for output, repeat, job in zip(first, again, jobs, strict=True):
        assert len(output.sequences) == job.num_samples
        for seq, same in zip(output.sequences, repeat.sequences, strict=True):
            assert seq.tokens == same.tokens  # seeded: reproducible
            assert len(seq.tokens) == job.max_tokens and seq.stop_reason == "length"
            assert all(0 <= t < runtime.vocab_size for t in seq.tokens)
            assert all(np.isfinite(lp) and lp <= 0 for lp in seq.logprobs)
            # The sampler's logprobs are the learner's, up to bfloat16 rounding of different batch shapes.
            tokens = np.array(job.prompt_tokens + seq.tokens)
            learner = runtime.forward_backward(
                "policy",
                [
                    DatumArrays(
                        tokens[:-1], {"target_tokens": tokens[1:], "weights": np.zeros(len(tokens) - 1)}
                    )
                ],
                "cross_entropy",
                None,
                backward=False,
            ).logprobs[0][-job.max_tokens :]
            if job.temperature == 1.0:
                np.testing.assert_allclose(seq.logprobs, learner, atol=BF16_SAMPLER_VS_LEARNER_ATOL)
    runtime.delete_adapter("policy")
