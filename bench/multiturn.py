"""Merged multi-turn datums: one RL step on a group of tool-using trajectories, trained as the service
builds it (datums.rl_batch: turns that continue one another merge into one datum) vs one datum per sampled
turn (rl_batch's merge_turns=False, its diagnostic switch), both sent to the same engine through the
tinker SDK in the same run. Figures: tokens processed, and Train time (datums built + forward_backward +
optim_step)."""

from __future__ import annotations

import statistics
import time
from dataclasses import dataclass
from pathlib import Path

import numpy as np
from tinker import types

from bench.report import Figure, rounds
from bench.workload import BenchModel, Settings
from tinkerrpc.v1 import trainer_service_pb2, types_pb2
from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.service.datums import rl_batch
from tinkerrpc_server.service.rendering import ChatCodec, ChatCodecs

TOKENS_GOAL = 1 / 3
TIME_GOAL = 1 / 2.5
ADAM = types.AdamParams(learning_rate=1e-5)
# The bench model has no recommended renderer of its own; it is a Qwen3 of the tiny-chat recipe.
RENDERER = "qwen3"


@dataclass(frozen=True)
class Group:
    trajectories: int
    turns: int
    completion_tokens: int
    tool_result_tokens: int  # tool result and the next assistant header, between two completions
    first_prompt_tokens: int
    timed_steps: int


SIZES = {
    # Four trajectories keep the per-turn side near 20 s a step on the 2-core bench machine; the ratios
    # hardly depend on the count (each trajectory is its own datum or datums either way).
    "full": Group(
        trajectories=4,
        turns=8,
        completion_tokens=32,
        tool_result_tokens=40,
        first_prompt_tokens=64,
        timed_steps=2,
    ),
    "short": Group(
        trajectories=2,
        turns=3,
        completion_tokens=8,
        tool_result_tokens=6,
        first_prompt_tokens=12,
        timed_steps=1,
    ),
}


def tool_using_group(codec: ChatCodec, size: Group, seed: int) -> trainer_service_pb2.TrainRequest:
    """A Train request of one group: each trajectory's turn k + 1 prompt is turn k's prompt and completion,
    then a tool result (random tokens, the lengths of `size`). Rewards spread, so no group is dropped."""
    rng = np.random.default_rng(seed)
    vocab = codec.tokenizer.vocab_size
    request = trainer_service_pb2.TrainRequest(model="bench")
    group = request.groups.add()
    for t in range(size.trajectories):
        trajectory = group.trajectories.add(reward=float(t % 3))
        prompt = rng.integers(0, vocab, size.first_prompt_tokens).tolist()
        for _ in range(size.turns):
            completion = rng.integers(0, vocab, size.completion_tokens).tolist()
            trajectory.turns.add(
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                completion_logprobs=rng.uniform(-8.0, -6.0, size.completion_tokens).tolist(),
            )
            prompt = prompt + completion + rng.integers(0, vocab, size.tool_result_tokens).tolist()
    request.loss.function = types_pb2.LOSS_FUNCTION_IMPORTANCE_SAMPLING
    return request


def measure(settings: Settings, engine: LocalEngine, model: BenchModel, model_dir: Path) -> list[Figure]:
    size = SIZES[settings.mode]
    codec = ChatCodecs(model_dir, allow_remote_tokenizers=False).get(model.base_model, RENDERER)
    request = tool_using_group(codec, size, seed=5)
    service = engine.service_client()
    client = service.create_lora_training_client(model.base_model, rank=settings.lora_rank, seed=0).result()

    def step(merge: bool) -> tuple[float, int]:
        started = time.perf_counter()
        batch = rl_batch(request, 0, codec, merge_turns=merge)
        forward_backward = client.forward_backward(batch.datums, "importance_sampling")
        optim = client.optim_step(ADAM)
        forward_backward.result()
        optim.result()
        return time.perf_counter() - started, batch.total_tokens

    step(True)  # the first step pays for the optimizer's state: warmed on the cheaper side
    # Interleaved, so a change in machine load during the run hits both sides alike.
    merged_seconds, per_turn_seconds = [], []
    for _ in range(size.timed_steps):
        seconds, merged_tokens = step(True)
        merged_seconds.append(seconds)
        seconds, per_turn_tokens = step(False)
        per_turn_seconds.append(seconds)
    shape = (
        f"{size.trajectories} trajectories × {size.turns} turns of {size.completion_tokens} completion tokens, "
        f"{size.tool_result_tokens}-token tool results between, {size.first_prompt_tokens}-token first prompt"
    )
    tokens = Figure(
        name="multi-turn RL step, tokens processed",
        ours=merged_tokens,
        baseline=per_turn_tokens,
        unit="tokens",
        goal=TOKENS_GOAL,
        direction="<=",
        rounds=rounds([merged_tokens], [per_turn_tokens]),
        detail=f"{shape}; merged: one datum per trajectory; baseline: one datum per sampled turn",
    )
    train_time = Figure(
        name="multi-turn RL step, Train time",
        ours=statistics.median(merged_seconds),
        baseline=statistics.median(per_turn_seconds),
        unit="s",
        goal=TIME_GOAL,
        direction="<=",
        rounds=rounds(merged_seconds, per_turn_seconds),
        detail=(
            f"{shape}; datums built + forward_backward + optim_step (importance sampling, LoRA "
            f"r{settings.lora_rank}) through the tinker SDK on one engine, median of {size.timed_steps} "
            "interleaved steps per side"
        ),
    )
    return [tokens, train_time]
