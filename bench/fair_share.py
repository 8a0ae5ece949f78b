"""A fair share across models on one engine: tiny-chat's p50 request latency while SmolLM2-135M samples
16 × 64 on the same engine, against its latency with the engine otherwise idle (engine/fair_share.py).

Both sides are the same engine and the same requests, in alternating rounds: a round of tiny-chat requests
sent one after another with nothing else running, then a round sent while a background thread keeps
SmolLM2 busy with rounds of 16 concurrent 64-token requests (as bench/sampling.py's equal requests).
The requests are the issue's 128-token tiny-chat completions; a shorter one waits relatively longer, since
the SmolLM2 step in progress when it arrives cannot be cut short (measured 2026-12-06 on a shared 2-core
machine: 64 tokens 1.6×, 16 tokens 3.9×, 0.11 vs 0.03 s)."""

from __future__ import annotations

import statistics
import threading
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tinker
from tinker import types
from transformers import AutoConfig

from bench.report import Figure, rounds
from bench.workload import token_sequences
from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.model_store import SMOLLM2_135M_INSTRUCT, TINY_CHAT, resolve_base_model

# The goal: tiny-chat's p50 latency while SmolLM2 runs 16 × 64 at most 2× its latency alone.
FAIR_SHARE_LATENCY_GOAL = 2.0


@dataclass(frozen=True)
class FairShareSizes:
    small_requests: int  # per round, one after another
    small_new_tokens: int
    small_prompt_tokens: int
    large_requests: int  # concurrent, per background round
    large_new_tokens: int
    rounds: int  # of each side, alternating


SIZES: dict[Literal["full", "short"], FairShareSizes] = {
    "full": FairShareSizes(8, 128, 16, 16, 64, 3),
    "short": FairShareSizes(2, 8, 8, 2, 4, 1),
}


def _params(new_tokens: int, seed: int) -> types.SamplingParams:
    # Every stop off: each request generates exactly new_tokens, whatever the model.
    return types.SamplingParams(max_tokens=new_tokens, temperature=1.0, stop=[], seed=seed)


def _small_round(client: tinker.SamplingClient, sizes: FairShareSizes, vocab: int, seed: int) -> list[float]:
    """Each request's latency, sent one after another."""
    prompts = token_sequences(
        sizes.small_requests, sizes.small_prompt_tokens, sizes.small_prompt_tokens, vocab, seed
    )
    latencies = []
    for index, prompt in enumerate(prompts):
        sent = time.perf_counter()
        response = client.sample(
            types.ModelInput.from_ints(prompt.tolist()), 1, _params(sizes.small_new_tokens, seed + index)
        ).result()
        latencies.append(time.perf_counter() - sent)
        assert len(response.sequences[0].tokens) == sizes.small_new_tokens
    return latencies


class _LargeLoad:
    """Rounds of concurrent large-model requests on a thread of their own, until stopped; the tokens
    they generated and the seconds they took."""

    def __init__(self, client: tinker.SamplingClient, sizes: FairShareSizes, vocab: int) -> None:
        self._client, self._sizes = client, sizes
        self._prompts = token_sequences(sizes.large_requests, 16, 48, vocab, seed=2)
        self._stop = threading.Event()
        self.generated = 0
        self.seconds = 0.0
        self._thread = threading.Thread(target=self._run, name="bench-large-load")

    def __enter__(self) -> _LargeLoad:
        self._thread.start()
        return self

    def __exit__(self, *_: object) -> None:
        self._stop.set()
        self._thread.join()

    def _run(self) -> None:
        started = time.perf_counter()
        while not self._stop.is_set():
            futures = [
                self._client.sample(
                    types.ModelInput.from_ints(prompt.tolist()), 1, _params(self._sizes.large_new_tokens, i)
                )
                for i, prompt in enumerate(self._prompts)
            ]
            self.generated += sum(len(seq.tokens) for f in futures for seq in f.result().sequences)
        self.seconds = time.perf_counter() - started


def _decoding(engine: LocalEngine, since: dict[str, int]) -> None:
    """Wait until the large model's batch has decoded a few steps."""
    deadline = time.monotonic() + 600
    while engine.stats()["decode_steps"] - since["decode_steps"] < 3:
        if time.monotonic() > deadline:
            raise TimeoutError("the large model's batch never started decoding")
        time.sleep(0.05)


def measure(mode: Literal["full", "short"], engine: LocalEngine, model_dir: Path) -> list[Figure]:
    sizes = SIZES[mode]
    small_vocab, large_vocab = (
        int(AutoConfig.from_pretrained(resolve_base_model(name, model_dir)).vocab_size)
        for name in (TINY_CHAT, SMOLLM2_135M_INSTRUCT)
    )
    service = engine.service_client()
    small = service.create_sampling_client(base_model=TINY_CHAT).result()
    large = service.create_sampling_client(base_model=SMOLLM2_135M_INSTRUCT).result()
    _small_round(small, sizes, small_vocab, seed=1)  # loads tiny-chat
    large.sample(types.ModelInput.from_ints([1, 2, 3]), 1, _params(2, 0)).result()  # loads SmolLM2
    alone: list[list[float]] = []
    during: list[list[float]] = []
    large_rates = []
    turns_before = engine.stats()["sample_turns_to_other_models"]
    for round_index in range(sizes.rounds):
        alone.append(_small_round(small, sizes, small_vocab, seed=100 * round_index))
        with _LargeLoad(large, sizes, large_vocab) as load:
            _decoding(engine, engine.stats())
            during.append(_small_round(small, sizes, small_vocab, seed=100 * round_index))
        large_rates.append(load.generated / load.seconds)
    turns = engine.stats()["sample_turns_to_other_models"] - turns_before
    return [
        Figure(
            name="fair share: tiny-chat p50 latency while SmolLM2 samples",
            ours=statistics.median(t for r in during for t in r),
            baseline=statistics.median(t for r in alone for t in r),
            unit="s",
            goal=FAIR_SHARE_LATENCY_GOAL,
            direction="<=",
            rounds=rounds([statistics.median(r) for r in during], [statistics.median(r) for r in alone]),
            detail=(
                f"{sizes.small_requests} tiny-chat requests per round, one after another, each 1 sample of "
                f"{sizes.small_new_tokens} new tokens from a {sizes.small_prompt_tokens}-token prompt; ours: "
                f"while SmolLM2-135M-Instruct decodes rounds of {sizes.large_requests} concurrent "
                f"{sizes.large_new_tokens}-token requests on the same engine (its throughput meanwhile "
                f"{statistics.median(large_rates):.1f} new tokens/s, medians of the rounds; {turns} turns "
                f"went from SmolLM2's batch to tiny-chat's mid-batch); baseline: the same requests with the "
                f"engine otherwise idle; {sizes.rounds} alternating rounds, a round's value its p50"
            ),
        )
    ]
