"""The ART-vs-seed figures from the flows' own timings (bench/art_seed.py; tests/art runs both flows):
each run's median step counts trained steps only, the figure takes the median over runs, and a run that
never reached the target or never trained is an error, not a figure."""

from __future__ import annotations

from typing import Any

import pytest

from bench.art_seed import figures, median_step_seconds

pytestmark = pytest.mark.unit


def _run(
    rollouts: list[float], trains: list[float], to_target: float | None, sft: float = 1.0
) -> dict[str, Any]:
    return {
        "rewards": [0.5] * len(rollouts),
        "rollout_seconds": rollouts,
        "train_seconds": trains,
        "seconds_to_target": to_target,
        "sft_seconds": sft,
    }


def test_a_step_is_its_rollouts_and_train_and_the_last_rollouts_train_no_more() -> None:
    assert median_step_seconds(_run([2.0, 3.0, 9.0, 1.0], [1.0, 1.0, 1.0], 50.0)) == 4.0


def test_figures_are_medians_over_rounds_of_ours_over_the_seed_and_keep_each_round() -> None:
    ours = [
        _run([1.0, 1.0], [1.0, 3.0], 20.0, sft=2.0),
        _run([2.0, 1.0], [2.0], 30.0, sft=3.0),
        _run([3.0, 1.0], [3.0], 90.0, sft=9.0),
    ]
    seed = [
        _run([4.0, 1.0], [4.0], 40.0, sft=4.0),
        _run([5.0, 1.0], [5.0], 60.0, sft=2.0),
        _run([6.0, 1.0], [6.0], 10.0, sft=3.0),
    ]
    step, train, sft, target = figures(ours, seed)
    assert (step.ours, step.baseline, step.ratio, step.direction) == (4.0, 10.0, 0.4, "<=")
    assert (train.ours, train.baseline, train.ratio) == (2.0, 5.0, 0.4)
    assert (sft.ours, sft.baseline, sft.ratio) == (3.0, 3.0, 1.0)
    assert (target.ours, target.baseline, target.ratio) == (30.0, 40.0, 0.75)
    # A round is one run of each side, in the order they ran.
    assert [(r.ours, r.baseline) for r in step.rounds] == [(3.0, 8.0), (4.0, 10.0), (6.0, 12.0)]
    assert [(r.ours, r.baseline) for r in train.rounds] == [(2.0, 4.0), (2.0, 5.0), (3.0, 6.0)]
    assert [(r.ours, r.baseline) for r in sft.rounds] == [(2.0, 4.0), (3.0, 2.0), (9.0, 3.0)]
    assert [(r.ours, r.baseline) for r in target.rounds] == [(20.0, 40.0), (30.0, 60.0), (90.0, 10.0)]
    # The goals: a step <= 0.7x, Train and SFT <= 1x each, the time to the target <= 0.75x.
    assert [f.goal for f in (step, train, sft, target)] == [0.7, 1.0, 1.0, 0.75]
    assert step.met and train.met and sft.met and target.met


def test_a_run_that_never_trained_or_never_reached_the_target_is_an_error() -> None:
    with pytest.raises(ValueError, match="before any RL step"):
        figures([_run([1.0], [], 5.0)], [_run([1.0, 1.0], [1.0], 5.0)])
    with pytest.raises(ValueError, match="never reached"):
        figures([_run([1.0, 1.0], [1.0], None)], [_run([1.0, 1.0], [1.0], 5.0)])
