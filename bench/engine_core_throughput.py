"""`python -m bench.engine_core_throughput [--short] [--threads N]`: the engine's compute core alone
(BaseModelRuntime, in process, no HTTP) against plain transformers+PEFT on the same model and data.

Prints training tokens/s (bucketed runtime vs a padded micro-batch loop) and sampling new tokens/s
(one batched `sample()` over concurrent prompts vs sequential `generate()`), measured in one run.
"""

from __future__ import annotations

import argparse
import os
import statistics
import tempfile
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import torch

from bench.sampling import baseline_generation_config, generate_round
from bench.training import PaddedLoopTrainer, load_lora_model
from bench.workload import FULL, SHORT, prepare_model, token_sequences
from tinkerrpc_server.engine.runtime import BaseModelRuntime, DatumArrays, LoraSpec, SampleJob
from tinkerrpc_server.model_store import default_model_dir


def _rate(tokens: int, run: Callable[[], None], repeats: int) -> float:
    """Median tokens/s over `repeats` timed runs after one warm-up run."""
    run()
    rates = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        rates.append(tokens / (time.perf_counter() - started))
    return statistics.median(rates)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--short", action="store_true", help="tiny model and data (seconds)")
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    parser.add_argument("--model-dir", type=Path, default=default_model_dir(os.environ))
    args = parser.parse_args()
    torch.set_num_threads(args.threads)
    settings = SHORT if args.short else FULL
    model = prepare_model(settings, args.model_dir)
    runtime = BaseModelRuntime(model.path)  # where load_lora_model puts the baseline (bench.workload)
    runtime.create_adapter("bench", LoraSpec(rank=settings.lora_rank, seed=0))
    baseline = load_lora_model(model, settings.lora_rank)
    pad_id = int(baseline.config.pad_token_id or 0)
    repeats = settings.train_timed_steps

    sequences = token_sequences(
        settings.train_sequences,
        settings.train_min_tokens,
        settings.train_max_tokens,
        runtime.vocab_size,
        seed=1,
    )
    data = [
        DatumArrays(s[:-1], {"target_tokens": s[1:], "weights": np.ones(len(s) - 1, np.float32)})
        for s in sequences
    ]
    train_tokens = sum(len(s) - 1 for s in sequences)

    def runtime_step() -> None:
        runtime.forward_backward("bench", data, "cross_entropy", None, backward=True)
        runtime.optim_step("bench", 1e-4, 0.9, 0.95, 1e-12, 0.0, 0.0)

    padded = PaddedLoopTrainer(baseline, settings.baseline_micro_batch, pad_id)
    train_ours = _rate(train_tokens, runtime_step, repeats)
    train_base = _rate(train_tokens, lambda: padded.step(sequences), repeats)

    low, high = settings.sample_prompt_tokens
    prompts = token_sequences(settings.sample_requests, low, high, runtime.vocab_size, seed=2)
    new_tokens = settings.sample_new_tokens
    with tempfile.TemporaryDirectory() as work:
        weights_dir = Path(work) / "sampler"
        runtime.save_state("bench", weights_dir, include_optimizer=False)
        jobs = [
            SampleJob(p.tolist(), num_samples=1, max_tokens=new_tokens, seed=i, stop_token_ids=[])
            for i, p in enumerate(prompts)
        ]
        sample_tokens = len(prompts) * new_tokens
        sample_ours = _rate(sample_tokens, lambda: runtime.sample(weights_dir, jobs), repeats)
    config = baseline_generation_config(new_tokens, pad_id)
    sample_base = _rate(sample_tokens, lambda: generate_round(baseline, prompts, config), repeats)

    params = sum(p.numel() for p in baseline.get_base_model().parameters())
    print(
        f"model {params / 1e6:.1f} M params, LoRA r{settings.lora_rank} (attn+mlp+unembed), "
        f"{args.threads} threads, median of {repeats} runs"
    )
    print(
        f"training  {settings.train_sequences} seqs of {settings.train_min_tokens}-{settings.train_max_tokens} "
        f"tokens: runtime {train_ours:8.0f} tok/s | padded PEFT loop (micro-batch "
        f"{settings.baseline_micro_batch}) {train_base:8.0f} tok/s | {train_ours / train_base:.2f}x"
    )
    print(
        f"sampling  {len(prompts)} prompts x {new_tokens} new tokens: runtime sample() {sample_ours:8.0f} tok/s | "
        f"sequential generate() {sample_base:8.0f} tok/s | {sample_ours / sample_base:.2f}x"
    )


if __name__ == "__main__":
    main()
