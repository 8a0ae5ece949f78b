"""`tinkerrpc demo --recipe yes-no-maybe`: SFT then RL on the random tiny model.

SFT first teaches the model to answer the task's prompts with exactly one of yes / no / maybe (answers
drawn uniformly, so RL starts near reward 0.75); RL then rewards maybe = 1.0, no = 0.75, yes = 0.5,
anything else 0 until the mean reward reaches the target, confirmed on a fresh batch."""

from __future__ import annotations

import random
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

import tinkerrpc
from tinkerrpc_server.model_store import TINY_CHAT
from tinkerrpc_server.recipes.base import (
    Session,
    Stack,
    StepRecord,
    curve_plot,
    has_no_advantage,
    open_session,
)
from tinkerrpc_server.recipes.yes_no_maybe.task import ANSWERS, answer_of, prompts, reward_of

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletion


@dataclass
class YesNoMaybeSummary:
    passed: bool
    final_mean_reward: float
    target_reward: float
    sft_steps: int
    rl_steps: int
    wall_seconds: float
    final_policy_version: int
    # What the agent asked of the sidecar: chat completions (n choices each) and tokens generated.
    chat_completions: int
    completion_tokens: int
    steps: list[StepRecord] = field(default_factory=list)


@dataclass
class YesNoMaybeRecipe:
    out_dir: Path
    target_reward: float = 0.9
    sft_batch: int = 32
    sft_learning_rate: float = 1e-2
    sft_max_steps: int = 200
    sft_eval_every: int = 10
    sft_valid_target: float = 0.95
    rl_prompts_per_step: int = 8
    rl_samples_per_prompt: int = 8
    rl_learning_rate: float = 4e-3
    rl_max_steps: int = 40
    # The task needs no reasoning: with this renderer the empty think block is part of the prompt,
    # so an answer is two tokens (word + <|im_end|>) instead of eight for SFT and RL to shape.
    renderer: str = "qwen3_disable_thinking"
    max_tokens: int = 4
    lora_rank: int = 8
    seed: int = 0
    data_dir: Path | None = None

    async def run(self, stack: Stack) -> YesNoMaybeSummary:
        records: list[StepRecord] = []
        async with open_session(
            stack, "demo", TINY_CHAT, lora_rank=self.lora_rank, renderer=self.renderer, seed=self.seed
        ) as session:
            sft_steps = await self._sft(session, records)
            rl_steps, final_reward = await self._rl(session, records)
            version = (await session.model.info()).policy_version
        return YesNoMaybeSummary(
            passed=final_reward >= self.target_reward,
            final_mean_reward=final_reward,
            target_reward=self.target_reward,
            sft_steps=sft_steps,
            rl_steps=rl_steps,
            wall_seconds=0.0,  # the whole run's, set once the stack has stopped
            final_policy_version=version,
            chat_completions=session.chat_completions,
            completion_tokens=session.completion_tokens,
            steps=records,
        )

    async def _sft(self, session: Session, records: list[StepRecord]) -> int:
        """Supervised steps until the sampled answers are valid often enough; the steps taken."""
        rng = random.Random(self.seed)
        every = prompts()
        eval_prompts = rng.sample(every, self.rl_prompts_per_step)
        for step in range(1, self.sft_max_steps + 1):
            batch = [
                [tinkerrpc.Message.user(p), tinkerrpc.Message.assistant(rng.choice(ANSWERS))]
                for p in rng.choices(every, k=self.sft_batch)
            ]
            result = await session.model.train_supervised(batch, learning_rate=self.sft_learning_rate)
            if step % self.sft_eval_every and step != self.sft_max_steps:
                continue
            valid = await self._valid_rate(session, eval_prompts, seed=10_000 + step)
            record = StepRecord.of_train("sft", step, result, mean_reward=0.0, valid_rate=valid)
            records.append(record)
            record.print()
            if valid >= self.sft_valid_target:
                return step
        return self.sft_max_steps

    async def _valid_rate(self, session: Session, eval_prompts: list[str], seed: int) -> float:
        rollouts = await session.rollouts(eval_prompts, self.rl_samples_per_prompt, self.max_tokens, seed)
        answers = [a for _, completion in rollouts for a in _answers(completion)]
        return sum(a in ANSWERS for a in answers) / len(answers)

    async def _rl(self, session: Session, records: list[StepRecord]) -> tuple[int, float]:
        """RL steps until the mean reward reaches the target on a fresh batch too; the steps trained and
        the final evaluation's mean reward."""
        rng = random.Random(self.seed + 1)
        every = prompts()
        trained = 0
        for _ in range(self.rl_max_steps):
            rollouts = await session.rollouts(
                rng.sample(every, self.rl_prompts_per_step),
                self.rl_samples_per_prompt,
                self.max_tokens,
                seed=rng.randrange(2**31),
            )
            # Each choice carries its token ids, logprobs and policy version: it trains token-exact.
            groups = [
                tinkerrpc.TrajectoryGroup(
                    [
                        tinkerrpc.Trajectory.from_openai(
                            messages, completion, reward_of(answer), choice_index=i
                        )
                        for i, answer in enumerate(_answers(completion))
                    ]
                )
                for messages, completion in rollouts
            ]
            rewards = [t.reward for g in groups for t in g.trajectories]
            mean_reward = sum(rewards) / len(rewards)
            valid = sum(r > 0 for r in rewards) / len(rewards)
            if has_no_advantage(groups):
                print(
                    f"rl batch: rewards equal within every group (mean {mean_reward:.3f}); resampling",
                    flush=True,
                )
                continue
            result = await session.model.train(
                groups, loss="importance_sampling", learning_rate=self.rl_learning_rate
            )
            trained += 1
            record = StepRecord.of_train("rl", trained, result, mean_reward=mean_reward, valid_rate=valid)
            records.append(record)
            record.print()
            if mean_reward >= self.target_reward:
                # Confirm on a fresh batch from the new version before declaring success.
                final = await self._evaluate(session, seed=rng.randrange(2**31))
                print(f"eval at v{result.policy_version}: mean reward {final:.3f}", flush=True)
                if final >= self.target_reward:
                    return trained, final
        return trained, await self._evaluate(session, seed=rng.randrange(2**31))

    async def _evaluate(self, session: Session, seed: int) -> float:
        eval_prompts = random.Random(seed).sample(prompts(), self.rl_prompts_per_step)
        rollouts = await session.rollouts(eval_prompts, self.rl_samples_per_prompt, self.max_tokens, seed)
        rewards = [reward_of(a) for _, completion in rollouts for a in _answers(completion)]
        return sum(rewards) / len(rewards)

    def plot(self, summary: YesNoMaybeSummary) -> None:
        title = f"tinkerrpc demo: yes / no / maybe ({summary.wall_seconds:.0f} s)"
        with curve_plot(self.out_dir / "reward_curve.png", title, "policy version", "lower right") as ax:
            sft = [r for r in summary.steps if r.phase == "sft"]
            rl = [r for r in summary.steps if r.phase == "rl"]
            ax.plot(
                [r.policy_version for r in sft], [r.valid_rate for r in sft], "o-", label="SFT: valid answers"
            )
            ax.plot(
                [r.policy_version for r in rl], [r.mean_reward for r in rl], "o-", label="RL: mean reward"
            )
            ax.axhline(
                summary.target_reward, color="gray", linestyle="--", label=f"target {summary.target_reward}"
            )

    def verdict(self, summary: YesNoMaybeSummary) -> str:
        return (
            f"{'PASSED' if summary.passed else 'FAILED'}: final mean reward {summary.final_mean_reward:.3f} "
            f"(target {summary.target_reward}) after {summary.sft_steps} SFT + {summary.rl_steps} RL steps in "
            f"{summary.wall_seconds:.1f} s ({summary.chat_completions} chat completions through the sidecar, "
            f"{summary.completion_tokens} tokens); outputs in {self.out_dir}"
        )


def _answers(completion: ChatCompletion) -> list[str]:
    return [answer_of(choice.message.content or "") for choice in completion.choices]
