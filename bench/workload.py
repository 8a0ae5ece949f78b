"""Run settings (full / short), the benchmark model, and the deterministic data every comparison shares."""

from __future__ import annotations

import os
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import numpy as np
import torch

from tinkerrpc_server.engine.runtime import resolve_placement
from tinkerrpc_server.model_store import TINY_CHAT, TinyModelShape, build_tiny_model, resolve_base_model
from tinkerrpc_server.settings import ENGINE_DEVICE_ENV

# ~20 M parameters: a Qwen3 of the tiny-chat recipe, big enough that compute (not Python) dominates a step.
BENCH_MODEL_NAME = "bench-qwen3-20m"
BENCH_MODEL_SHAPE = TinyModelShape(
    hidden_size=512, num_layers=6, num_heads=8, num_kv_heads=4, head_dim=64, intermediate_size=1536
)


@dataclass(frozen=True)
class Settings:
    mode: Literal["full", "short"]
    # Model of the compute-bound figures (training, sampling, MFU): a model of `model_shape` built under
    # the model dir as `model_name`, or the model store's built-in `model_name` when the shape is None.
    model_name: str
    model_shape: TinyModelShape | None
    lora_rank: int
    # Training throughput: one batch of sequences with input lengths uniform in [min, max].
    train_sequences: int
    train_min_tokens: int
    train_max_tokens: int
    train_timed_steps: int
    # Sequences per padded micro-batch of the transformers+PEFT baseline loop.
    baseline_micro_batch: int
    # Sampling throughput: concurrent requests × new tokens each.
    sample_requests: int
    sample_new_tokens: int
    sample_prompt_tokens: tuple[int, int]
    sample_timed_rounds: int
    # Stack and sidecar overhead: steps / calls timed per side (medians are reported).
    overhead_steps: int
    overhead_group_size: int
    overhead_completion_tokens: int
    sidecar_calls: int
    # Serialization: completion tokens in the Train request.
    serialization_tokens: int
    serialization_repeats: int
    # Memory: the demo's SFT / RL step caps (short: SFT only; a random model gives RL nothing to train).
    demo_sft_max_steps: int
    demo_rl_max_steps: int
    # ART's flow vs the seed's backend: alternating rounds of each (short: none; tests/art runs both flows).
    art_rounds: int
    # Machine matmul FLOP/s measurement.
    matmul_sizes: tuple[int, ...]
    matmul_repeats: int


FULL = Settings(
    mode="full",
    model_name=BENCH_MODEL_NAME,
    model_shape=BENCH_MODEL_SHAPE,
    lora_rank=32,
    train_sequences=64,
    train_min_tokens=32,
    train_max_tokens=512,
    train_timed_steps=2,
    baseline_micro_batch=16,
    sample_requests=16,
    sample_new_tokens=64,
    sample_prompt_tokens=(16, 48),
    sample_timed_rounds=2,
    overhead_steps=20,
    overhead_group_size=8,
    overhead_completion_tokens=16,
    sidecar_calls=20,
    serialization_tokens=1_000_000,
    serialization_repeats=3,
    demo_sft_max_steps=150,
    demo_rl_max_steps=40,
    art_rounds=5,
    matmul_sizes=(1024, 2048),
    matmul_repeats=5,
)

SHORT = Settings(
    mode="short",
    model_name=TINY_CHAT,
    model_shape=None,
    lora_rank=8,
    train_sequences=8,
    train_min_tokens=8,
    train_max_tokens=64,
    train_timed_steps=1,
    baseline_micro_batch=4,
    sample_requests=4,
    sample_new_tokens=8,
    sample_prompt_tokens=(8, 16),
    sample_timed_rounds=1,
    overhead_steps=3,
    overhead_group_size=4,
    overhead_completion_tokens=8,
    sidecar_calls=3,
    serialization_tokens=20_000,
    serialization_repeats=1,
    demo_sft_max_steps=2,
    demo_rl_max_steps=0,
    art_rounds=0,
    matmul_sizes=(256,),
    matmul_repeats=3,
)


def baseline_placement() -> tuple[torch.device, torch.dtype]:
    """Where the in-process baselines compute: the device and base-weight dtype of the run's engines
    (`python -m bench --device` sets the engines' variable; bf16 base weights on CUDA, as the engine)."""
    return resolve_placement(os.environ.get(ENGINE_DEVICE_ENV))


@dataclass(frozen=True)
class BenchModel:
    """`base_model` is what the engine is asked for; `path` is the HF directory the baselines load."""

    base_model: str
    path: Path


def prepare_model(settings: Settings, model_dir: Path) -> BenchModel:
    """Build (once; cached under model_dir) the model of the compute-bound figures."""
    name = settings.model_name
    if settings.model_shape is None:
        return BenchModel(name, resolve_base_model(name, model_dir))
    # Named under the model dir, which the bench's engines are started with (they load names only).
    return BenchModel(name, build_tiny_model(model_dir / name, settings.model_shape))


def token_sequences(
    count: int, min_tokens: int, max_tokens: int, vocab_size: int, seed: int
) -> list[np.ndarray]:
    """`count` random token sequences with lengths uniform in [min_tokens, max_tokens]."""
    rng = np.random.default_rng(seed)
    lengths = rng.integers(min_tokens, max_tokens + 1, size=count)
    return [rng.integers(0, vocab_size, size=int(n), dtype=np.int64) for n in lengths]
