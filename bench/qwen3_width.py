"""The training figures (throughput vs the padded transformers+PEFT loop, MFU) and the equal-requests
sampling figure again, on a model of Qwen3-0.6B's width: the model store's built-in
tinkerrpc/qwen3-0.6b-width (hidden 1024, 16 query / 8 KV heads of 128, MLP 3072, a tied 151,936-token
vocabulary, 4 layers, random weights). There the matmuls, the unembedding's above all, rather than
Python make up a step. Same code as bench/training.py and bench/sampling.py; own sizes and goals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Literal

from bench import sampling, training
from bench.report import Figure, on_model
from bench.workload import FULL, SHORT, Settings, prepare_model
from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.model_store import QWEN3_0_6B_WIDTH, QWEN3_VOCAB_SIZE, TINY_MODEL_SHAPES, TinyModelShape

LABEL = "Qwen3-0.6B width"
# The short run checks the harness in seconds: a 64-wide, one-layer stand-in with the same vocabulary.
SHORT_STAND_IN = "bench-qwen3-vocab-stand-in"
SHORT_STAND_IN_SHAPE = TinyModelShape(
    64, 1, 4, 2, 16, 192, vocab_size=QWEN3_VOCAB_SIZE, tie_word_embeddings=True, saved_dtype="bfloat16"
)

# A token costs ~0.9 GFLOP of training here (~10× the 20 M model's): one batch of 16 sequences (~1,700
# tokens) and 16 short generations keep the three figures to ~2-3 minutes on 2 quiet cores. Fewer
# requests would measure a CPU matmul quirk more than batching: a decode step's [8 × 1024]·[1024 ×
# 151,936] unembedding takes ~3× the time of one row's (memory-bound) there, [16 × …] ~2.4×.
SETTINGS: dict[Literal["full", "short"], Settings] = {
    "full": replace(
        FULL,
        model_name=QWEN3_0_6B_WIDTH,
        model_shape=None,
        train_sequences=16,
        train_min_tokens=16,
        train_max_tokens=192,
        baseline_micro_batch=8,
        sample_requests=16,
        sample_new_tokens=16,
        sample_prompt_tokens=(8, 16),
    ),
    "short": replace(SHORT, model_name=SHORT_STAND_IN, model_shape=SHORT_STAND_IN_SHAPE),
}

# The goals at this width, by the name each figure has at the 20 M model's.
GOALS = {
    "engine training throughput": 1.5,
    "training MFU (6·P·tokens/s ÷ matmul peak)": 0.4,
    "engine sampling throughput": 4.0,
}


def measure(
    mode: Literal["full", "short"],
    engine: LocalEngine,
    model_dir: Path,
    measure_peak_matmul: Callable[[], tuple[float, int]],
) -> list[Figure]:
    settings = SETTINGS[mode]
    model = prepare_model(settings, model_dir)
    shape = settings.model_shape or TINY_MODEL_SHAPES[settings.model_name]
    about = (
        f"; model {settings.model_name}: hidden {shape.hidden_size}, {shape.num_heads}/{shape.num_kv_heads} "
        f"heads of {shape.head_dim}, MLP {shape.intermediate_size}, {shape.num_layers} layers, tied "
        f"{shape.vocab_size:,}-token vocabulary"
    )
    figures = [
        *training.measure(settings, engine, model, measure_peak_matmul),
        *sampling.measure(settings, engine, model, staggered=False, shared_prompts=False),
    ]
    return on_model(figures, LABEL, GOALS, about)
