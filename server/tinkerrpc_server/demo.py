"""`tinkerrpc demo`: RL on a real pretrained model through the whole stack, or, with
`--recipe yes-no-maybe`, SFT then RL on the random tiny model.

Both start `tinkerrpc serve --sidecar-port` (which starts the embedded engine and hosts the sidecar),
then drive it like a user's training script would: an agent written against the `openai` client
samples groups through the OpenAI-compatible sidecar the server hosts (each choice stamped with its
policy version and token ids), Trajectory.from_openai turns the choices into trajectories, and Train
takes one importance-sampling step per batch of groups.

`--recipe arithmetic` (the default) trains the pretrained SmolLM2-135M-Instruct with RL alone on
addition problems, reward 1 for exactly the line the prompt asks for ("3 + 4 = 7") and 0 otherwise. It
measures greedy exact-match accuracy on held-out problems, never trained on, before the first step and
every few steps; the PNG shows both curves and the run passes when held-out accuracy gained the target
over step 0.

`--recipe yes-no-maybe` first teaches the random tiny model by SFT to answer "respond with …" prompts
with exactly one of yes / no / maybe (answers drawn uniformly, so RL starts near reward 0.75), then RL
rewards maybe = 1.0, no = 0.75, yes = 0.5, anything else 0 until the mean reward reaches the target.

Each prints a line per step, writes a curve PNG and a JSON summary, and exits non-zero when it misses
its target.
"""

from __future__ import annotations

import argparse
import asyncio
import itertools
import json
import logging
import random
import sys
import tempfile
import time
from collections.abc import Callable, Coroutine, Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any, TypeVar

import tinkerrpc
from tinkerrpc_server.model_store import TINY_CHAT
from tinkerrpc_server.recipes import arithmetic

if TYPE_CHECKING:
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletion

ANSWERS = ("yes", "no", "maybe")
REWARDS = {"maybe": 1.0, "no": 0.75, "yes": 0.5}


def yes_no_maybe_prompts() -> list[str]:
    """ART's canonical prompt set: every ordering of 2 or 3 of the answers, in a few phrasings."""
    prompts = []
    for prefix in ("respond", "just respond"):
        for use_quotes in (False, True):
            for n in (3, 2):
                for words in itertools.permutations(ANSWERS, n):
                    quoted = [f"'{w}'" if use_quotes else w for w in words]
                    listed = f"{', '.join(quoted[:-1])} or {quoted[-1]}" if n == 3 else " or ".join(quoted)
                    prompts.append(f"{prefix} with {listed}")
    return prompts


def reward_of(text: str) -> float:
    return REWARDS.get(text.strip().lower(), 0.0)


@dataclass
class DemoConfig:
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


@dataclass
class Agent:
    """How the demo's rollouts are made: the `openai` client on the sidecar, as any agent would."""

    api: AsyncOpenAI
    model: str
    chat_completions: int = 0
    completion_tokens: int = 0


@dataclass
class StepRecord:
    phase: str
    step: int
    policy_version: int
    mean_reward: float
    valid_rate: float
    loss: float
    staleness_max: int
    tokens_per_second: float
    step_seconds: float


@dataclass
class DemoSummary:
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


Conversation = list[dict[str, str]]


async def _rollouts(
    agent: Agent, prompts: list[str], n: int, max_tokens: int, seed: int, temperature: float = 1.0
) -> list[tuple[Conversation, ChatCompletion]]:
    """One chat completion (n choices) per prompt, all in flight at once so the engine batches them."""
    conversations: list[Conversation] = [[{"role": "user", "content": p}] for p in prompts]
    completions = await asyncio.gather(
        *(
            agent.api.chat.completions.create(
                model=agent.model,
                messages=messages,  # type: ignore[arg-type]
                n=n,
                max_tokens=max_tokens,
                temperature=temperature,
                seed=seed + i,
                logprobs=True,
            )
            for i, messages in enumerate(conversations)
        )
    )
    agent.chat_completions += len(completions)
    agent.completion_tokens += sum(c.usage.completion_tokens for c in completions if c.usage is not None)
    return list(zip(conversations, completions, strict=True))


def _answers(completion: ChatCompletion) -> list[str]:
    return [(choice.message.content or "").strip().lower() for choice in completion.choices]


async def _valid_rate(agent: Agent, prompts: list[str], config: DemoConfig, seed: int) -> float:
    rollouts = await _rollouts(agent, prompts, config.rl_samples_per_prompt, config.max_tokens, seed)
    answers = [a for _, completion in rollouts for a in _answers(completion)]
    return sum(a in ANSWERS for a in answers) / len(answers)


def _print_step(record: StepRecord) -> None:
    print(
        f"{record.phase} step {record.step:3d} | v{record.policy_version:<3d} | reward {record.mean_reward:.3f} | "
        f"valid {record.valid_rate:6.1%} | loss {record.loss:9.3f} | staleness {record.staleness_max} | "
        f"{record.tokens_per_second:7.0f} tok/s | {record.step_seconds:.2f} s",
        flush=True,
    )


async def _sft(
    model: tinkerrpc.AsyncModel, agent: Agent, config: DemoConfig, records: list[StepRecord]
) -> int:
    rng = random.Random(config.seed)
    prompts = yes_no_maybe_prompts()
    eval_prompts = rng.sample(prompts, config.rl_prompts_per_step)
    for step in range(1, config.sft_max_steps + 1):
        batch = [
            [tinkerrpc.Message.user(p), tinkerrpc.Message.assistant(rng.choice(ANSWERS))]
            for p in rng.choices(prompts, k=config.sft_batch)
        ]
        result = await model.train_supervised(batch, learning_rate=config.sft_learning_rate)
        if step % config.sft_eval_every and step != config.sft_max_steps:
            continue
        valid = await _valid_rate(agent, eval_prompts, config, seed=10_000 + step)
        record = StepRecord(
            phase="sft",
            step=step,
            policy_version=result.policy_version,
            mean_reward=0.0,
            valid_rate=valid,
            loss=result.metrics.loss,
            staleness_max=0,
            tokens_per_second=result.metrics.tokens_per_second,
            step_seconds=result.metrics.step_seconds,
        )
        records.append(record)
        _print_step(record)
        if valid >= config.sft_valid_target:
            return step
    return config.sft_max_steps


async def _rl(
    model: tinkerrpc.AsyncModel, agent: Agent, config: DemoConfig, records: list[StepRecord]
) -> tuple[int, float]:
    rng = random.Random(config.seed + 1)
    prompts = yes_no_maybe_prompts()
    trained = 0
    for _ in range(config.rl_max_steps):
        rollouts = await _rollouts(
            agent,
            rng.sample(prompts, config.rl_prompts_per_step),
            config.rl_samples_per_prompt,
            config.max_tokens,
            seed=rng.randrange(2**31),
        )
        # Each choice carries its token ids, logprobs and policy version: it trains token-exact.
        groups = [
            tinkerrpc.TrajectoryGroup(
                [
                    tinkerrpc.Trajectory.from_openai(messages, completion, reward_of(answer), choice_index=i)
                    for i, answer in enumerate(_answers(completion))
                ]
            )
            for messages, completion in rollouts
        ]
        rewards = [t.reward for g in groups for t in g.trajectories]
        mean_reward = sum(rewards) / len(rewards)
        valid = sum(r > 0 for r in rewards) / len(rewards)
        if all(len({t.reward for t in g.trajectories}) == 1 for g in groups):
            # Every group scored evenly: no advantage anywhere, so the server would refuse the step
            # (NOTHING_TO_TRAIN). Sample a fresh batch instead.
            print(
                f"rl batch: rewards equal within every group (mean {mean_reward:.3f}); resampling", flush=True
            )
            continue
        result = await model.train(groups, loss="importance_sampling", learning_rate=config.rl_learning_rate)
        trained += 1
        record = StepRecord(
            phase="rl",
            step=trained,
            policy_version=result.policy_version,
            mean_reward=mean_reward,
            valid_rate=valid,
            loss=result.metrics.loss,
            staleness_max=max(result.metrics.staleness_histogram, default=0),
            tokens_per_second=result.metrics.tokens_per_second,
            step_seconds=result.metrics.step_seconds,
        )
        records.append(record)
        _print_step(record)
        if mean_reward >= config.target_reward:
            # Confirm on a fresh batch from the new version before declaring success.
            final = await _rl_eval(agent, config, seed=rng.randrange(2**31))
            print(f"eval at v{result.policy_version}: mean reward {final:.3f}", flush=True)
            if final >= config.target_reward:
                return trained, final
    return trained, await _rl_eval(agent, config, seed=rng.randrange(2**31))


async def _rl_eval(agent: Agent, config: DemoConfig, seed: int) -> float:
    prompts = random.Random(seed).sample(yes_no_maybe_prompts(), config.rl_prompts_per_step)
    rollouts = await _rollouts(agent, prompts, config.rl_samples_per_prompt, config.max_tokens, seed)
    rewards = [reward_of(a) for _, completion in rollouts for a in _answers(completion)]
    return sum(rewards) / len(rewards)


def _plot(records: list[StepRecord], summary: DemoSummary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    sft = [r for r in records if r.phase == "sft"]
    rl = [r for r in records if r.phase == "rl"]
    ax.plot([r.policy_version for r in sft], [r.valid_rate for r in sft], "o-", label="SFT: valid answers")
    ax.plot([r.policy_version for r in rl], [r.mean_reward for r in rl], "o-", label="RL: mean reward")
    ax.axhline(summary.target_reward, color="gray", linestyle="--", label=f"target {summary.target_reward}")
    ax.set_xlabel("policy version")
    ax.set_ylim(0, 1.05)
    ax.set_title(f"tinkerrpc demo: yes / no / maybe ({summary.wall_seconds:.0f} s)")
    ax.legend(loc="lower right")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


async def run_demo_against(target: str, sidecar_url: str, config: DemoConfig, started: float) -> DemoSummary:
    """Run both phases against a running server at `target` and its sidecar at `sidecar_url`."""
    import openai  # here: the CLI builds its parser from this module, and only the demo needs openai

    records: list[StepRecord] = []
    api = openai.AsyncOpenAI(base_url=f"{sidecar_url}/v1", api_key="unused", max_retries=0)
    async with api, tinkerrpc.AsyncClient(target) as client:
        model = await client.create_model(
            f"demo-{int(time.time())}-{random.Random().randrange(10**6)}",
            base_model=TINY_CHAT,
            lora_rank=config.lora_rank,
            renderer=config.renderer,
            seed=config.seed,
        )
        print(
            f"created {model.name} on {TINY_CHAT} ({time.monotonic() - started:.1f} s after start)",
            flush=True,
        )
        # The sidecar's live view of this run, open while the demo runs.
        print(f"live run view: {sidecar_url}/runs/{model.name}", flush=True)
        agent = Agent(api, model.name)
        sft_steps = await _sft(model, agent, config, records)
        rl_steps, final_reward = await _rl(model, agent, config, records)
        version = (await model.info()).policy_version
    return DemoSummary(
        passed=final_reward >= config.target_reward,
        final_mean_reward=final_reward,
        target_reward=config.target_reward,
        sft_steps=sft_steps,
        rl_steps=rl_steps,
        wall_seconds=time.monotonic() - started,
        final_policy_version=version,
        chat_completions=agent.chat_completions,
        completion_tokens=agent.completion_tokens,
        steps=records,
    )


@dataclass
class ArithmeticConfig:
    """The arithmetic recipe: RL alone (no SFT) on a pretrained model, judged on held-out problems."""

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
        bad = [f"{name}={getattr(self, name)!r}" for name, ok in checks.items() if not ok]
        if bad:
            raise ValueError(f"invalid arithmetic recipe settings: {', '.join(bad)}")


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


async def _held_out_accuracy(agent: Agent, problems: Sequence[arithmetic.Problem], max_tokens: int) -> float:
    """Greedy (temperature 0) exact-match accuracy: one deterministic reply per problem."""
    rollouts = await _rollouts(agent, [p.prompt for p in problems], 1, max_tokens, seed=0, temperature=0.0)
    correct = [
        problem.is_correct(answer)
        for problem, (_, completion) in zip(problems, rollouts, strict=True)
        for answer in _choice_texts(completion)
    ]
    return sum(correct) / len(correct)


def _choice_texts(completion: ChatCompletion) -> list[str]:
    """Each choice's reply, empty when it ran out of tokens: a cut-off reply is not an answer."""
    return [
        (choice.message.content or "") if choice.finish_reason == "stop" else ""
        for choice in completion.choices
    ]


async def _arithmetic_step(
    model: tinkerrpc.AsyncModel,
    agent: Agent,
    problems: list[arithmetic.Problem],
    config: ArithmeticConfig,
    step: int,
    seed: int,
    version: int,
) -> StepRecord:
    """Sample a group per problem, score each reply, train on the groups; `version` is the policy
    version before the step."""
    rollouts = await _rollouts(
        agent, [p.prompt for p in problems], config.samples_per_prompt, config.max_tokens, seed
    )
    groups = []
    in_format = 0
    for problem, (messages, completion) in zip(problems, rollouts, strict=True):
        answers = _choice_texts(completion)
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
    record = StepRecord(
        phase="rl",
        step=step,
        policy_version=version,
        mean_reward=sum(rewards) / len(rewards),
        # Replies in the asked-for format, right or wrong.
        valid_rate=in_format / len(rewards),
        loss=0.0,
        staleness_max=0,
        tokens_per_second=0.0,
        step_seconds=0.0,
    )
    if all(len({t.reward for t in g.trajectories}) == 1 for g in groups):
        # No group has an advantage to learn from (the server would answer NOTHING_TO_TRAIN): the
        # step samples and scores, and trains nothing.
        print(
            f"rl step {step:3d} | reward {record.mean_reward:.3f} | equal within every group: no update",
            flush=True,
        )
        return record
    result = await model.train(groups, loss="importance_sampling", learning_rate=config.learning_rate)
    record.policy_version = result.policy_version
    record.loss = result.metrics.loss
    record.staleness_max = max(result.metrics.staleness_histogram, default=0)
    record.tokens_per_second = result.metrics.tokens_per_second
    record.step_seconds = result.metrics.step_seconds
    _print_step(record)
    return record


async def run_arithmetic_against(
    target: str, sidecar_url: str, config: ArithmeticConfig, started: float
) -> ArithmeticSummary:
    """Measure the pretrained model on the held-out problems, then RL on the training problems,
    measuring again every `eval_every` steps."""
    import openai

    split = arithmetic.split_problems(config.seed, config.held_out_size)
    rng = random.Random(config.seed + 1)
    records: list[StepRecord] = []
    held_out: list[HeldOutRecord] = []
    api = openai.AsyncOpenAI(base_url=f"{sidecar_url}/v1", api_key="unused", max_retries=0)
    async with api, tinkerrpc.AsyncClient(target) as client:
        model = await client.create_model(
            f"arithmetic-{int(time.time())}-{random.Random().randrange(10**6)}",
            base_model=arithmetic.BASE_MODEL,
            lora_rank=config.lora_rank,
            # The pretrained unembedding is what the model already knows how to write with; a LoRA on
            # it (tied to the input embedding here) moves every token's score at once.
            train_unembed=False,
            renderer=arithmetic.RENDERER,
            seed=config.seed,
        )
        created = time.monotonic()
        print(
            f"created {model.name} on {arithmetic.BASE_MODEL} ({created - started:.1f} s after start)",
            flush=True,
        )
        print(f"live run view: {sidecar_url}/runs/{model.name}", flush=True)
        agent = Agent(api, model.name)

        async def measure(step: int, version: int) -> None:
            accuracy = await _held_out_accuracy(agent, split.held_out, config.max_tokens)
            held_out.append(HeldOutRecord(step, version, accuracy, time.monotonic() - created))
            print(f"held-out after step {step:3d} (v{version}): accuracy {accuracy:6.1%}", flush=True)

        await measure(0, 0)
        version = 0
        for step in range(1, config.steps + 1):
            problems = rng.sample(split.train, config.prompts_per_step)
            record = await _arithmetic_step(
                model, agent, problems, config, step, rng.randrange(2**31), version
            )
            version = record.policy_version
            records.append(record)
            if step % config.eval_every == 0 or step == config.steps:
                await measure(step, version)
        train_seconds = time.monotonic() - created
    step0, final = held_out[0].accuracy, held_out[-1].accuracy
    return ArithmeticSummary(
        passed=final - step0 >= config.target_gain,
        step0_accuracy=step0,
        final_accuracy=final,
        gain=final - step0,
        target_gain=config.target_gain,
        rl_steps=config.steps,
        trained_steps=version,
        train_seconds=train_seconds,
        wall_seconds=time.monotonic() - started,
        final_policy_version=version,
        chat_completions=agent.chat_completions,
        completion_tokens=agent.completion_tokens,
        steps=records,
        held_out=held_out,
    )


def _plot_arithmetic(summary: ArithmeticSummary, path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
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
    ax.set_xlabel("RL step")
    ax.set_ylim(0, 1.05)
    model = arithmetic.BASE_MODEL.split("/")[-1]
    ax.set_title(f"demo --recipe arithmetic: {model}, {summary.train_seconds:.0f} s of training")
    ax.legend(loc="upper left")
    fig.tight_layout()
    fig.savefig(path, dpi=100)
    plt.close(fig)


def run_arithmetic(config: ArithmeticConfig) -> ArithmeticSummary:
    """The arithmetic recipe on a fresh local stack; writes the outputs."""
    summary = _run_with_stack(
        config.out_dir,
        config.data_dir,
        lambda target, sidecar_url, started: run_arithmetic_against(target, sidecar_url, config, started),
    )
    _plot_arithmetic(summary, config.out_dir / "accuracy_curve.png")
    verdict = "PASSED" if summary.passed else "FAILED"
    print(
        f"{verdict}: held-out accuracy {summary.step0_accuracy:.1%} at step 0 -> {summary.final_accuracy:.1%} "
        f"after {summary.rl_steps} RL steps ({summary.gain:+.1%}, target {summary.target_gain:+.0%}) in "
        f"{summary.train_seconds:.0f} s of training, {summary.wall_seconds:.0f} s in all "
        f"({summary.chat_completions} chat completions through the sidecar); outputs in {config.out_dir}",
        flush=True,
    )
    return summary


SummaryT = TypeVar("SummaryT", DemoSummary, ArithmeticSummary)


def _run_with_stack(
    out_dir: Path, data_dir: Path | None, run: Callable[[str, str, float], Coroutine[Any, Any, SummaryT]]
) -> SummaryT:
    """Start the stack in child processes, run `run(target, sidecar_url, started)`, stop the stack."""
    from tinkerrpc_server.local.stack import LocalStack

    started = time.monotonic()
    out_dir.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="tinkerrpc-demo-") as tmp,
        LocalStack(
            data_dir or Path(tmp) / "data", log_path=out_dir / "server.log", with_sidecar=True
        ) as stack,
    ):
        assert stack.sidecar_url is not None
        summary = asyncio.run(run(stack.target, stack.sidecar_url, started))
    summary.wall_seconds = time.monotonic() - started
    (out_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    return summary


def run_demo(config: DemoConfig) -> DemoSummary:
    """The yes / no / maybe recipe on a fresh local stack; writes the outputs."""
    summary = _run_with_stack(
        config.out_dir,
        config.data_dir,
        lambda target, sidecar_url, started: run_demo_against(target, sidecar_url, config, started),
    )
    _plot(summary.steps, summary, config.out_dir / "reward_curve.png")
    verdict = "PASSED" if summary.passed else "FAILED"
    print(
        f"{verdict}: final mean reward {summary.final_mean_reward:.3f} (target {summary.target_reward}) after "
        f"{summary.sft_steps} SFT + {summary.rl_steps} RL steps in {summary.wall_seconds:.1f} s "
        f"({summary.chat_completions} chat completions through the sidecar, {summary.completion_tokens} "
        f"tokens); outputs in {config.out_dir}",
        flush=True,
    )
    return summary


RECIPES = ("yes-no-maybe", "arithmetic")


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--recipe",
        choices=RECIPES,
        default="arithmetic",
        help=f"arithmetic (the default): RL on the pretrained {arithmetic.BASE_MODEL}, judged on held-out "
        "addition problems; yes-no-maybe: SFT then RL on the random tiny model",
    )
    parser.add_argument("--out", type=Path, default=Path("demo-out"), help="where the PNG and JSON go")
    parser.add_argument(
        "--target-reward",
        type=float,
        default=DemoConfig.target_reward,
        help="yes-no-maybe: final mean reward",
    )
    parser.add_argument(
        "--target-gain",
        type=float,
        default=ArithmeticConfig.target_gain,
        help="arithmetic: held-out accuracy to gain over step 0 (absolute, 0.2 = 20 points)",
    )
    parser.add_argument(
        "--rl-max-steps",
        type=_positive_int,
        default=None,
        help=f"RL steps (default: yes-no-maybe {DemoConfig.rl_max_steps} at most, "
        f"arithmetic {ArithmeticConfig.steps})",
    )
    parser.add_argument("--seed", type=int, default=DemoConfig.seed)
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="keep the server state here (default: temp)"
    )


def main(args: argparse.Namespace) -> int:
    # The openai client's HTTP library logs every request at INFO (as `httpx`, or `httpx2` in the
    # versions that vendor it): the per-step lines are the demo's progress report.
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)
    if args.recipe == "arithmetic":
        arithmetic_config = ArithmeticConfig(
            out_dir=args.out,
            target_gain=args.target_gain,
            steps=args.rl_max_steps or ArithmeticConfig.steps,
            seed=args.seed,
            data_dir=args.data_dir,
        )
        return 0 if run_arithmetic(arithmetic_config).passed else 1
    config = DemoConfig(
        out_dir=args.out,
        target_reward=args.target_reward,
        rl_max_steps=args.rl_max_steps or DemoConfig.rl_max_steps,
        seed=args.seed,
        data_dir=args.data_dir,
    )
    return 0 if run_demo(config).passed else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
