"""Figure 2: sampling throughput of the engine (concurrent SDK requests, batched by the engine) vs
sequential `model.generate()` with a KV cache on the same model and the same unmerged LoRA."""

from __future__ import annotations

import statistics
import time

import numpy as np
import tinker
import torch
from peft import PeftModel
from tinker import types
from transformers import GenerationConfig

from bench.report import Figure
from bench.training import load_lora_model
from bench.workload import BenchModel, Settings, token_sequences
from tinkerrpc_server.local.stack import LocalEngine

SAMPLING_GOAL = 4.0


def _engine_round(
    sampling_client: tinker.SamplingClient, prompts: list[np.ndarray], new_tokens: int, seed: int
) -> tuple[int, float]:
    """All prompts submitted at once (as a rollout loop does); returns (generated tokens, seconds)."""
    # stop=[] turns every stop off: each request generates exactly new_tokens, like the baseline.
    params = [
        types.SamplingParams(
            max_tokens=new_tokens, temperature=1.0, top_k=-1, top_p=1.0, stop=[], seed=seed + i
        )
        for i in range(len(prompts))
    ]
    started = time.perf_counter()
    futures = [
        sampling_client.sample(
            prompt=types.ModelInput.from_ints(prompt.tolist()), num_samples=1, sampling_params=p
        )
        for prompt, p in zip(prompts, params, strict=True)
    ]
    generated = sum(len(seq.tokens) for f in futures for seq in f.result().sequences)
    return generated, time.perf_counter() - started


def baseline_generation_config(new_tokens: int, pad_token_id: int) -> GenerationConfig:
    """Plain ancestral sampling of exactly `new_tokens`: explicit, as generate() would otherwise apply
    top_k=50 and stop at EOS."""
    return GenerationConfig(
        max_new_tokens=new_tokens,
        do_sample=True,
        temperature=1.0,
        top_k=0,
        top_p=1.0,
        use_cache=True,
        eos_token_id=None,
        pad_token_id=pad_token_id,
    )


def generate_round(
    model: PeftModel, prompts: list[np.ndarray], config: GenerationConfig
) -> tuple[int, float]:
    """One `generate()` per prompt, one after another: how a plain script samples a group."""
    started = time.perf_counter()
    generated = 0
    with torch.no_grad():
        for prompt in prompts:
            ids = torch.from_numpy(prompt).unsqueeze(0)
            out = model.generate(input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config)
            generated += out.shape[1] - ids.shape[1]
    return generated, time.perf_counter() - started


def measure(settings: Settings, engine: LocalEngine, model: BenchModel) -> list[Figure]:
    baseline_model = load_lora_model(model, settings.lora_rank)
    vocab_size = int(baseline_model.get_output_embeddings().weight.shape[0])
    low, high = settings.sample_prompt_tokens
    prompts = token_sequences(settings.sample_requests, low, high, vocab_size, seed=2)
    config = baseline_generation_config(
        settings.sample_new_tokens, int(baseline_model.config.pad_token_id or 0)
    )

    training_client = (
        engine.service_client()
        .create_lora_training_client(model.base_model, rank=settings.lora_rank, seed=0)
        .result()
    )
    sampling_client = training_client.save_weights_and_get_sampling_client("bench-sampler").result()
    _engine_round(sampling_client, prompts[:2], 2, seed=0)
    generate_round(baseline_model, prompts[:1], GenerationConfig(**{**config.to_dict(), "max_new_tokens": 2}))
    ours_rates, baseline_rates = [], []
    stats_before = engine.stats()
    for round_index in range(settings.sample_timed_rounds):
        generated, seconds = _engine_round(
            sampling_client, prompts, settings.sample_new_tokens, seed=100 * round_index
        )
        ours_rates.append(generated / seconds)
        generated, seconds = generate_round(baseline_model, prompts, config)
        baseline_rates.append(generated / seconds)
    stats_after = engine.stats()
    batches = stats_after["sample_batches"] - stats_before["sample_batches"]
    return [
        Figure(
            name="engine sampling throughput",
            ours=statistics.median(ours_rates),
            baseline=statistics.median(baseline_rates),
            unit="new tokens/s",
            goal=SAMPLING_GOAL,
            direction=">=",
            detail=(
                f"{settings.sample_requests} requests × {settings.sample_new_tokens} new tokens, prompts "
                f"{low}-{high} tokens, temperature 1, no top-k/top-p, LoRA r{settings.lora_rank} unmerged; "
                f"ours: concurrent SDK sample() calls; baseline: sequential generate() with KV cache; "
                f"median of {settings.sample_timed_rounds} rounds; the engine ran the "
                f"{settings.sample_timed_rounds * len(prompts)} timed requests in {batches} batches"
            ),
        )
    ]
