"""ART 0.5.23's PipelineTrainer through tinkerrpc.art's TinkerRPCBackend, on the task and sizes of the
committed ART flows (tests/art/art_flows.py: yes-no-maybe on tiny-chat, the same SFT warm-up through
`model.train_sft`, 8 prompts x 8 rollouts a step, CISPO at the same learning rate). Run by
bench/art_0_5_23.py in a process whose PYTHONPATH puts the rewritten 0.5.23 ahead of the venv's 0.5.18.

PipelineTrainer drives everything after the warm-up: its rollout workers sample under
`backend.adapter_lease`, its training stage calls `backend.train` with every keyword it passes
(optimizer_save_interval among them), and its eval stage scores each new version under
`backend.exact_adapter_lease`, checking every Choice's policy_token_spans. The eval (8 seeded prompts x 8
rollouts of that exact version) is the reward per step printed and the stopping rule: the trainer is
stopped once an eval's mean reward reaches the target, or after MAX_RL_STEPS.

Usage: art_0_5_23_flow.py ART_PATH GRPC_TARGET [KL_PENALTY_COEF]; prints a line per event and the summary JSON last.
"""

from __future__ import annotations

import asyncio
import importlib.metadata
import itertools
import json
import random
import sys
import time
from collections import defaultdict
from pathlib import Path
from typing import Any

import art
from art.pipeline_trainer import PipelineRuntimeConfig, PipelineTrainer

from tinkerrpc.art import TinkerRPCBackend

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests" / "art"))
from art_flows import (
    BASE_MODEL,
    MAX_RL_STEPS,
    PROMPTS,
    RL_LEARNING_RATE,
    SFT_BATCH_SIZE,
    SFT_LEARNING_RATE,
    SFT_STEPS,
    TARGET_REWARD,
    mean_reward,
    rollout,
    trainable_model,
    warm_up_trajectories,
)

GROUPS_PER_STEP = 8
ROLLOUTS_PER_GROUP = 8


def log(message: str) -> None:
    print(message, flush=True)


async def group_of(client: Any, model: art.TrainableModel, prompt: str) -> art.TrajectoryGroup:
    """The committed flows' rollouts of one prompt, all at once (the sidecar draws them as one Sample)."""
    return art.TrajectoryGroup(
        await asyncio.gather(*(rollout(client, model, prompt) for _ in range(ROLLOUTS_PER_GROUP)))
    )


class Run:
    """What the pipeline did, by policy version: the rewards of the rollouts each version sampled and
    of its eval."""

    def __init__(self) -> None:
        self.started = time.perf_counter()
        self.rollout_rewards: dict[int, list[float]] = defaultdict(list)
        self.evals: dict[int, float] = {}
        self.eval_seconds: dict[int, float] = {}
        self.seconds_to_target: float | None = None
        self.version_at_target: int | None = None
        self.trainer: PipelineTrainer[Any, None] | None = None

    async def rollout_group(
        self, model: art.TrainableModel, scenario: dict[str, str], _config: None
    ) -> art.TrajectoryGroup:
        # Under the trainer's adapter lease the inference name is pinned to name@version.
        version = int(model.get_inference_name().rsplit("@", 1)[1])
        group = await group_of(model.openai_client(), model, scenario["prompt"])
        self.rollout_rewards[version].extend(t.reward for t in group.trajectories)
        return group

    async def evaluate(
        self, model: art.TrainableModel, step: int, _config: None
    ) -> list[art.TrajectoryGroup]:
        assert model.get_inference_name() == f"{model.name}@{step}", "the exact lease pins the version"
        client = model.openai_client()
        prompts = random.Random(step).sample(PROMPTS, GROUPS_PER_STEP)
        groups = list(await asyncio.gather(*(group_of(client, model, p) for p in prompts)))
        reward = mean_reward(groups)
        self.evals[step] = reward
        self.eval_seconds[step] = time.perf_counter() - self.started
        sampled = self.rollout_rewards.get(step, [])
        sampled_mean = f"{sum(sampled) / len(sampled):.3f} ({len(sampled)})" if sampled else "-"
        log(
            f"version {step}: eval reward {reward:.3f}, rollouts it sampled {sampled_mean}, t={self.eval_seconds[step]:.1f}s"
        )
        if reward >= TARGET_REWARD and self.seconds_to_target is None:
            self.seconds_to_target = self.eval_seconds[step]
            self.version_at_target = step
            assert self.trainer is not None
            self.trainer.request_stop()
        return groups


async def main(art_path: str, target: str, kl_penalty_coef: str = "0") -> dict[str, Any]:
    version = importlib.metadata.version("openpipe-art")
    assert version == "0.5.23", f"the venv's ART {version} was imported"
    log(f"ART {version} from {Path(art.__file__).parent}")
    run = Run()
    backend = TinkerRPCBackend(target, path=art_path)
    model = trainable_model(run_name="yes-no-maybe-001")  # 0.5.23 requires a run name
    await model.register(backend)
    rng = random.Random(0)
    sft_started = time.perf_counter()
    await model.train_sft(
        warm_up_trajectories(rng, SFT_BATCH_SIZE * SFT_STEPS),
        config=art.TrainSFTConfig(learning_rate=SFT_LEARNING_RATE, batch_size=SFT_BATCH_SIZE),
    )
    sft_seconds = time.perf_counter() - sft_started
    sft_version = await model.get_step()
    assert sft_version == 1, "ART's SFT ends in one checkpoint"
    log(f"SFT warm-up: {SFT_STEPS} optimizer steps, one version, in {sft_seconds:.1f}s")

    scenarios = (
        {"prompt": p}
        for p in itertools.chain.from_iterable(rng.sample(PROMPTS, len(PROMPTS)) for _ in itertools.count())
    )
    run.trainer = PipelineTrainer(
        model=model,
        backend=backend,
        rollout_fn=run.rollout_group,
        scenarios=scenarios,
        config=None,
        eval_fn=run.evaluate,
        pipeline=PipelineRuntimeConfig(
            num_rollout_workers=GROUPS_PER_STEP,
            min_batch_size=GROUPS_PER_STEP,
            max_batch_size=GROUPS_PER_STEP,
        ),
        learning_rate=RL_LEARNING_RATE,
        loss_fn="cispo",
        kl_penalty_coef=float(kl_penalty_coef),
        max_steps=MAX_RL_STEPS,
        eval_every_n_steps=1,
        eval_at_start=True,
        log_interval_seconds=30.0,
    )
    rl_started = time.perf_counter()
    await run.trainer.train(handle_signals=False)
    rl_seconds = time.perf_counter() - rl_started
    final_step = await model.get_step()
    await backend.close()
    versions = sorted(set(run.rollout_rewards) | set(run.evals))
    steps = [
        {
            "version": v,
            "rollout_reward": (sum(r) / len(r)) if (r := run.rollout_rewards.get(v)) else None,
            "rollouts": len(run.rollout_rewards.get(v, [])),
            "eval_reward": run.evals.get(v),
            "eval_at_seconds": run.eval_seconds.get(v),
        }
        for v in versions
    ]
    return {
        "base_model": BASE_MODEL,
        "target_reward": TARGET_REWARD,
        "sft_steps": SFT_STEPS,
        "sft_seconds": sft_seconds,
        "kl_penalty_coef": float(kl_penalty_coef),
        # RL steps trained before the version whose eval reached the target; the pipeline trains on while
        # that eval runs, so rl_steps (all it trained) is larger.
        "rl_steps_to_target": None if run.version_at_target is None else run.version_at_target - sft_version,
        "rl_steps": final_step - sft_version,
        "rl_seconds": rl_seconds,
        "seconds_to_target": run.seconds_to_target,
        "reached_target": run.seconds_to_target is not None,
        "best_eval_reward": max(run.evals.values(), default=None),
        "steps": steps,
    }


if __name__ == "__main__":
    print(json.dumps(asyncio.run(main(*sys.argv[1:]))))
