"""`tinkerrpc demo --recipe distillation`: registered with the demo, built from its command line, and its
settings checked. The run itself (the arithmetic teacher trained, then distilled into a fresh SmolLM2
LoRA with no reward) takes minutes of CPU per seed: its measured results are committed in
docs/figures/distillation_recipe_seeds.json and docs/demo.md, and the Train option it drives is tested
against a direct computation in tests/service/test_train_terms.py."""

from __future__ import annotations

import argparse
from pathlib import Path

import pytest

from tinkerrpc_server import demo
from tinkerrpc_server.recipes.arithmetic.recipe import ArithmeticRecipe
from tinkerrpc_server.recipes.distillation.recipe import DistillationRecipe

pytestmark = pytest.mark.unit


def test_the_demo_builds_the_recipe_from_its_command_line(tmp_path: Path) -> None:
    parser = argparse.ArgumentParser()
    demo.add_arguments(parser)
    args = parser.parse_args(
        ["--recipe", "distillation", "--out", str(tmp_path), "--seed", "2", "--rl-max-steps", "7"]
    )
    recipe = demo.RECIPES[args.recipe](args)
    assert isinstance(recipe, DistillationRecipe)
    assert (recipe.out_dir, recipe.seed, recipe.steps, recipe.target_gain) == (tmp_path, 2, 7, 0.2)
    # The teacher is the default demo's result: the arithmetic recipe's model after its own steps.
    assert recipe.teacher_steps == ArithmeticRecipe.steps
    assert recipe.held_out_size == ArithmeticRecipe.held_out_size


@pytest.mark.parametrize(
    "setting", [{"target_gain": 0.0}, {"steps": 0}, {"teacher_steps": 0}, {"learning_rate": -1.0}]
)
def test_bad_settings_are_refused(tmp_path: Path, setting: dict[str, float]) -> None:
    with pytest.raises(ValueError, match=next(iter(setting))):
        DistillationRecipe(out_dir=tmp_path, **setting)  # type: ignore[arg-type]
