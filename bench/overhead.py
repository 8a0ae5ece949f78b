"""Figures 3 and 4, on the demo's model (tiny-chat), where the stack's per-step cost shows most:
- a Train RPC (tinkerrpc client → gRPC → service → tinker SDK → engine) vs the same datums stepped through
  the tinker SDK directly against an engine process of its own, started like serve's (same model dir,
  same threads; serve's engine key never leaves serve) (forward_backward + optim_step + sampler save);
- a chat completion through the openai client + sidecar vs the same Sample RPC through the tinkerrpc client.
"""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable
from pathlib import Path

import numpy as np
import openai
import tinker
from tinker import types

import tinkerrpc
from bench.report import Figure, rounds
from bench.workload import Settings, token_sequences
from tinkerrpc_server.local.stack import LocalEngine, LocalSidecar, LocalStack
from tinkerrpc_server.model_store import TINY_CHAT

STACK_GOAL = 1.15
SIDECAR_GOAL = 1.2
PROMPT_TOKENS = (24, 40)
LEARNING_RATE = 1e-4
LORA_RANK = 8
CHAT = [{"role": "user", "content": "Respond with yes, no or maybe."}]


def _groups(settings: Settings, vocab_size: int, seed: int) -> list[tinkerrpc.TrajectoryGroup]:
    """One group of sampled-looking trajectories (distinct rewards, so the group trains)."""
    rng = np.random.default_rng(seed)
    prompts = token_sequences(settings.overhead_group_size, *PROMPT_TOKENS, vocab_size, seed=seed)
    completions = token_sequences(
        settings.overhead_group_size,
        settings.overhead_completion_tokens,
        settings.overhead_completion_tokens,
        vocab_size,
        seed=seed + 1,
    )
    trajectories = [
        tinkerrpc.Trajectory(
            turns=[
                tinkerrpc.SampledTurn(
                    prompt_token_ids=prompt.tolist(),
                    completion_token_ids=completion.tolist(),
                    logprobs=(-rng.random(len(completion)) - 5).astype(np.float32).tolist(),
                    policy_version=0,
                )
            ],
            reward=float(i % 3),
        )
        for i, (prompt, completion) in enumerate(zip(prompts, completions, strict=True))
    ]
    return [tinkerrpc.TrajectoryGroup(trajectories)]


def tinker_datums(groups: list[tinkerrpc.TrajectoryGroup]) -> list[types.Datum]:
    """The importance-sampling datums a Train RPC makes of these groups (DESIGN.md's layout): input =
    all tokens[:-1], target = all tokens[1:], sampled logprobs and advantages 0 on prompt positions,
    advantage = reward − group mean on every completion token."""
    data = []
    for group in groups:
        mean = sum(group.rewards) / len(group.rewards)
        for trajectory in group.trajectories:
            for turn in trajectory.turns:
                tokens = [*turn.prompt_token_ids, *turn.completion_token_ids]
                on_prompt = len(turn.prompt_token_ids) - 1
                completion = len(turn.completion_token_ids)
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(tokens[:-1]),
                        loss_fn_inputs={
                            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
                            "logprobs": np.asarray([0.0] * on_prompt + list(turn.logprobs), dtype=np.float32),
                            "advantages": np.asarray(
                                [0.0] * on_prompt + [trajectory.reward - mean] * completion, dtype=np.float32
                            ),
                        },
                    )
                )
    return data


class DirectTrainer:
    """The step a user of the tinker SDK runs by hand with the same guarantees as a Train RPC on serve's
    defaults: forward_backward, optim_step, sampler weights for the next rollouts and the full state to
    resume from after a crash (--checkpoint-every 1), all submitted before waiting."""

    def __init__(self, client: tinker.TrainingClient) -> None:
        self.client = client
        self.version = 0

    def step(self, groups: list[tinkerrpc.TrajectoryGroup]) -> float:
        self.version += 1
        forward_backward = self.client.forward_backward(tinker_datums(groups), "importance_sampling")
        optim = self.client.optim_step(types.AdamParams(learning_rate=LEARNING_RATE))
        sampler = self.client.save_weights_for_sampler(f"direct-{self.version:06d}")
        state = self.client.save_state(f"direct-state-{self.version:06d}")
        loss = float(forward_backward.result().metrics["loss:sum"])
        optim.result()
        sampler.result()
        state.result()
        return loss


def _timed(call: Callable[[], object]) -> tuple[float, object]:
    started = time.perf_counter()
    value = call()
    return time.perf_counter() - started, value


def stack_figure(settings: Settings, engine: LocalEngine, client: tinkerrpc.Client) -> Figure:
    model = client.create_model("bench-stack", base_model=TINY_CHAT, lora_rank=LORA_RANK, seed=0)
    vocab_size = model.info().vocab_size
    service = engine.service_client()
    direct = DirectTrainer(service.create_lora_training_client(TINY_CHAT, rank=LORA_RANK, seed=0).result())
    rpc_ms, direct_ms = [], []
    first_losses: tuple[float, float] | None = None
    warmup = 2
    for step in range(warmup + settings.overhead_steps):
        groups = _groups(settings, vocab_size, seed=step)
        rpc_time, result = _timed(lambda g=groups: model.train(g, learning_rate=LEARNING_RATE))
        direct_time, direct_loss = _timed(lambda g=groups: direct.step(g))
        if first_losses is None:
            first_losses = (result.metrics.loss, float(direct_loss))  # type: ignore[attr-defined]
        if step >= warmup:
            rpc_ms.append(rpc_time * 1000)
            direct_ms.append(direct_time * 1000)
    assert first_losses is not None
    # Same seed, same datums, same start: the two first steps must compute the same loss.
    if not np.isclose(first_losses[0], first_losses[1], rtol=1e-4, atol=1e-4):
        raise AssertionError(f"Train RPC and direct SDK steps differ: losses {first_losses}")
    datums = tinker_datums(_groups(settings, vocab_size, seed=0))
    return Figure(
        name="stack overhead: Train RPC vs tinker SDK",
        ours=statistics.median(rpc_ms),
        baseline=statistics.median(direct_ms),
        unit="ms/step",
        goal=STACK_GOAL,
        direction="<=",
        rounds=rounds(rpc_ms, direct_ms),
        detail=(
            f"tiny-chat, LoRA r{LORA_RANK}, one group of {len(datums)} trajectories "
            f"({sum(d.model_input.length for d in datums)} tokens), importance sampling; median of "
            f"{settings.overhead_steps} interleaved steps after {warmup} warm-up; first-step losses "
            f"{first_losses[0]:.4f} vs {first_losses[1]:.4f}. Both sides save sampler weights and the full "
            f"state every step (serve's default --checkpoint-every 1 on the embedded engine); the RPC adds "
            f"validation, datum building and its SQLite commit, and after its response deletes what "
            f"retention pruned and reads the new checkpoints' sizes (overlapping the next direct step)"
        ),
    )


def sidecar_figure(settings: Settings, client: tinkerrpc.Client, sidecar_url: str) -> Figure:
    model = client.create_model("bench-sidecar", base_model=TINY_CHAT, lora_rank=LORA_RANK, seed=0)
    openai_client = openai.OpenAI(base_url=sidecar_url, api_key="unused", max_retries=0)
    max_tokens = settings.overhead_completion_tokens
    chat_ms, rpc_ms = [], []
    warmup = 2
    for call in range(warmup + settings.sidecar_calls):
        chat_time, completion = _timed(
            lambda c=call: openai_client.chat.completions.create(
                model=model.name,
                messages=CHAT,
                max_tokens=max_tokens,
                temperature=1.0,
                seed=c,  # type: ignore[arg-type]
            )
        )
        # The Sample RPC the sidecar makes for that request (it always asks for token texts).
        rpc_time, samples = _timed(
            lambda c=call: model.sample(
                CHAT, n=1, max_tokens=max_tokens, temperature=1.0, seed=c, return_token_texts=True
            )
        )
        if completion.choices[0].message.content != samples[0].message.content:  # type: ignore[attr-defined,index]
            raise AssertionError("the sidecar and the Sample RPC sampled different completions for one seed")
        if call >= warmup:
            chat_ms.append(chat_time * 1000)
            rpc_ms.append(rpc_time * 1000)
    return Figure(
        name="sidecar overhead: chat completion vs Sample RPC",
        ours=statistics.median(chat_ms),
        baseline=statistics.median(rpc_ms),
        unit="ms/call",
        goal=SIDECAR_GOAL,
        direction="<=",
        rounds=rounds(chat_ms, rpc_ms),
        detail=(
            f"tiny-chat, one user message, max_tokens {max_tokens}, same seed per pair (same completion "
            f"checked); median of {settings.sidecar_calls} interleaved calls after {warmup} warm-up"
        ),
    )


def measure(settings: Settings, work_dir: Path, model_dir: Path) -> list[Figure]:
    data_dir = work_dir / "stack"
    with (
        LocalStack(data_dir, work_dir / "stack.log", extra_args=("--model-dir", str(model_dir))) as stack,
        LocalEngine(work_dir / "direct-engine", model_dir, work_dir / "direct-engine.log") as engine,
        tinkerrpc.Client(stack.target) as client,
    ):
        figures = [stack_figure(settings, engine, client)]
        with LocalSidecar(stack.target, work_dir / "sidecar.log") as sidecar:
            figures.append(sidecar_figure(settings, client, sidecar.openai_base_url))
    return figures
