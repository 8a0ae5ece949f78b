"""Sampling figures of the engine, through concurrent SDK calls:

1. throughput of one round of equal requests vs sequential `model.generate()` with a KV cache on the
   same model and the same unmerged LoRA;
2. staggered arrivals (requests arriving over ~2 s on a seeded schedule, different lengths):
   throughput vs sequential `generate()`, and median request latency vs gather-then-run batching, the
   engine's batching before continuous batching (the same engine built with bench/gather_then_run.py's
   strategy, in the same run);
3. shared prompts: one request for n samples of a long prompt vs n separate requests for one sample
   each on the gather-then-run engine (which prefills every row on its own).
"""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass

import numpy as np
import tinker
import torch
from peft import PeftModel
from tinker import types
from transformers import GenerationConfig

from bench.gather_then_run import gather_then_run_engine
from bench.machine import synchronize
from bench.report import Figure, rounds
from bench.training import load_lora_model
from bench.workload import BenchModel, Settings, token_sequences
from tinkerrpc_server.local.stack import LocalEngine

SAMPLING_GOAL = 5.0
STAGGERED_THROUGHPUT_GOAL = 6.0
STAGGERED_LATENCY_GOAL = 0.6
SHARED_PROMPT_GOAL = 0.35


@dataclass(frozen=True)
class SamplingSizes:
    staggered_requests: int
    arrival_seconds: float
    staggered_new_tokens: tuple[int, int]
    staggered_prompt_tokens: tuple[int, int]
    staggered_rounds: int  # of each side, alternating: one round's p50 swings by ~15% on a 2-core machine
    shared_samples: int
    shared_prompt_tokens: int
    shared_new_tokens: int
    shared_timed_rounds: int


SIZES = {
    "full": SamplingSizes(32, 2.0, (16, 128), (16, 48), 5, 8, 512, 32, 5),
    "short": SamplingSizes(6, 0.3, (4, 12), (8, 16), 1, 4, 32, 4, 1),
}


def _params(new_tokens: int, seed: int) -> types.SamplingParams:
    # stop=[] turns every stop off: each request generates exactly new_tokens, like the baseline.
    return types.SamplingParams(
        max_tokens=new_tokens, temperature=1.0, top_k=-1, top_p=1.0, stop=[], seed=seed
    )


def _engine_round(
    sampling_client: tinker.SamplingClient, prompts: list[np.ndarray], new_tokens: int, seed: int
) -> tuple[int, float]:
    """All prompts submitted at once (as a rollout loop does); returns (generated tokens, seconds)."""
    started = time.perf_counter()
    futures = [
        sampling_client.sample(
            prompt=types.ModelInput.from_ints(prompt.tolist()),
            num_samples=1,
            sampling_params=_params(new_tokens, seed + i),
        )
        for i, prompt in enumerate(prompts)
    ]
    generated = sum(len(seq.tokens) for f in futures for seq in f.result().sequences)
    return generated, time.perf_counter() - started


def _staggered_round(
    sampling_client: tinker.SamplingClient,
    prompts: list[np.ndarray],
    new_tokens: list[int],
    arrivals: list[float],
) -> tuple[int, float, list[float]]:
    """Each request sent at its arrival time (seconds from the start) and waited for on its own thread;
    returns (generated tokens, seconds from the first send to the last answer, each request's latency)."""
    latencies = [0.0] * len(prompts)
    generated = [0] * len(prompts)
    started = time.perf_counter()

    def send(index: int) -> None:
        time.sleep(max(0.0, started + arrivals[index] - time.perf_counter()))
        sent = time.perf_counter()
        response = sampling_client.sample(
            prompt=types.ModelInput.from_ints(prompts[index].tolist()),
            num_samples=1,
            sampling_params=_params(new_tokens[index], 1000 + index),
        ).result()
        latencies[index] = time.perf_counter() - sent
        generated[index] = sum(len(seq.tokens) for seq in response.sequences)

    threads = [threading.Thread(target=send, args=(i,)) for i in range(len(prompts))]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    return sum(generated), time.perf_counter() - started, latencies


def _shared_round(
    sampling_client: tinker.SamplingClient, prompt: list[int], samples: int, new_tokens: int, together: bool
) -> float:
    """Seconds for `samples` completions of `prompt`: one request (together) or one request each."""
    model_input = types.ModelInput.from_ints(prompt)
    started = time.perf_counter()
    if together:
        futures = [sampling_client.sample(model_input, samples, _params(new_tokens, 7))]
    else:
        futures = [sampling_client.sample(model_input, 1, _params(new_tokens, 7 + i)) for i in range(samples)]
    assert sum(len(f.result().sequences) for f in futures) == samples
    return time.perf_counter() - started


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
            ids = torch.from_numpy(prompt).unsqueeze(0).to(model.device)
            out = model.generate(  # type: ignore[no-untyped-call]
                input_ids=ids, attention_mask=torch.ones_like(ids), generation_config=config
            )
            generated += out.shape[1] - ids.shape[1]
    synchronize(model.device)
    return generated, time.perf_counter() - started


def _sampling_client(engine: LocalEngine, model: BenchModel, rank: int) -> tinker.SamplingClient:
    training_client = (
        engine.service_client().create_lora_training_client(model.base_model, rank=rank, seed=0).result()
    )
    return training_client.save_weights_and_get_sampling_client().result()


def _gather_then_run_engine(engine: LocalEngine) -> LocalEngine:
    """Another engine like `engine`, with continuous batching and shared prompts switched off."""
    work = engine.data_dir.parent / "engine-gather-then-run"
    return gather_then_run_engine(work / "data", engine.model_dir, work / "engine.log")


def measure(
    settings: Settings,
    engine: LocalEngine,
    model: BenchModel,
    *,
    sizes: SamplingSizes | None = None,
    staggered: bool = True,
    shared_prompts: bool = True,
) -> list[Figure]:
    """The equal-requests figure, then the staggered-arrivals and shared-prompts ones unless switched off
    (bench/qwen3_width.py, bench/real_model.py); `sizes` of the latter two default to SIZES[mode]."""
    sizes = sizes or SIZES[settings.mode]
    baseline_model = load_lora_model(model, settings.lora_rank)
    vocab_size = int(baseline_model.get_output_embeddings().weight.shape[0])
    pad_token_id = int(baseline_model.config.pad_token_id or 0)
    sampling_client = _sampling_client(engine, model, settings.lora_rank)
    _engine_round(sampling_client, token_sequences(2, 4, 8, vocab_size, seed=1), 2, seed=0)
    generate_round(
        baseline_model,
        token_sequences(1, 4, 8, vocab_size, seed=1),
        baseline_generation_config(2, pad_token_id),
    )
    equal_requests = _equal_requests(
        settings, engine, sampling_client, baseline_model, vocab_size, pad_token_id
    )
    figures = [equal_requests]
    if not (staggered or shared_prompts):
        return figures
    with _gather_then_run_engine(engine) as gather_engine:
        gather_client = _sampling_client(gather_engine, model, settings.lora_rank)
        _engine_round(gather_client, token_sequences(2, 4, 8, vocab_size, seed=1), 2, seed=0)
        if staggered:
            figures += _staggered(
                sizes, sampling_client, gather_client, baseline_model, vocab_size, pad_token_id
            )
        if shared_prompts:
            figures.append(_shared_prompts(sizes, sampling_client, gather_client, vocab_size))
    return figures


def _equal_requests(
    settings: Settings,
    engine: LocalEngine,
    sampling_client: tinker.SamplingClient,
    baseline_model: PeftModel,
    vocab_size: int,
    pad_token_id: int,
) -> Figure:
    low, high = settings.sample_prompt_tokens
    prompts = token_sequences(settings.sample_requests, low, high, vocab_size, seed=2)
    config = baseline_generation_config(settings.sample_new_tokens, pad_token_id)
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
    return Figure(
        name="engine sampling throughput",
        ours=statistics.median(ours_rates),
        baseline=statistics.median(baseline_rates),
        unit="new tokens/s",
        goal=SAMPLING_GOAL,
        direction=">=",
        rounds=rounds(ours_rates, baseline_rates),
        detail=(
            f"{settings.sample_requests} requests × {settings.sample_new_tokens} new tokens, prompts "
            f"{low}-{high} tokens, temperature 1, no top-k/top-p, LoRA r{settings.lora_rank} unmerged; "
            f"ours: concurrent SDK sample() calls; baseline: sequential generate() with KV cache; "
            f"median of {settings.sample_timed_rounds} rounds; the engine ran the "
            f"{settings.sample_timed_rounds * len(prompts)} timed requests in {batches} batches"
        ),
    )


def _staggered(
    sizes: SamplingSizes,
    sampling_client: tinker.SamplingClient,
    gather_client: tinker.SamplingClient,
    baseline_model: PeftModel,
    vocab_size: int,
    pad_token_id: int,
) -> list[Figure]:
    count = sizes.staggered_requests
    prompts = token_sequences(count, *sizes.staggered_prompt_tokens, vocab_size, seed=3)
    rng = np.random.default_rng(4)
    arrivals = sorted(float(t) for t in rng.uniform(0, sizes.arrival_seconds, size=count))
    low, high = sizes.staggered_new_tokens
    new_tokens = [int(n) for n in rng.integers(low, high + 1, size=count)]
    rates: list[float] = []
    latencies: list[list[float]] = []  # each round's, of each side
    gather_latencies: list[list[float]] = []
    for _ in range(sizes.staggered_rounds):
        generated, seconds, round_latencies = _staggered_round(sampling_client, prompts, new_tokens, arrivals)
        rates.append(generated / seconds)
        latencies.append(round_latencies)
        gather_latencies.append(_staggered_round(gather_client, prompts, new_tokens, arrivals)[2])
    baseline_generated, baseline_seconds = 0, 0.0
    for prompt, tokens in zip(prompts, new_tokens, strict=True):
        one_generated, one_seconds = generate_round(
            baseline_model, [prompt], baseline_generation_config(tokens, pad_token_id)
        )
        baseline_generated += one_generated
        baseline_seconds += one_seconds
    schedule = (
        f"{count} requests arriving over {sizes.arrival_seconds:g} s (seeded uniform schedule), max_tokens "
        f"{low}-{high}, prompts {sizes.staggered_prompt_tokens[0]}-{sizes.staggered_prompt_tokens[1]} "
        f"tokens, each a concurrent SDK sample() call"
    )
    baseline_rate = baseline_generated / baseline_seconds
    return [
        Figure(
            name="sampling, staggered arrivals: throughput",
            ours=statistics.median(rates),
            baseline=baseline_rate,
            unit="new tokens/s",
            goal=STAGGERED_THROUGHPUT_GOAL,
            direction=">=",
            rounds=rounds(rates, [baseline_rate]),
            detail=(
                f"{schedule}; ours: continuous batching, from the first send to the last answer, median of "
                f"{sizes.staggered_rounds} rounds; baseline: the same requests one after another with generate()"
            ),
        ),
        Figure(
            name="sampling, staggered arrivals: p50 latency",
            ours=statistics.median(t for one_round in latencies for t in one_round),
            baseline=statistics.median(t for one_round in gather_latencies for t in one_round),
            unit="s",
            goal=STAGGERED_LATENCY_GOAL,
            direction="<=",
            rounds=rounds(
                [statistics.median(r) for r in latencies], [statistics.median(r) for r in gather_latencies]
            ),
            detail=(
                f"{schedule}; median request latency over {sizes.staggered_rounds} rounds of each side, "
                f"alternating (a round's value: its p50); baseline: the same engine code with bench/gather_then_run.py's strategy, "
                f"the engine's batching before continuous batching (requests join only "
                f"an empty batch, whose rows all compute until its last one stops, and are answered then)"
            ),
        ),
    ]


def _shared_prompts(
    sizes: SamplingSizes,
    sampling_client: tinker.SamplingClient,
    gather_client: tinker.SamplingClient,
    vocab_size: int,
) -> Figure:
    prompt = token_sequences(1, sizes.shared_prompt_tokens, sizes.shared_prompt_tokens, vocab_size, seed=5)[0]
    args = (prompt.tolist(), sizes.shared_samples, sizes.shared_new_tokens)
    ours, baseline = [], []
    for _ in range(sizes.shared_timed_rounds):
        ours.append(_shared_round(sampling_client, *args, together=True))
        baseline.append(_shared_round(gather_client, *args, together=False))
    return Figure(
        name="sampling, shared prompts",
        ours=statistics.median(ours),
        baseline=statistics.median(baseline),
        unit="s",
        goal=SHARED_PROMPT_GOAL,
        direction="<=",
        rounds=rounds(ours, baseline),
        detail=(
            f"n = {sizes.shared_samples} samples of one {sizes.shared_prompt_tokens}-token prompt, "
            f"{sizes.shared_new_tokens} new tokens each; ours: one request (the prompt prefilled once); "
            f"baseline: {sizes.shared_samples} concurrent single-sample requests (seeds as the rows of "
            f"ours) on the gather-then-run engine (every row prefilled on its own); median "
            f"of {sizes.shared_timed_rounds} rounds"
        ),
    )
