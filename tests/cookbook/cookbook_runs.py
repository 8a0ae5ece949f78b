"""tinker-cookbook's own training loops, run as a user would run them against `tinkerrpc engine`.

`python cookbook_runs.py sft|rl|distill LOG_PATH --steps N` builds the cookbook's `Config` and calls its
`main`, unmodified (`distill`: distillation/train_off_policy.py, from a teacher's top-K); `rl-loop`
runs the cookbook's own recipes/rl_loop.py (0.6 and later) with stable_reinforce; `decisions` runs
recipes/decisions as its README does (it has no `main`). This file writes only what a recipe author writes: a config, an in-memory
dataset and a tiny `Env`, in the cookbook's interfaces. The engine comes from the environment, as
for any cookbook user: TINKER_BASE_URL and TINKER_API_KEY; the tokenizer is loaded by model name
(offline, from the Hugging Face cache the engine lays out).
"""

from __future__ import annotations

import argparse
import asyncio
import random
from collections.abc import Sequence
from typing import Any

import chz
import tinker
from tinker_cookbook import renderers
from tinker_cookbook.completers import StopCondition
from tinker_cookbook.rl import train as rl_train
from tinker_cookbook.rl.types import (
    Action,
    ActionExtra,
    Env,
    EnvGroupBuilder,
    Observation,
    RLDataset,
    RLDatasetBuilder,
    StepResult,
)
from tinker_cookbook.supervised import train as sl_train
from tinker_cookbook.supervised.data import conversation_to_datum
from tinker_cookbook.supervised.types import SupervisedDataset, SupervisedDatasetBuilder
from tinker_cookbook.tokenizer_utils import get_tokenizer

from tinkerrpc_server.model_store import ANSWER_WORDS, TINY_CHAT, answer_format_prompt

MODEL = TINY_CHAT
# The renderer named explicitly: the cookbook's model_info does not know tinkerrpc's built-in names.
RENDERER = "qwen3_disable_thinking"
LORA_RANK = 8
GROUPS_PER_BATCH = 4
# Printed each time the RL loop samples a training group (the async loop samples a requeued one again),
# so a test can account for every group the loop sampled.
TRAIN_GROUP_SAMPLED = "cookbook_runs: a training group sampled"


def _renderer() -> renderers.Renderer:
    return renderers.get_renderer(RENDERER, get_tokenizer(MODEL))


# ---- supervised: yes/no/maybe answers to prompts that ask for one ----


class ListDataset(SupervisedDataset):
    def __init__(self, batches: list[list[tinker.Datum]]) -> None:
        self.batches = batches

    def get_batch(self, index: int) -> list[tinker.Datum]:
        return self.batches[index]

    def __len__(self) -> int:
        return len(self.batches)


@chz.chz
class AnswerDatasetBuilder(SupervisedDatasetBuilder):
    steps: int
    batch_size: int = 8

    def __call__(self) -> tuple[SupervisedDataset, SupervisedDataset | None]:
        renderer = _renderer()
        rng = random.Random(0)

        def batch() -> list[tinker.Datum]:
            return [
                conversation_to_datum(
                    [
                        {"role": "user", "content": answer_format_prompt(rng)},
                        {"role": "assistant", "content": rng.choice(ANSWER_WORDS)},
                    ],
                    renderer,
                    max_length=256,
                )
                for _ in range(self.batch_size)
            ]

        return ListDataset([batch() for _ in range(self.steps)]), ListDataset([batch()])


def sft_config(log_path: str, steps: int, save_every: int, eval_every: int) -> sl_train.Config:
    return sl_train.Config(
        log_path=log_path,
        model_name=MODEL,
        recipe_name="tinkerrpc_cookbook_sft",
        renderer_name=RENDERER,
        dataset_builder=AnswerDatasetBuilder(steps=steps),
        learning_rate=5e-3,
        lr_schedule="constant",
        lora_rank=LORA_RANK,
        save_every=save_every,
        eval_every=eval_every,
    )


# ---- RL: a dense reward a random tiny model can climb — the share of sampled tokens with even ids ----


class EvenTokensEnv(Env):
    def __init__(self, renderer: renderers.Renderer, prompt: str) -> None:
        self.renderer = renderer
        self.prompt = prompt

    async def initial_observation(self) -> tuple[Observation, StopCondition]:
        model_input = self.renderer.build_generation_prompt([{"role": "user", "content": self.prompt}])
        return model_input, self.renderer.get_stop_sequences()

    async def step(self, action: Action, *, extra: ActionExtra | None = None) -> StepResult:
        reward = sum(1 for token in action if token % 2 == 0) / max(len(action), 1)
        return StepResult(
            reward=reward,
            episode_done=True,
            next_observation=tinker.ModelInput.empty(),
            next_stop_condition=self.renderer.get_stop_sequences(),
        )


class EvenTokensGroup(EnvGroupBuilder):
    def __init__(self, prompt: str, group_size: int, *, train: bool) -> None:
        self.prompt = prompt
        self.group_size = group_size
        self.train = train

    async def make_envs(self) -> Sequence[Env]:
        if self.train:
            print(TRAIN_GROUP_SAMPLED, flush=True)
        renderer = _renderer()
        return [EvenTokensEnv(renderer, self.prompt) for _ in range(self.group_size)]


class EvenTokensDataset(RLDataset):
    def __init__(self, batches: list[list[EnvGroupBuilder]]) -> None:
        self.batches = batches

    def get_batch(self, index: int) -> Sequence[EnvGroupBuilder]:
        return self.batches[index]

    def __len__(self) -> int:
        return len(self.batches)


@chz.chz
class EvenTokensDatasetBuilder(RLDatasetBuilder):
    steps: int
    groups_per_batch: int = GROUPS_PER_BATCH
    group_size: int = 16

    async def __call__(self) -> tuple[RLDataset, RLDataset | None]:
        rng = random.Random(0)

        def batch(train: bool) -> list[EnvGroupBuilder]:
            return [
                EvenTokensGroup(answer_format_prompt(rng), self.group_size, train=train)
                for _ in range(self.groups_per_batch)
            ]

        train = EvenTokensDataset([batch(train=True) for _ in range(self.steps)])
        return train, EvenTokensDataset([batch(train=False)])


def rl_config(
    log_path: str,
    steps: int,
    save_every: int,
    eval_every: int,
    off_policy: int = 0,
    loss_fn: str = "importance_sampling",
) -> rl_train.Config:
    """`off_policy` > 0: the async loop (AsyncConfig), sampling up to that many steps behind training."""
    async_config = (
        rl_train.AsyncConfig(max_steps_off_policy=off_policy, groups_per_batch=GROUPS_PER_BATCH)
        if off_policy > 0
        else None
    )
    return rl_train.Config(
        log_path=log_path,
        model_name=MODEL,
        recipe_name="tinkerrpc_cookbook_rl",
        renderer_name=RENDERER,
        dataset_builder=EvenTokensDatasetBuilder(steps=steps),
        learning_rate=4e-2,
        max_tokens=4,
        lora_rank=LORA_RANK,
        save_every=save_every,
        eval_every=eval_every,
        num_groups_to_log=0,
        async_config=async_config,
        loss_fn=loss_fn,
    )


# ---- recipes/rl_loop.py: the cookbook's minimal RL loop, its GSM8K data and reward made offline ----


def run_rl_loop_recipe(log_path: str, steps: int, save_every: int) -> None:
    """The recipe's `main` as it is, given what an offline tiny model needs: GSM8K-shaped rows in place
    of the hub download, the renderer its model_info cannot name, and a dense reward (the share of
    even code points; a random model never writes a boxed answer, so GSM8K's reward would skip every
    training step)."""
    import datasets
    from tinker_cookbook import model_info
    from tinker_cookbook.recipes import rl_loop

    batch_size = 2
    rng = random.Random(0)
    rows = [answer_format_prompt(rng) for _ in range(steps * batch_size)]
    train = datasets.Dataset.from_dict({"question": rows, "answer": ["#### 0"] * len(rows)})
    datasets.load_dataset = lambda *args, **kwargs: datasets.DatasetDict({"train": train})
    model_info.get_recommended_renderer_name = lambda model_name: RENDERER
    rl_loop.get_reward = lambda response, answer: (
        sum(1 for c in response if ord(c) % 2 == 0) / max(len(response), 1)
    )
    rl_loop.main(
        rl_loop.Config(
            log_path=log_path,
            model_name=MODEL,
            batch_size=batch_size,
            group_size=4,
            learning_rate=4e-2,
            lora_rank=LORA_RANK,
            save_every=save_every,
            max_tokens=4,
            loss_fn="stable_reinforce",
            max_steps=steps,
        )
    )


# ---- distillation/train_off_policy.py: a student learns the teacher's top-K next-token distribution ----


def distill_config(log_path: str, steps: int, save_every: int, teacher: str) -> Any:
    """The off-policy distillation loop's Config: the supervised answers above, the teacher's top-4 at
    every position as [N, 4] soft targets (topk_prompt_logprobs, then cross_entropy over [N, K])."""
    from tinker_cookbook.distillation import train_off_policy
    from tinker_cookbook.distillation.datasets import TeacherConfig

    return train_off_policy.Config(
        log_path=log_path,
        model_name=MODEL,
        recipe_name="tinkerrpc_cookbook_distill",
        renderer_name=RENDERER,
        dataset_configs=[
            train_off_policy.DatasetWithTeacher(
                dataset_builder=AnswerDatasetBuilder(steps=steps),
                teacher_config=TeacherConfig(base_model=MODEL, load_checkpoint_path=teacher),
            )
        ],
        learning_rate=5e-3,
        lora_rank=LORA_RANK,
        n_teacher_targets=4,
        batch_size=8,
        save_every=save_every,
        eval_every=0,
        max_steps=steps,
    )


# ---- recipes/decisions: a decision model trained on soft labels, scored by target_prompt_logprobs ----

DECISION_CHOICES = [("yes", "Agree"), ("no", "Disagree"), ("maybe", "Not sure")]
DECISION_TARGET = {"yes": 0.1, "no": 0.2, "maybe": 0.7}


async def run_decisions(log_path: str, steps: int) -> None:
    """The recipe's README loop: score a decision with `sample_decision` (target_prompt_logprobs at the
    answer position), train on its soft labels with `probability_loss` through forward_backward_custom
    ([N, K] target tokens), score again. Writes the probabilities before and after to LOG_PATH."""
    import json
    from pathlib import Path

    from tinker_cookbook.recipes.decisions import (
        Decision,
        DecisionRenderer,
        decision_dist_datums,
        probability_loss,
        sample_decision,
    )

    renderer = DecisionRenderer(_renderer())
    rng = random.Random(0)
    decisions = [Decision(answer_format_prompt(rng), DECISION_CHOICES) for _ in range(4)]
    service = tinker.ServiceClient()
    training = await service.create_lora_training_client_async(MODEL, rank=LORA_RANK, seed=0)

    async def scores() -> list[dict[str, float]]:
        sampler = await training.save_weights_and_get_sampling_client_async()
        return list(await asyncio.gather(*(sample_decision(sampler, renderer.render(d)) for d in decisions)))

    before = await scores()
    datums = decision_dist_datums(renderer, [(d, DECISION_TARGET) for d in decisions])
    loss = probability_loss(lambda probs, target: ((probs - target) ** 2).sum())
    losses = []
    for _ in range(steps):
        result = await (await training.forward_backward_custom_async(datums, loss)).result_async()
        await (await training.optim_step_async(tinker.AdamParams(learning_rate=2e-2))).result_async()
        losses.append(result.metrics["loss"])
    Path(log_path).write_text(json.dumps({"before": before, "after": await scores(), "losses": losses}))


def main() -> None:
    parser = argparse.ArgumentParser()
    parser.add_argument("loop", choices=["sft", "rl", "rl-loop", "distill", "decisions"])
    parser.add_argument("log_path")
    parser.add_argument("--steps", type=int, required=True)
    parser.add_argument("--save-every", type=int, default=2)
    parser.add_argument("--eval-every", type=int, default=2)
    parser.add_argument("--off-policy", type=int, default=0, help="rl: run the async loop (AsyncConfig)")
    parser.add_argument("--loss-fn", default="importance_sampling", help="rl: the loop's loss")
    parser.add_argument("--teacher", help="distill: the teacher's sampler checkpoint")
    args = parser.parse_args()
    if args.loop == "distill":
        from tinker_cookbook.distillation import train_off_policy

        asyncio.run(
            train_off_policy.main(distill_config(args.log_path, args.steps, args.save_every, args.teacher))
        )
    elif args.loop == "decisions":
        asyncio.run(run_decisions(args.log_path, args.steps))
    elif args.loop == "sft":
        asyncio.run(sl_train.main(sft_config(args.log_path, args.steps, args.save_every, args.eval_every)))
    elif args.loop == "rl-loop":
        run_rl_loop_recipe(args.log_path, args.steps, args.save_every)
    else:
        config = rl_config(
            args.log_path, args.steps, args.save_every, args.eval_every, args.off_policy, args.loss_fn
        )
        asyncio.run(rl_train.main(config))


if __name__ == "__main__":
    main()
