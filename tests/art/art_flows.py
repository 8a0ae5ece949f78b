"""ART's own yes-no-maybe flow against `tinkerrpc serve --sidecar-port`, through tinkerrpc.art; run by
test_art.py as a separate process, because `import art` patches transformers in its process (see
test_art.py).

The rollout and the training loop are ART's (its dev/yes-no-maybe example: `art.TrainableModel`,
`model.register(backend)`, `model.openai_client()`, `art.gather_trajectory_groups`,
`model.delete_checkpoints()`, `backend.train(...)`, `model.log(...)`); only the backend line is
tinkerrpc's, and the sizes are the tiny model's. ART's SFT path (`model.train_sft`) warms the random
tiny-chat model up first, as the demo's recipe does.

Usage: art_flows.py {yes-no-maybe|reregister} GRPC_TARGET ART_PATH; prints a JSON result, exits
non-zero when a check fails.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
from itertools import permutations
from typing import Any

import art
import openai
import pytest

import tinkerrpc
from tinkerrpc.art import TinkerRPCBackend
from tinkerrpc.art._trajectories import convert_groups

BASE_MODEL = "tinkerrpc/tiny-chat"
ANSWERS = ("yes", "no", "maybe")
TARGET_REWARD = 0.9
SFT_STEPS = 20
MAX_RL_STEPS = 30


# ART's yes-no-maybe example, as its docs write it (max_tokens sized for the tiny model's answers).
async def rollout(client: openai.AsyncOpenAI, model: art.TrainableModel, prompt: str) -> art.Trajectory:
    messages: art.Messages = [{"role": "user", "content": prompt}]
    chat_completion = await client.chat.completions.create(
        messages=messages, model=model.name, max_tokens=8, timeout=100
    )
    choice = chat_completion.choices[0]
    content = choice.message.content
    assert isinstance(content, str)
    if content == "yes":
        reward = 0.5
    elif content == "no":
        reward = 0.75
    elif content == "maybe":
        reward = 1.0
    else:
        reward = 0.0
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=reward)


def with_quotes(w: str) -> str:
    return f"'{w}'"


prompts = [
    f"{prefix} with {', '.join([with_quotes(w) if use_quotes else w for w in words]) if len(words) == 3 else f'{words[0]}' + (f' or {words[1]}' if len(words) > 1 else '')}"
    for prefix in ["respond", "just respond"]
    for use_quotes in [True, False]
    for words in [list(p) for n in [3, 2] for p in permutations(ANSWERS, n)]
]


def warm_up_trajectories(rng: random.Random, count: int) -> list[art.Trajectory]:
    """The demo's SFT recipe: every prompt answered with one of the three words, drawn uniformly."""
    return [
        art.Trajectory(
            messages_and_choices=[
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": rng.choice(ANSWERS)},
            ]
        )
        for prompt in rng.choices(prompts, k=count)
    ]


def mean_reward(groups: list[art.TrajectoryGroup]) -> float:
    rewards = [t.reward for g in groups for t in g.trajectories]
    return sum(rewards) / len(rewards)


def trainable_model() -> art.TrainableModel:
    return art.TrainableModel(
        name="yes-no-maybe-001",
        project="yes-no-maybe",
        base_model=BASE_MODEL,
        # ART's Tinker options: the renderer without a think block answers in two tokens.
        _internal_config={
            "tinker_native_args": {
                "renderer_name": "qwen3_disable_thinking",
                "training_client_args": {"rank": 8},
            }
        },
    )


async def yes_no_maybe(target: str, art_path: str) -> dict[str, Any]:
    rng = random.Random(0)
    backend = TinkerRPCBackend(target, path=art_path)
    model = trainable_model()
    await model.register(backend)

    await model.train_sft(
        warm_up_trajectories(rng, 32 * SFT_STEPS),
        config=art.TrainSFTConfig(learning_rate=1e-2, batch_size=32),
    )
    assert await model.get_step() == SFT_STEPS

    openai_client = model.openai_client()
    rewards, scored_tokens = [], []
    for _ in range(await model.get_step(), await model.get_step() + MAX_RL_STEPS):
        train_groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(openai_client, model, prompt) for _ in range(8))
                for prompt in rng.sample(prompts, 8)
            ),
            pbar_desc="gather",
        )
        rewards.append(mean_reward(train_groups))
        if rewards[-1] >= TARGET_REWARD:
            break
        await model.delete_checkpoints()
        result = await backend.train(model, train_groups, learning_rate=4e-3)
        scored_tokens.append(result.metrics["data/step_scored_tokens"])
        await model.log(train_groups, metrics=result.metrics, step=result.step, split="train")
        assert result.step == await model.get_step()
        assert model.get_inference_name() == f"{model.name}@{result.step}"
    await backend.close()
    # The rollouts asked for no logprobs: every Choice trained on the sampler's own, by its sample key.
    assert scored_tokens and not any(scored_tokens), scored_tokens
    return {
        "rewards": rewards,
        "inference_base_url": model.inference_base_url,
        "scored_tokens": scored_tokens,
    }


async def reregister_and_score(target: str, art_path: str) -> dict[str, Any]:
    backend = TinkerRPCBackend(target, path=art_path)
    # The same name with other Tinker options is refused, naming the differences.
    other = art.TrainableModel(name="yes-no-maybe-001", project="yes-no-maybe", base_model=BASE_MODEL)
    with pytest.raises(tinkerrpc.AlreadyExistsError, match="rank"):
        await other.register(backend)
    model = trainable_model()
    await model.register(backend)
    step = await model.get_step()
    assert step > SFT_STEPS, "register gets the model the test above trained"
    assert model.get_inference_name() == f"{model.name}@{step}"

    # A Choice with the sidecar's logprobs trains as sampled; the same Choice without them names the
    # server's copy of those logprobs by its sample key.
    messages: art.Messages = [{"role": "user", "content": "respond with yes, no or maybe"}]
    completion = await model.openai_client().chat.completions.create(
        messages=messages,
        model=model.get_inference_name(),
        max_tokens=8,
        logprobs=True,
        n=2,
        seed=3,
        # ART 0.5.18 gives its client an httpx timeout that openai >= 3 (httpx2) cannot use: a request
        # needs its own, as ART's example passes.
        timeout=100,
    )
    with_logprobs = [art.Trajectory(messages_and_choices=[*messages, c]) for c in completion.choices]
    stripped = [c.model_copy(update={"logprobs": None}) for c in completion.choices]
    without = [art.Trajectory(messages_and_choices=[*messages, c]) for c in stripped]
    (sampled,) = convert_groups([art.TrajectoryGroup(with_logprobs)])
    (keyed,) = convert_groups([art.TrajectoryGroup(without)])
    for as_sampled, as_keyed, choice in zip(
        sampled.trajectories, keyed.trajectories, completion.choices, strict=True
    ):
        (turn,) = as_sampled.turns
        (named,) = as_keyed.turns
        assert turn.completion_token_ids == named.completion_token_ids == tuple(choice.token_ids)  # type: ignore[attr-defined]
        assert len(turn.logprobs) == len(turn.completion_token_ids) and named.logprobs == ()
        assert named.sample_key == turn.sample_key == choice.sample_key  # type: ignore[attr-defined]
        assert as_sampled.messages == as_keyed.messages

    # A group whose rewards are all equal carries no signal: no step is taken.
    flat = await backend.train(model, [art.TrajectoryGroup(with_logprobs)], learning_rate=4e-3)
    assert flat.step == step == await model.get_step()
    assert flat.metrics["data/step_num_groups_trainable"] == 0

    # ART's delete_checkpoints (through _delete_checkpoint_files) keeps the latest version's files only
    # (no "val/reward" was logged to pick a best one).
    await model.delete_checkpoints()
    async with tinkerrpc.AsyncClient(target) as client:
        listed = await client.model(model.name).checkpoints()
    assert {(c.kind, c.policy_version) for c in listed} == {("sampler", step), ("state", step)}
    await backend.close()
    return {"step": step}


FLOWS = {"yes-no-maybe": yes_no_maybe, "reregister": reregister_and_score}

if __name__ == "__main__":
    flow, target, art_path = sys.argv[1:]
    print(json.dumps(asyncio.run(FLOWS[flow](target, art_path))))
