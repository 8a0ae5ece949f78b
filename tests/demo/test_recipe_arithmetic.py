"""`tinkerrpc demo --recipe arithmetic`: the task's generator and checker, and the recipe end to end on
the pretrained SmolLM2-135M-Instruct through the client, server, sidecar and embedded engine."""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import pytest

from tinkerrpc_server.recipes.arithmetic.recipe import ArithmeticRecipe
from tinkerrpc_server.recipes.arithmetic.task import Problem, split_problems

pytestmark = pytest.mark.process

# The short form CI runs: held-out accuracy after CI_STEPS RL steps beat step 0 by at least CI_MARGIN
# in every seed measured (seeds 0-2: +35, +30 and +22.5 points after 5 steps; the full recipe runs 15
# and aims for +20).
CI_STEPS = 5
CI_MARGIN = 0.1


def test_split_is_a_function_of_the_seed() -> None:
    assert split_problems(3, 40) == split_problems(3, 40)
    assert split_problems(3, 40).held_out != split_problems(4, 40).held_out


def test_held_out_never_overlaps_training() -> None:
    for seed in range(5):
        split = split_problems(seed, 40)
        assert len(split.held_out) == 40
        assert not set(split.held_out) & set(split.train)
        # Together they are every problem with operands 0..9, each once.
        everything = split.held_out + split.train
        assert len(everything) == len(set(everything)) == 100
        assert {(p.a, p.b) for p in everything} == {(a, b) for a in range(10) for b in range(10)}


def test_operand_range_and_held_out_size_are_checked() -> None:
    assert len(split_problems(0, 10, low=1, high=15).train) == 15 * 15 - 10
    with pytest.raises(ValueError, match="operand range"):
        split_problems(0, 10, low=5, high=4)
    with pytest.raises(ValueError, match="operand range"):
        split_problems(0, 10, low=-1, high=4)
    for size in (0, 100, 101):
        with pytest.raises(ValueError, match="held_out_size"):
            split_problems(0, size)


def test_prompt_states_the_answer_format() -> None:
    problem = Problem(7, 5)
    assert problem.prompt == (
        "What is 7 + 5? Respond with a single line of the form 7 + 5 = <sum> and no other text."
    )
    assert problem.answer == "7 + 5 = 12"


@pytest.mark.parametrize("reply", ["7 + 5 = 12", " 7 + 5 = 12", "7 + 5 = 12\n", "\n 7 + 5 = 12 \n"])
def test_checker_accepts_exactly_the_sum(reply: str) -> None:
    assert Problem(7, 5).is_correct(reply)


@pytest.mark.parametrize(
    "reply",
    [
        "",
        "12",
        "7 + 5 = 13",
        "7 + 5 = 12.",
        "7 + 5 = 012",
        "7+5=12",
        "5 + 7 = 12",
        "7 + 5 = 1 2",
        "The answer is 7 + 5 = 12",
        "7 + 5 = 12 7 + 5 = 12",
        "7 + 5 = twelve",
    ],
)
def test_checker_rejects_anything_else(reply: str) -> None:
    assert not Problem(7, 5).is_correct(reply)


def test_format_check_is_independent_of_the_sum() -> None:
    problem = Problem(7, 5)
    assert problem.is_in_format("7 + 5 = 13") and problem.is_in_format(" 7 + 5 = 12\n")
    for reply in ("", "12", "7 + 5 = 12.", "7 + 5 = -3", "7 + 5 = ٣", "5 + 7 = 12", "17 + 5 = 22"):
        assert not problem.is_in_format(reply), reply


def test_recipe_settings_are_range_checked(tmp_path: Path) -> None:
    with pytest.raises(ValueError, match="samples_per_prompt=1"):
        ArithmeticRecipe(tmp_path, samples_per_prompt=1)
    with pytest.raises(ValueError, match=r"target_gain=0\.0, steps=0"):
        ArithmeticRecipe(tmp_path, target_gain=0.0, steps=0)


def test_rl_raises_held_out_accuracy(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [
            sys.executable,
            "-m",
            "tinkerrpc_server.cli",
            "demo",
            "--recipe",
            "arithmetic",
            "--rl-max-steps",
            str(CI_STEPS),
            "--target-gain",
            str(CI_MARGIN),
            "--out",
            str(out),
        ],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] is True
    held_out = summary["held_out"]
    assert held_out[0]["step"] == 0 and held_out[0]["policy_version"] == 0
    assert held_out[-1]["step"] == CI_STEPS
    assert summary["final_accuracy"] - summary["step0_accuracy"] >= CI_MARGIN
    assert summary["final_policy_version"] == summary["trained_steps"] >= 1
    # Every rollout went through the sidecar: one chat completion per training prompt and step, and
    # one per held-out problem at each measurement.
    assert summary["chat_completions"] == 4 * CI_STEPS + 40 * len(held_out)
    assert (out / "accuracy_curve.png").stat().st_size > 1000
    assert "PASSED" in proc.stdout and "held-out after step" in proc.stdout
