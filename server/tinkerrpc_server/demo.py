"""`tinkerrpc demo`: a recipe trained through the whole local stack.

Each recipe (recipes/: its task, loop, summary and plot) starts `tinkerrpc serve --sidecar-port` (which
starts the embedded engine and hosts the sidecar), then drives it like a user's training script would:
an agent written against the `openai` client samples groups through the OpenAI-compatible sidecar the
server hosts (each choice stamped with its policy version and token ids), Trajectory.from_openai turns
the choices into trajectories, and Train takes one importance-sampling step per batch of groups. Each
prints a line per step, writes a curve PNG and a JSON summary, and exits non-zero when it misses its
target.

`--recipe arithmetic` (the default) trains the pretrained SmolLM2-135M-Instruct with RL alone on
addition problems, judged on held-out ones; `--recipe distillation` then distils that model into a fresh
SmolLM2 LoRA with no reward function (Train's distillation option); `--recipe yes-no-maybe` teaches the
random tiny model by SFT then RL.
"""

from __future__ import annotations

import argparse
import logging
import sys
from collections.abc import Callable
from pathlib import Path
from typing import Any

from tinkerrpc_server.recipes.arithmetic.recipe import ArithmeticRecipe
from tinkerrpc_server.recipes.arithmetic.task import BASE_MODEL
from tinkerrpc_server.recipes.base import Recipe, run_recipe
from tinkerrpc_server.recipes.distillation.recipe import DistillationRecipe
from tinkerrpc_server.recipes.yes_no_maybe.recipe import YesNoMaybeRecipe


def _yes_no_maybe(args: argparse.Namespace) -> YesNoMaybeRecipe:
    return YesNoMaybeRecipe(
        out_dir=args.out,
        target_reward=args.target_reward,
        rl_max_steps=args.rl_max_steps or YesNoMaybeRecipe.rl_max_steps,
        seed=args.seed,
        data_dir=args.data_dir,
    )


def _arithmetic(args: argparse.Namespace) -> ArithmeticRecipe:
    return ArithmeticRecipe(
        out_dir=args.out,
        target_gain=args.target_gain,
        steps=args.rl_max_steps or ArithmeticRecipe.steps,
        seed=args.seed,
        data_dir=args.data_dir,
    )


def _distillation(args: argparse.Namespace) -> DistillationRecipe:
    return DistillationRecipe(
        out_dir=args.out,
        target_gain=args.target_gain,
        steps=args.rl_max_steps or DistillationRecipe.steps,
        seed=args.seed,
        data_dir=args.data_dir,
    )


# Each recipe by its --recipe name, made from the command line.
RECIPES: dict[str, Callable[[argparse.Namespace], Recipe[Any]]] = {
    "yes-no-maybe": _yes_no_maybe,
    "arithmetic": _arithmetic,
    "distillation": _distillation,
}


def _positive_int(text: str) -> int:
    value = int(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be at least 1, got {value}")
    return value


def add_arguments(parser: argparse.ArgumentParser) -> None:
    parser.add_argument(
        "--recipe",
        choices=list(RECIPES),
        default="arithmetic",
        help=f"arithmetic (the default): RL on the pretrained {BASE_MODEL}, judged on held-out "
        "addition problems; distillation: that arithmetic-trained model distilled into a fresh one with no "
        "reward; yes-no-maybe: SFT then RL on the random tiny model",
    )
    parser.add_argument("--out", type=Path, default=Path("demo-out"), help="where the PNG and JSON go")
    parser.add_argument(
        "--target-reward",
        type=float,
        default=YesNoMaybeRecipe.target_reward,
        help="yes-no-maybe: final mean reward",
    )
    parser.add_argument(
        "--target-gain",
        type=float,
        default=ArithmeticRecipe.target_gain,
        help="arithmetic, distillation: held-out accuracy to gain over step 0 (absolute, 0.2 = 20 points)",
    )
    parser.add_argument(
        "--rl-max-steps",
        type=_positive_int,
        default=None,
        help=f"RL steps (default: yes-no-maybe {YesNoMaybeRecipe.rl_max_steps} at most, "
        f"arithmetic {ArithmeticRecipe.steps}; distillation: its steps, {DistillationRecipe.steps})",
    )
    parser.add_argument("--seed", type=int, default=YesNoMaybeRecipe.seed)
    parser.add_argument(
        "--data-dir", type=Path, default=None, help="keep the server state here (default: temp)"
    )


def main(args: argparse.Namespace) -> int:
    # The openai client's HTTP library logs every request at INFO (as `httpx`, or `httpx2` in the
    # versions that vendor it): the per-step lines are the demo's progress report.
    for name in ("httpx", "httpx2"):
        logging.getLogger(name).setLevel(logging.WARNING)
    return 0 if run_recipe(RECIPES[args.recipe](args)).passed else 1


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__)
    add_arguments(parser)
    sys.exit(main(parser.parse_args()))
