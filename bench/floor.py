"""Sampling against the machine's floor: the engine's decode rate at 1 row and at 16 rows, as a fraction
of the fastest this machine could possibly run the same work, measured in the same run.

The floor of a forward pass is the longer of reading what it reads at the machine's read bandwidth (every
weight once, plus the KV cache its rows attend over) and computing its FLOPs at the machine's matmul peak
(bench/machine.py, square matmuls). A workload's floor adds the passes it needs: the prompts' prefill,
then one decode step per new token, each over a longer context. Ours runs the same workload through the
tinker SDK on the engine's base model; both are given as decode steps per second (new tokens per row).

Each round of ours is paired with the floor measured beside it: the read bandwidth and matmul peak just
before and just after the round, the better of the two. On this virtual machine an idle minute's read
bandwidth ranged over 23-35 GB/s and one bench run saw 50, so a floor from a run's single best moment, set
beside ours at other moments, measured the host's drift as much as the engine. The figure is the median
of ours over the median of those floors; its range, each round's own fraction. Other load on the machine
slows both sides of a round, so only a quiet run's fractions count."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path
from typing import Literal

import tinker
import torch
from tinker import types
from transformers import AutoConfig, AutoModelForCausalLM

from bench.machine import synchronize
from bench.report import Figure, rounds
from bench.workload import token_sequences
from tinkerrpc_server.engine.compute.packing import huge_page_floats
from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.model_store import QWEN3_0_6B_WIDTH, SMOLLM2_135M_INSTRUCT, resolve_base_model

# The goal: sampling at >= 0.8 of the machine's floor, at 1 row and at 16 rows.
FLOOR_FRACTION_GOAL = 0.8

# The short run checks the harness on SmolLM2 alone.
MODELS: dict[Literal["full", "short"], dict[str, str]] = {
    "full": {"SmolLM2-135M": SMOLLM2_135M_INSTRUCT, "Qwen3-0.6B width": QWEN3_0_6B_WIDTH},
    "short": {"SmolLM2-135M": SMOLLM2_135M_INSTRUCT},
}


@dataclass(frozen=True)
class FloorSizes:
    rows: tuple[int, ...]  # concurrent one-sample requests of a workload
    prompt_tokens: int
    new_tokens: int
    rounds: int
    bandwidth_bytes: int  # of the tensor read to measure the read bandwidth: well beyond any cache
    bandwidth_repeats: int


SIZES: dict[Literal["full", "short"], FloorSizes] = {
    "full": FloorSizes((1, 16), 16, 64, 3, 1 << 29, 5),
    "short": FloorSizes((1, 2), 4, 4, 1, 1 << 24, 2),
}


def bandwidth_tensor(size_bytes: int, device: torch.device) -> torch.Tensor:
    """The float32 tensor of `size_bytes` that `read_bandwidth` sums, made once per run. On the CPU it lies
    on huge pages, as the engine's packed weights do: the sum reads 1.11x [1.03-2.13x] as fast there as
    on 4 KiB pages on this VM (20 rounds), and a floor must not be beaten by the memory it is set beside.
    Made once, so that no round's measurement has the OS find 512 MiB of 2 MiB pages anew."""
    if device.type == "cpu":
        return huge_page_floats(size_bytes // 4).fill_(1.0)
    return torch.ones(size_bytes // 4, device=device)


def read_bandwidth(data: torch.Tensor, repeats: int) -> float:
    """Bytes/s of summing `data`: the fastest of `repeats` timed reads (other load on the machine only
    ever slows one down)."""
    device = data.device
    size_bytes = data.numel() * data.element_size()
    data.sum()
    times = []
    for _ in range(repeats):
        synchronize(device)
        started = time.perf_counter()
        data.sum()
        synchronize(device)
        times.append(time.perf_counter() - started)
    return size_bytes / min(times)


@dataclass(frozen=True)
class StepCost:
    """What one row's forward of one token reads and computes, from the model's shapes."""

    matmul_params: int  # every layer's weights and the unembedding (the embedding lookup reads one row)
    weight_bytes: int
    kv_bytes_per_token: int  # the keys and values of one cached token of one row
    attention_flops_per_token: int  # one query over one cached token, every layer and head

    @staticmethod
    def of(model_path: Path, bytes_per_weight: int) -> StepCost:
        config = AutoConfig.from_pretrained(model_path)
        with torch.device("meta"):
            model = AutoModelForCausalLM.from_config(config)
        embedding = model.get_input_embeddings().weight.numel()
        params = (
            sum(p.numel() for p in model.parameters()) - embedding + config.vocab_size * config.hidden_size
        )
        head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
        layers = config.num_hidden_layers
        return StepCost(
            matmul_params=params,
            weight_bytes=params * bytes_per_weight,
            kv_bytes_per_token=2 * layers * config.num_key_value_heads * head_dim * bytes_per_weight,
            attention_flops_per_token=4 * layers * config.num_attention_heads * head_dim,
        )

    def pass_seconds(self, tokens: int, contexts: list[int], bandwidth: float, flops: float) -> float:
        """The floor of one forward of `tokens` new tokens over rows attending over `contexts` tokens."""
        read = self.weight_bytes + self.kv_bytes_per_token * sum(contexts)
        compute = 2 * self.matmul_params * tokens + self.attention_flops_per_token * sum(contexts)
        return max(read / bandwidth, compute / flops)

    def workload_seconds(self, rows: int, prompt: int, new: int, bandwidth: float, flops: float) -> float:
        """The floor of `rows` prompts of `prompt` tokens prefilled together, then `new` decode steps."""
        total = self.pass_seconds(rows * prompt, [prompt * (prompt + 1) // 2] * rows, bandwidth, flops)
        for step in range(new - 1):  # the prefill gave the first token's logits
            total += self.pass_seconds(rows, [prompt + step + 1] * rows, bandwidth, flops)
        return total


def _workload_seconds(
    client: tinker.SamplingClient, rows: int, sizes: FloorSizes, vocab: int, seed: int
) -> float:
    prompts = token_sequences(rows, sizes.prompt_tokens, sizes.prompt_tokens, vocab, seed)
    params = types.SamplingParams(max_tokens=sizes.new_tokens, temperature=1.0, stop=[], seed=seed)
    started = time.perf_counter()
    futures = [client.sample(types.ModelInput.from_ints(p.tolist()), 1, params) for p in prompts]
    assert all(len(f.result().sequences[0].tokens) == sizes.new_tokens for f in futures)
    return time.perf_counter() - started


def _spread(values: list[float], unit: float) -> str:
    return f"{min(values) / unit:.1f}-{max(values) / unit:.1f}"


def measure(
    mode: Literal["full", "short"],
    engine: LocalEngine,
    model_dir: Path,
    measure_peak_matmul: Callable[[], tuple[float, int]],
    device: torch.device,
    dtype: torch.dtype,
) -> list[Figure]:
    sizes = SIZES[mode]
    service = engine.service_client()

    bandwidth_data = bandwidth_tensor(sizes.bandwidth_bytes, device)

    def machine_rates() -> tuple[float, float]:
        return read_bandwidth(bandwidth_data, sizes.bandwidth_repeats), measure_peak_matmul()[0]

    figures = []
    for label, name in MODELS[mode].items():
        path = resolve_base_model(name, model_dir)
        cost = StepCost.of(path, torch.finfo(dtype).bits // 8)
        vocab = int(AutoConfig.from_pretrained(path).vocab_size)
        client = service.create_sampling_client(base_model=name).result()
        _workload_seconds(client, 1, sizes, vocab, seed=0)  # loads the model
        for rows in sizes.rows:
            ours, floors, bandwidths, peaks = [], [], [], []
            before = machine_rates()
            for round_index in range(sizes.rounds):
                seconds = _workload_seconds(client, rows, sizes, vocab, seed=1 + round_index)
                after = machine_rates()
                bandwidth, peak = max(before[0], after[0]), max(before[1], after[1])
                ours.append(sizes.new_tokens / seconds)
                floors.append(
                    sizes.new_tokens
                    / cost.workload_seconds(rows, sizes.prompt_tokens, sizes.new_tokens, bandwidth, peak)
                )
                bandwidths.append(bandwidth)
                peaks.append(peak)
                before = after
            figures.append(
                Figure(
                    name=f"sampling at the machine's floor, {rows} row{'s' if rows > 1 else ''} ({label})",
                    ours=statistics.median(ours),
                    baseline=statistics.median(floors),
                    unit="decode steps/s",
                    goal=FLOOR_FRACTION_GOAL,
                    direction=">=",
                    rounds=rounds(ours, floors),
                    detail=(
                        f"{rows} concurrent request(s) of 1 sample, {sizes.prompt_tokens}-token prompts, "
                        f"{sizes.new_tokens} new tokens, base model {name}; ours: through the tinker SDK, "
                        f"prefill included, {sizes.rounds} rounds; floor: the same passes at max(bytes read / "
                        f"read bandwidth, FLOPs / matmul peak), {cost.weight_bytes / 1e9:.3f} GB of weights "
                        f"and {2 * cost.matmul_params / 1e9:.3f} GFLOP per row and step, "
                        f"{cost.kv_bytes_per_token / 1024:.1f} KiB of KV per cached token, at the read "
                        f"bandwidth (torch sum of {sizes.bandwidth_bytes >> 20} MiB) and matmul peak measured "
                        f"just before and just after each round of ours, the better of the two: "
                        f"{_spread(bandwidths, 1e9)} GB/s and {_spread(peaks, 1e9)} GFLOP/s over the rounds"
                    ),
                )
            )
    return figures
