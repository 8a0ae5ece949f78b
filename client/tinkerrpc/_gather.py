"""Run rollout coroutines concurrently: bounded concurrency, a progress bar, an exception budget."""

from __future__ import annotations

import asyncio
import inspect
import math
from collections.abc import Awaitable, Callable, Iterable, Sequence
from dataclasses import dataclass, field
from typing import Any, Generic, TypeVar

from tinkerrpc._progress import ProgressBar
from tinkerrpc._types import Trajectory, TrajectoryGroup

T = TypeVar("T")
Rollout = Awaitable[T] | Callable[[], Awaitable[T]]


@dataclass(frozen=True)
class RewardSummary:
    """Mean, min, max and count of the rewards of the trajectories gathered (NaN when there are none)."""

    mean: float
    min: float
    max: float
    count: int

    @classmethod
    def of(cls, rewards: Sequence[float]) -> RewardSummary:
        if not rewards:
            return cls(math.nan, math.nan, math.nan, 0)
        return cls(sum(rewards) / len(rewards), min(rewards), max(rewards), len(rewards))


@dataclass
class GatherResult(Generic[T]):
    """The rollouts that finished (in input order), the exceptions tolerated, and a reward summary."""

    results: list[T]
    exceptions: list[BaseException] = field(default_factory=list)
    rewards: RewardSummary = field(default_factory=lambda: RewardSummary.of([]))


class TooManyRolloutErrors(Exception):
    """More rollouts failed than `max_exceptions` allows; `exceptions` holds every failure seen."""

    def __init__(self, exceptions: list[BaseException], budget: int) -> None:
        super().__init__(
            f"{len(exceptions)} rollouts failed, more than the {budget} tolerated; first: {exceptions[0]!r}"
        )
        self.exceptions = exceptions


def _draw(bar: ProgressBar, done: int, failed: int, rewards: Sequence[float]) -> None:
    """Rollouts done, with the running mean reward and the errors so far."""
    postfix = f" reward={sum(rewards) / len(rewards):.3f}" if rewards else ""
    if failed:
        postfix += f" errors={failed}"
    bar.draw(done, f"{done}/{bar.total}", postfix)


def _exception_budget(max_exceptions: int | float, total: int) -> int:
    """An int is a count; a float in [0, 1) is a fraction of the rollouts."""
    if isinstance(max_exceptions, float) and 0 <= max_exceptions < 1:
        return int(max_exceptions * total)
    if max_exceptions < 0 or (isinstance(max_exceptions, float) and not max_exceptions.is_integer()):
        raise ValueError(f"max_exceptions must be a count >= 0 or a fraction in [0, 1), got {max_exceptions}")
    return int(max_exceptions)


async def _gather(
    rollouts: Iterable[Rollout[T]],
    rewards_of: Callable[[T], list[float]],
    *,
    max_concurrency: int | None,
    max_exceptions: int | float,
    progress: bool,
    desc: str,
) -> GatherResult[T]:
    items = list(rollouts)
    budget = _exception_budget(max_exceptions, len(items))
    if max_concurrency is not None and max_concurrency < 1:
        raise ValueError(f"max_concurrency must be >= 1, got {max_concurrency}")
    limit = asyncio.Semaphore(max_concurrency or max(len(items), 1))
    bar = ProgressBar(len(items), desc) if progress else None
    finished: dict[int, T] = {}
    failures: list[BaseException] = []
    rewards: list[float] = []
    too_many = asyncio.Event()

    async def run(index: int, item: Rollout[T]) -> None:
        started = False
        try:
            async with limit:
                started = True
                result = await (item() if callable(item) else item)
        except Exception as error:
            failures.append(error)
            if len(failures) > budget:
                too_many.set()
        else:
            finished[index] = result
            rewards.extend(rewards_of(result))
        finally:
            # A coroutine cancelled before it started must be closed, or Python warns it was never awaited.
            if not started and inspect.iscoroutine(item):
                item.close()
        if bar is not None:
            _draw(bar, len(finished) + len(failures), len(failures), rewards)

    if bar is not None:
        _draw(bar, 0, 0, rewards)
    tasks = [asyncio.ensure_future(run(i, item)) for i, item in enumerate(items)]
    all_done: asyncio.Future[list[None]] = asyncio.gather(*tasks)
    stop_early: asyncio.Future[bool] = asyncio.ensure_future(too_many.wait())
    watched: list[asyncio.Future[Any]] = [all_done, stop_early]
    try:
        await asyncio.wait(watched, return_when=asyncio.FIRST_COMPLETED)
    finally:
        for future in [*tasks, *watched]:
            future.cancel()
        await asyncio.gather(*tasks, *watched, return_exceptions=True)
        if bar is not None:
            bar.close()
    if too_many.is_set():
        raise TooManyRolloutErrors(failures, budget) from failures[-1]
    return GatherResult(
        results=[finished[i] for i in sorted(finished)],
        exceptions=failures,
        rewards=RewardSummary.of(rewards),
    )


async def gather_trajectories(
    rollouts: Iterable[Rollout[Trajectory]],
    *,
    max_concurrency: int | None = None,
    max_exceptions: int | float = 0,
    progress: bool = True,
    desc: str = "rollouts",
) -> GatherResult[Trajectory]:
    """Await rollouts (coroutines or zero-argument coroutine functions) that each return a Trajectory.

    At most `max_concurrency` run at once. Up to `max_exceptions` failures (a count, or a fraction
    of the rollouts when a float below 1) are tolerated and returned; one more cancels the rest and
    raises TooManyRolloutErrors. The progress bar goes to stderr with the running mean reward.
    """
    return await _gather(
        rollouts,
        lambda traj: [traj.reward],
        max_concurrency=max_concurrency,
        max_exceptions=max_exceptions,
        progress=progress,
        desc=desc,
    )


async def gather_groups(
    rollouts: Iterable[Rollout[TrajectoryGroup]],
    *,
    max_concurrency: int | None = None,
    max_exceptions: int | float = 0,
    progress: bool = True,
    desc: str = "groups",
) -> GatherResult[TrajectoryGroup]:
    """Like gather_trajectories, for rollouts that each return a TrajectoryGroup; rewards cover every trajectory."""
    return await _gather(
        rollouts,
        lambda group: group.rewards,
        max_concurrency=max_concurrency,
        max_exceptions=max_exceptions,
        progress=progress,
        desc=desc,
    )
