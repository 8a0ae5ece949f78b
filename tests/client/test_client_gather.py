"""gather_trajectories / gather_groups: concurrency bound, exception budget, reward summary, progress bar."""

from __future__ import annotations

import asyncio
import math

import pytest
from fake_trainer import FAST_RETRY, FakeServer

import tinkerrpc

pytestmark = pytest.mark.unit


def sampled(reward: float) -> tinkerrpc.Trajectory:
    return tinkerrpc.Trajectory(turns=[tinkerrpc.SampledTurn((1,), (2,), (-0.1,), 0)], reward=reward)


class ConcurrencyProbe:
    """Counts how many rollouts run at the same time."""

    def __init__(self) -> None:
        self.running = 0
        self.peak = 0

    async def rollout(self, reward: float, fail: bool = False) -> tinkerrpc.Trajectory:
        self.running += 1
        self.peak = max(self.peak, self.running)
        try:
            await asyncio.sleep(0.01)
            if fail:
                raise RuntimeError(f"env crashed on {reward}")
            return sampled(reward)
        finally:
            self.running -= 1


async def test_bounded_concurrency_order_and_reward_summary(capsys: pytest.CaptureFixture[str]) -> None:
    probe = ConcurrencyProbe()
    rewards = [0.0, 1.0, 0.5, 0.25, 0.75, 1.0]
    result = await tinkerrpc.gather_trajectories(
        [probe.rollout(r) for r in rewards], max_concurrency=2, desc="eval"
    )
    assert probe.peak == 2
    assert [t.reward for t in result.results] == rewards
    assert result.rewards == tinkerrpc.RewardSummary(mean=3.5 / 6, min=0.0, max=1.0, count=6)
    bar = capsys.readouterr().err
    assert "eval: 6/6" in bar and "reward=0.583" in bar


async def test_factories_and_tolerated_exceptions() -> None:
    probe = ConcurrencyProbe()
    factories = [lambda r=r: probe.rollout(r, fail=r < 0) for r in (1.0, -1.0, 0.0, -2.0)]
    result = await tinkerrpc.gather_trajectories(factories, max_exceptions=2, progress=False)
    assert [t.reward for t in result.results] == [1.0, 0.0]
    assert sorted(str(e) for e in result.exceptions) == ["env crashed on -1.0", "env crashed on -2.0"]
    assert result.rewards.count == 2 and result.rewards.mean == 0.5


async def test_exceeding_the_budget_cancels_the_rest_and_raises() -> None:
    probe = ConcurrencyProbe()
    started: list[int] = []

    async def slow(index: int) -> tinkerrpc.Trajectory:
        started.append(index)
        await asyncio.sleep(30)
        return sampled(0.0)

    rollouts = [probe.rollout(-1.0, fail=True), *[slow(i) for i in range(5)]]
    with pytest.raises(tinkerrpc.TooManyRolloutErrors, match="1 rollouts failed") as caught:
        await tinkerrpc.gather_trajectories(rollouts, max_concurrency=3, progress=False)
    assert isinstance(caught.value.exceptions[0], RuntimeError)
    assert len(started) < 5, "rollouts not yet started must not run after the budget is exceeded"
    # A fractional budget: 25% of 4 rollouts tolerates one failure.
    result = await tinkerrpc.gather_trajectories(
        [probe.rollout(-1.0, fail=True), probe.rollout(1.0), probe.rollout(0.0), probe.rollout(1.0)],
        max_exceptions=0.25,
        progress=False,
    )
    assert len(result.results) == 3 and len(result.exceptions) == 1


async def test_gather_groups_summarises_every_trajectory() -> None:
    async def group(rewards: list[float]) -> tinkerrpc.TrajectoryGroup:
        await asyncio.sleep(0)
        return tinkerrpc.TrajectoryGroup([sampled(r) for r in rewards])

    result = await tinkerrpc.gather_groups([group([0.0, 1.0]), group([1.0, 1.0, 1.0])], progress=False)
    assert [len(g.trajectories) for g in result.results] == [2, 3]
    assert result.rewards == tinkerrpc.RewardSummary(mean=0.8, min=0.0, max=1.0, count=5)
    empty = await tinkerrpc.gather_groups([], progress=False)
    assert empty.results == [] and empty.rewards.count == 0 and math.isnan(empty.rewards.mean)
    with pytest.raises(ValueError, match="max_concurrency"):
        await tinkerrpc.gather_groups([], max_concurrency=0)


async def test_rollouts_sampling_through_the_async_client_train_once(fake_server: FakeServer) -> None:
    """The intended loop: concurrent sampling rollouts, then one Train of the gathered groups."""
    prompt = [tinkerrpc.Message.user("pick one")]
    async with tinkerrpc.AsyncClient(fake_server.target, retry=FAST_RETRY) as client:
        model = await client.create_model("gather-loop", base_model="tinkerrpc/tiny-chat")

        async def rollout_group() -> tinkerrpc.TrajectoryGroup:
            samples = await model.sample(prompt, n=4, max_tokens=4)
            return tinkerrpc.TrajectoryGroup(
                [tinkerrpc.Trajectory.from_sample(prompt, s, reward=float(s.tokens[0] % 2)) for s in samples]
            )

        gathered = await tinkerrpc.gather_groups(
            [rollout_group for _ in range(3)], max_concurrency=2, progress=False
        )
        assert gathered.rewards.count == 12 and gathered.rewards.mean == 0.5
        result = await model.train(gathered.results)
        assert result.policy_version == 1 and result.metrics.trajectories_used == 12
