"""What the demo's recipes share: the Recipe protocol, a run of one on a fresh local stack, and the
session through which a recipe drives that stack as a user's training script would (the tinkerrpc
client to train, the `openai` client on the sidecar for rollouts)."""

from __future__ import annotations

import asyncio
import contextlib
import json
import random
import tempfile
import time
from collections.abc import AsyncIterator, Iterator
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar, Literal, Protocol, TypeVar

import tinkerrpc

if TYPE_CHECKING:
    from matplotlib.axes import Axes
    from openai import AsyncOpenAI
    from openai.types.chat import ChatCompletion


class Summary(Protocol):
    """A recipe's result, a dataclass written as the run's summary.json."""

    __dataclass_fields__: ClassVar[dict[str, Any]]
    passed: bool
    wall_seconds: float


SummaryT = TypeVar("SummaryT", bound=Summary)


@dataclass(frozen=True)
class Stack:
    """The running stack a recipe drives: the server's gRPC target and its sidecar's URL, and when the
    run started (time.monotonic())."""

    target: str
    sidecar_url: str
    started: float


class Recipe(Protocol[SummaryT]):
    """One recipe of `tinkerrpc demo`: its settings are its fields."""

    out_dir: Path
    # Where the server keeps its state (None: a temporary directory).
    data_dir: Path | None

    async def run(self, stack: Stack) -> SummaryT:
        """Train through the stack; the summary says whether the recipe reached its target."""
        ...

    def plot(self, summary: SummaryT) -> None:
        """Write the run's curve to a PNG under out_dir."""
        ...

    def verdict(self, summary: SummaryT) -> str:
        """The run's closing line: PASSED or FAILED, and the figures that decided it."""
        ...


def run_recipe(recipe: Recipe[SummaryT]) -> SummaryT:
    """Start the stack in child processes, run the recipe through it, stop the stack, then write
    summary.json and the plot to out_dir and print the verdict."""
    from tinkerrpc_server.local.stack import LocalStack

    started = time.monotonic()
    recipe.out_dir.mkdir(parents=True, exist_ok=True)
    with (
        tempfile.TemporaryDirectory(prefix="tinkerrpc-demo-") as tmp,
        LocalStack(
            recipe.data_dir or Path(tmp) / "data", log_path=recipe.out_dir / "server.log", with_sidecar=True
        ) as stack,
    ):
        assert stack.sidecar_url is not None
        summary = asyncio.run(recipe.run(Stack(stack.target, stack.sidecar_url, started)))
    summary.wall_seconds = time.monotonic() - started
    (recipe.out_dir / "summary.json").write_text(json.dumps(asdict(summary), indent=2))
    recipe.plot(summary)
    print(recipe.verdict(summary), flush=True)
    return summary


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

    def print(self) -> None:
        print(
            f"{self.phase} step {self.step:3d} | v{self.policy_version:<3d} | reward {self.mean_reward:.3f} | "
            f"valid {self.valid_rate:6.1%} | loss {self.loss:9.3f} | staleness {self.staleness_max} | "
            f"{self.tokens_per_second:7.0f} tok/s | {self.step_seconds:.2f} s",
            flush=True,
        )

    @classmethod
    def of_train(
        cls, phase: str, step: int, result: tinkerrpc.TrainResult, mean_reward: float, valid_rate: float
    ) -> StepRecord:
        """A step that trained: the version its Train made and its metrics."""
        return cls(
            phase=phase,
            step=step,
            policy_version=result.policy_version,
            mean_reward=mean_reward,
            valid_rate=valid_rate,
            loss=result.metrics.loss,
            staleness_max=max(result.metrics.staleness_histogram, default=0),
            tokens_per_second=result.metrics.tokens_per_second,
            step_seconds=result.metrics.step_seconds,
        )


Conversation = list[dict[str, str]]


@dataclass
class Session:
    """A recipe's model on the stack, and its agent: the `openai` client on the sidecar, as any agent
    would sample, counting what it asked for."""

    model: tinkerrpc.AsyncModel
    api: AsyncOpenAI
    # When the model was created (time.monotonic()): what a training budget is measured from.
    created: float
    chat_completions: int = 0
    completion_tokens: int = 0

    async def rollouts(
        self, prompts: list[str], n: int, max_tokens: int, seed: int, temperature: float = 1.0
    ) -> list[tuple[Conversation, ChatCompletion]]:
        """One chat completion (n choices) per prompt, all in flight at once so the engine batches them."""
        conversations: list[Conversation] = [[{"role": "user", "content": p}] for p in prompts]
        completions = await asyncio.gather(
            *(
                self.api.chat.completions.create(
                    model=self.model.name,
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
        self.chat_completions += len(completions)
        self.completion_tokens += sum(c.usage.completion_tokens for c in completions if c.usage is not None)
        return list(zip(conversations, completions, strict=True))


@contextlib.asynccontextmanager
async def open_session(
    stack: Stack, name_prefix: str, base_model: str, **options: Any
) -> AsyncIterator[Session]:
    """A fresh LoRA model on `base_model` (create_model's `options`), named `name_prefix`-<time>-<random>,
    and the clients to drive it; prints where its live run view is."""
    # Imported here: the CLI builds its parser from the recipes, and only a run needs openai.
    import openai

    api = openai.AsyncOpenAI(base_url=f"{stack.sidecar_url}/v1", api_key="unused", max_retries=0)
    async with api, tinkerrpc.AsyncClient(stack.target) as client:
        model = await client.create_model(
            f"{name_prefix}-{int(time.time())}-{random.Random().randrange(10**6)}",
            base_model=base_model,
            **options,
        )
        created = time.monotonic()
        print(
            f"created {model.name} on {base_model} ({created - stack.started:.1f} s after start)", flush=True
        )
        # The sidecar's live view of this run, open while the recipe runs.
        print(f"live run view: {stack.sidecar_url}/runs/{model.name}", flush=True)
        yield Session(model, api, created)


def has_no_advantage(groups: list[tinkerrpc.TrajectoryGroup]) -> bool:
    """Whether every group scored evenly: no advantage anywhere, so the server would refuse the step
    (NOTHING_TO_TRAIN)."""
    return all(len({t.reward for t in g.trajectories}) == 1 for g in groups)


@contextlib.contextmanager
def curve_plot(
    path: Path, title: str, xlabel: str, legend_at: Literal["upper left", "lower right"]
) -> Iterator[Axes]:
    """A 7×4 in plot of rates in [0, 1] to draw on, saved to `path` as a PNG."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    fig, ax = plt.subplots(figsize=(7, 4))
    try:
        yield ax
        ax.set_xlabel(xlabel)
        ax.set_ylim(0, 1.05)
        ax.set_title(title)
        ax.legend(loc=legend_at)
        fig.tight_layout()
        fig.savefig(path, dpi=100)
    finally:
        plt.close(fig)


def check_settings(kind: str, settings: object, checks: dict[str, bool]) -> None:
    """Refuse a recipe's settings naming each one whose check failed (`checks`: name -> within range)."""
    bad = [f"{name}={getattr(settings, name)!r}" for name, ok in checks.items() if not ok]
    if bad:
        raise ValueError(f"invalid {kind} recipe settings: {', '.join(bad)}")
