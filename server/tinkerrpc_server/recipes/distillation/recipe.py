"""`tinkerrpc demo --recipe distillation`: on-policy distillation with no reward function. The teacher is
the default demo's result, SmolLM2-135M-Instruct trained by `--recipe arithmetic` in the same run; the
student is a fresh SmolLM2 LoRA. Each step the student samples replies to training problems through the
sidecar, every reply's reward is 0, and Train's distillation option has the teacher score the student's
tokens: each token's advantage is the teacher's logprob minus the student's (tinker-cookbook's on-policy
distillation). Nothing checks an answer while it trains; the held-out problems (greedy exact match,
never trained on) measure what the student learnt. The run passes when the student's held-out accuracy
gained the target over its step 0."""

from __future__ import annotations

import random
import time
from dataclasses import dataclass, field
from pathlib import Path

import tinkerrpc
from tinkerrpc_server.recipes.arithmetic.recipe import (
    ArithmeticRecipe,
    HeldOutRecord,
    choice_texts,
    train_with_held_out,
)
from tinkerrpc_server.recipes.arithmetic.task import BASE_MODEL, Problem, split_problems
from tinkerrpc_server.recipes.base import Session, Stack, check_settings, curve_plot


@dataclass
class DistillationStep:
    step: int
    policy_version: int
    # Mean over the step's sampled tokens of student − teacher logprob (TrainMetrics.teacher_kl).
    teacher_kl: float
    # Replies in the batch that are right: measured for the curve, never trained on.
    batch_correct: float
    loss: float
    step_seconds: float


@dataclass
class DistillationSummary:
    passed: bool
    teacher_model: str
    teacher_version: int
    teacher_accuracy: float
    teacher_seconds: float
    step0_accuracy: float
    final_accuracy: float
    gain: float
    target_gain: float
    steps: int
    train_seconds: float
    wall_seconds: float
    chat_completions: int
    completion_tokens: int
    history: list[DistillationStep] = field(default_factory=list)
    held_out: list[HeldOutRecord] = field(default_factory=list)


@dataclass
class DistillationRecipe:
    out_dir: Path
    # Held-out exact-match accuracy the student must gain over its step 0 (absolute).
    target_gain: float = 0.2
    steps: int = 15
    # The teacher's RL steps (the arithmetic recipe's).
    teacher_steps: int = ArithmeticRecipe.steps
    prompts_per_step: int = 8
    samples_per_prompt: int = 4
    learning_rate: float = 1e-4
    lora_rank: int = 16
    max_tokens: int = ArithmeticRecipe.max_tokens
    eval_every: int = 5
    held_out_size: int = ArithmeticRecipe.held_out_size
    seed: int = 0
    data_dir: Path | None = None

    def __post_init__(self) -> None:
        checks = {
            "target_gain": 0 < self.target_gain <= 1,
            "steps": self.steps >= 1,
            "teacher_steps": self.teacher_steps >= 1,
            "prompts_per_step": self.prompts_per_step >= 1,
            "samples_per_prompt": self.samples_per_prompt >= 1,
            "learning_rate": self.learning_rate > 0,
            "lora_rank": self.lora_rank >= 1,
            "max_tokens": self.max_tokens >= 1,
            "eval_every": self.eval_every >= 1,
        }
        check_settings("distillation", self, checks)

    async def run(self, stack: Stack) -> DistillationSummary:
        """Train the teacher by the arithmetic recipe, then distil it into a fresh student."""
        teacher_started = time.monotonic()
        teacher_recipe = ArithmeticRecipe(
            out_dir=self.out_dir / "teacher", steps=self.teacher_steps, seed=self.seed, data_dir=self.data_dir
        )
        teacher = await teacher_recipe.run(stack)
        teacher_seconds = time.monotonic() - teacher_started
        teacher_recipe.out_dir.mkdir(parents=True, exist_ok=True)
        teacher_recipe.plot(teacher)
        async with tinkerrpc.AsyncClient(stack.target) as client:
            # The model the arithmetic recipe just made: its newest (a kept data dir holds older ones).
            teacher_model = max(
                (m for m in await client.list_models() if m.name.startswith("arithmetic-")),
                key=lambda m: m.create_time or 0,
            ).name
        print(
            f"teacher {teacher_model} v{teacher.final_policy_version}: held-out accuracy "
            f"{teacher.final_accuracy:.1%} after {self.teacher_steps} RL steps ({teacher_seconds:.0f} s)",
            flush=True,
        )
        distillation = tinkerrpc.Distillation(
            teacher=tinkerrpc.PolicyRef.version(teacher.final_policy_version, model=teacher_model)
        )
        split = split_problems(self.seed, self.held_out_size)
        rng = random.Random(self.seed + 2)
        run = await train_with_held_out(
            stack,
            "distilled",
            self,
            split,
            rng,
            lambda session, problems, step, seed, _: self._step(session, problems, step, seed, distillation),
        )
        session, history, held_out, train_seconds = run.session, run.records, run.held_out, run.train_seconds
        step0, final = held_out[0].accuracy, held_out[-1].accuracy
        return DistillationSummary(
            passed=final - step0 >= self.target_gain,
            teacher_model=teacher_model,
            teacher_version=teacher.final_policy_version,
            teacher_accuracy=teacher.final_accuracy,
            teacher_seconds=teacher_seconds,
            step0_accuracy=step0,
            final_accuracy=final,
            gain=final - step0,
            target_gain=self.target_gain,
            steps=self.steps,
            train_seconds=train_seconds,
            wall_seconds=0.0,  # the whole run's, set once the stack has stopped
            chat_completions=session.chat_completions,
            completion_tokens=session.completion_tokens,
            history=history,
            held_out=held_out,
        )

    async def _step(
        self,
        session: Session,
        problems: list[Problem],
        step: int,
        seed: int,
        distillation: tinkerrpc.Distillation,
    ) -> DistillationStep:
        """Sample the student, train every reply with reward 0 on the teacher's per-token advantages."""
        rollouts = await session.rollouts(
            [p.prompt for p in problems], self.samples_per_prompt, self.max_tokens, seed
        )
        groups = []
        correct = 0
        for problem, (messages, completion) in zip(problems, rollouts, strict=True):
            correct += sum(problem.is_correct(answer) for answer in choice_texts(completion))
            groups.append(
                tinkerrpc.TrajectoryGroup(
                    [
                        tinkerrpc.Trajectory.from_openai(messages, completion, 0.0, choice_index=i)
                        for i in range(len(completion.choices))
                    ]
                )
            )
        result = await session.model.train(
            groups, loss="importance_sampling", learning_rate=self.learning_rate, distillation=distillation
        )
        assert result.metrics.teacher_kl is not None, "a distillation step reports its teacher KL"
        record = DistillationStep(
            step=step,
            policy_version=result.policy_version,
            teacher_kl=result.metrics.teacher_kl,
            batch_correct=correct / (len(problems) * self.samples_per_prompt),
            loss=result.metrics.loss,
            step_seconds=result.metrics.step_seconds,
        )
        print(
            f"distil step {step:3d} | v{record.policy_version:<3d} | teacher KL {record.teacher_kl:7.3f} | "
            f"batch correct {record.batch_correct:6.1%} (not trained on) | loss {record.loss:9.3f} | "
            f"{record.step_seconds:.2f} s",
            flush=True,
        )
        return record

    def plot(self, summary: DistillationSummary) -> None:
        model = BASE_MODEL.split("/")[-1]
        title = f"demo --recipe distillation: {model}, {summary.train_seconds:.0f} s"
        with curve_plot(self.out_dir / "accuracy_curve.png", title, "distillation step", "upper left") as ax:
            ax.plot(
                [r.step for r in summary.history],
                [r.batch_correct for r in summary.history],
                ".-",
                alpha=0.6,
                label="training batch: correct (not trained on)",
            )
            ax.plot(
                [r.step for r in summary.held_out],
                [r.accuracy for r in summary.held_out],
                "o-",
                linewidth=2,
                label="student held-out: greedy exact match",
            )
            ax.axhline(summary.teacher_accuracy, color="green", linestyle=":", label="teacher held-out")
            ax.axhline(
                summary.step0_accuracy + summary.target_gain,
                color="gray",
                linestyle="--",
                label=f"step 0 + {summary.target_gain * 100:.0f} points",
            )

    def verdict(self, summary: DistillationSummary) -> str:
        return (
            f"{'PASSED' if summary.passed else 'FAILED'}: student held-out accuracy {summary.step0_accuracy:.1%} "
            f"at step 0 -> {summary.final_accuracy:.1%} after {summary.steps} distillation steps with no reward "
            f"({summary.gain:+.1%}, target {summary.target_gain:+.0%}; teacher {summary.teacher_accuracy:.1%}) in "
            f"{summary.train_seconds:.0f} s of distillation, {summary.wall_seconds:.0f} s in all (teacher "
            f"{summary.teacher_seconds:.0f} s); outputs in {self.out_dir}"
        )
