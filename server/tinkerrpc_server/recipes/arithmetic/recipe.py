"""`tinkerrpc demo --recipe arithmetic` (the default): RL alone, no SFT, on the pretrained
SmolLM2-135M-Instruct, reward 1 for exactly the line the prompt asks for ("3 + 4 = 7") and 0 otherwise.

It measures greedy exact-match accuracy on held-out problems, never trained on, before the first step
and every few steps; the run passes when held-out accuracy gained the target over step 0."""

from __future__ import annotations

import random
import time
from collections.abc import Awaitable, Callable, Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Generic, Protocol, TypeVar

import tinkerrpc
from tinkerrpc_server.recipes.arithmetic.task import BASE_MODEL, RENDERER, Problem, Split, split_problems
from tinkerrpc_server.recipes.base import (
    Session,
    Stack,
    StepRecord,
    check_settings,
    curve_plot,
    has_no_advantage,
    open_session,
)

if TYPE_CHECKING:
    from openai.types.chat import ChatCompletion


class _Versioned(Protocol):
    @property
    def policy_version(self) -> int: ...


RecordT = TypeVar("RecordT", bound=_Versioned)


@dataclass
class HeldOutRecord:
    step: int
    policy_version: int
    accuracy: float
    # Since the run's model was created: what a training budget is measured against.
    train_seconds: float


@dataclass
class ArithmeticSummary:
    passed: bool
    step0_accuracy: float
    final_accuracy: float
    gain: float
    target_gain: float
    rl_steps: int
    trained_steps: int
    train_seconds: float
    wall_seconds: float
    final_policy_version: int
    chat_completions: int
    completion_tokens: int
    steps: list[StepRecord] = field(default_factory=list)
    held_out: list[HeldOutRecord] = field(default_factory=list)


@dataclass
class ArithmeticRecipe:
    out_dir: Path
    # Held-out exact-match accuracy the run must gain over the pretrained model's (absolute).
    target_gain: float = 0.2
    steps: int = 15
    prompts_per_step: int = 4
    samples_per_prompt: int = 8
    learning_rate: float = 3e-4
    lora_rank: int = 16
    # A correct reply ("9 + 9 = 18") is 8 tokens and <|im_end|>; prose runs past this and scores 0.
    max_tokens: int = 12
    eval_every: int = 5
    held_out_size: int = 40
    seed: int = 0
    data_dir: Path | None = None

    def __post_init__(self) -> None:
        checks = {
            "target_gain": 0 < self.target_gain <= 1,
            "steps": self.steps >= 1,
            "prompts_per_step": self.prompts_per_step >= 1,
            # A group of one has no mean to be better than.
            "samples_per_prompt": self.samples_per_prompt >= 2,
            "learning_rate": self.learning_rate > 0,
            "lora_rank": self.lora_rank >= 1,
            "max_tokens": self.max_tokens >= 1,
            "eval_every": self.eval_every >= 1,
        }
        check_settings("arithmetic", self, checks)

    async def run(self, stack: Stack) -> ArithmeticSummary:
        """Measure the pretrained model on the held-out problems, then RL on the training problems,
        measuring again every `eval_every` steps."""
        split = split_problems(self.seed, self.held_out_size)
        rng = random.Random(self.seed + 1)
        run = await train_with_held_out(stack, "arithmetic", self, split, rng, self._step)
        session, records, held_out, version = run.session, run.records, run.held_out, run.final_version
        train_seconds = run.train_seconds
        step0, final = held_out[0].accuracy, held_out[-1].accuracy
        return ArithmeticSummary(
            passed=final - step0 >= self.target_gain,
            step0_accuracy=step0,
            final_accuracy=final,
            gain=final - step0,
            target_gain=self.target_gain,
            rl_steps=self.steps,
            trained_steps=version,
            train_seconds=train_seconds,
            wall_seconds=0.0,  # the whole run's, set once the stack has stopped
            final_policy_version=version,
            chat_completions=session.chat_completions,
            completion_tokens=session.completion_tokens,
            steps=records,
            held_out=held_out,
        )

    async def _step(
        self, session: Session, problems: list[Problem], step: int, seed: int, version: int
    ) -> StepRecord:
        """Sample a group per problem, score each reply, train on the groups; `version` is the policy
        version before the step."""
        rollouts = await session.rollouts(
            [p.prompt for p in problems], self.samples_per_prompt, self.max_tokens, seed
        )
        groups = []
        in_format = 0
        for problem, (messages, completion) in zip(problems, rollouts, strict=True):
            answers = choice_texts(completion)
            in_format += sum(problem.is_in_format(a) for a in answers)
            groups.append(
                tinkerrpc.TrajectoryGroup(
                    [
                        tinkerrpc.Trajectory.from_openai(
                            messages, completion, float(problem.is_correct(a)), choice_index=i
                        )
                        for i, a in enumerate(answers)
                    ]
                )
            )
        rewards = [t.reward for g in groups for t in g.trajectories]
        mean_reward = sum(rewards) / len(rewards)
        # Replies in the asked-for format, right or wrong.
        valid_rate = in_format / len(rewards)
        if has_no_advantage(groups):
            # No group has an advantage to learn from: the step samples and scores, and trains nothing.
            print(
                f"rl step {step:3d} | reward {mean_reward:.3f} | equal within every group: no update",
                flush=True,
            )
            return StepRecord(
                phase="rl",
                step=step,
                policy_version=version,
                mean_reward=mean_reward,
                valid_rate=valid_rate,
                loss=0.0,
                staleness_max=0,
                tokens_per_second=0.0,
                step_seconds=0.0,
            )
        result = await session.model.train(
            groups, loss="importance_sampling", learning_rate=self.learning_rate
        )
        record = StepRecord.of_train("rl", step, result, mean_reward=mean_reward, valid_rate=valid_rate)
        record.print()
        return record

    def plot(self, summary: ArithmeticSummary) -> None:
        model = BASE_MODEL.split("/")[-1]
        title = f"demo --recipe arithmetic: {model}, {summary.train_seconds:.0f} s of training"
        with curve_plot(self.out_dir / "accuracy_curve.png", title, "RL step", "upper left") as ax:
            ax.plot(
                [r.step for r in summary.steps],
                [r.mean_reward for r in summary.steps],
                ".-",
                alpha=0.6,
                label="training batch: mean reward",
            )
            ax.plot(
                [r.step for r in summary.held_out],
                [r.accuracy for r in summary.held_out],
                "o-",
                linewidth=2,
                label="held-out: greedy exact match",
            )
            ax.axhline(
                summary.step0_accuracy + summary.target_gain,
                color="gray",
                linestyle="--",
                label=f"step 0 + {summary.target_gain * 100:.0f} points",
            )

    def verdict(self, summary: ArithmeticSummary) -> str:
        return (
            f"{'PASSED' if summary.passed else 'FAILED'}: held-out accuracy {summary.step0_accuracy:.1%} at step 0 "
            f"-> {summary.final_accuracy:.1%} after {summary.rl_steps} RL steps ({summary.gain:+.1%}, target "
            f"{summary.target_gain:+.0%}) in {summary.train_seconds:.0f} s of training, {summary.wall_seconds:.0f} s "
            f"in all ({summary.chat_completions} chat completions through the sidecar); outputs in {self.out_dir}"
        )


class LoopSettings(Protocol):
    """What the train-and-measure loop reads of a recipe."""

    steps: int
    prompts_per_step: int
    eval_every: int
    max_tokens: int
    lora_rank: int
    seed: int


@dataclass
class HeldOutRun(Generic[RecordT]):
    session: Session
    records: list[RecordT]
    held_out: list[HeldOutRecord]
    final_version: int
    train_seconds: float


# One step: (session, the step's problems, step number, its sampling seed, the version before it).
StepFn = Callable[[Session, list[Problem], int, int, int], Awaitable[RecordT]]


async def train_with_held_out(
    stack: Stack, name: str, settings: LoopSettings, split: Split, rng: random.Random, step: StepFn[RecordT]
) -> HeldOutRun[RecordT]:
    """A fresh SmolLM2 LoRA named after `name`, measured on the held-out problems before its first step
    and every `eval_every` steps and after its last, each step on `prompts_per_step` training problems."""
    records: list[RecordT] = []
    held_out: list[HeldOutRecord] = []
    async with open_session(
        stack,
        name,
        BASE_MODEL,
        lora_rank=settings.lora_rank,
        # The pretrained unembedding is what the model already knows how to write with; a LoRA on it
        # (tied to the input embedding here) moves every token's score at once.
        train_unembed=False,
        renderer=RENDERER,
        seed=settings.seed,
    ) as session:

        async def measure(number: int, version: int) -> None:
            accuracy = await held_out_accuracy(session, split.held_out, settings.max_tokens)
            held_out.append(HeldOutRecord(number, version, accuracy, time.monotonic() - session.created))
            print(f"held-out after step {number:3d} (v{version}): accuracy {accuracy:6.1%}", flush=True)

        await measure(0, 0)
        version = 0
        for number in range(1, settings.steps + 1):
            problems = rng.sample(split.train, settings.prompts_per_step)
            record = await step(session, problems, number, rng.randrange(2**31), version)
            version = record.policy_version
            records.append(record)
            if number % settings.eval_every == 0 or number == settings.steps:
                await measure(number, version)
        train_seconds = time.monotonic() - session.created
    return HeldOutRun(session, records, held_out, version, train_seconds)


async def held_out_accuracy(session: Session, problems: Sequence[Problem], max_tokens: int) -> float:
    """Greedy (temperature 0) exact-match accuracy: one deterministic reply per problem."""
    rollouts = await session.rollouts([p.prompt for p in problems], 1, max_tokens, seed=0, temperature=0.0)
    correct = [
        problem.is_correct(answer)
        for problem, (_, completion) in zip(problems, rollouts, strict=True)
        for answer in choice_texts(completion)
    ]
    return sum(correct) / len(correct)


def choice_texts(completion: ChatCompletion) -> list[str]:
    """Each choice's reply, empty when it ran out of tokens: a cut-off reply is not an answer."""
    return [
        (choice.message.content or "") if choice.finish_reason == "stop" else ""
        for choice in completion.choices
    ]
