"""ART's own yes-no-maybe flow, through tinkerrpc.art against `tinkerrpc serve --sidecar-port` and
through ART's TinkerNativeBackend (unmodified) against `tinkerrpc engine`; run by test_art.py and
bench/art_seed.py as a separate process, because `import art` patches transformers in its process (see
test_art.py).

The rollout and the training loop are ART's (its dev/yes-no-maybe example: `art.TrainableModel`,
`model.register(backend)`, `model.openai_client()`, `art.gather_trajectory_groups`,
`model.delete_checkpoints()`, `backend.train(...)`, `model.log(...)`) on the task as the demo defines it
(recipes/yes_no_maybe/task.py: its prompts and rewards); only the backend line differs between the
flows, and the sizes are the tiny model's. The random tiny-chat model is warmed up first, as
the demo's recipe does: through ART's SFT path (`model.train_sft`) on tinkerrpc.art; through the
TinkerNativeBackend's raw tinker training client on the seed, whose `train_sft` raises
NotImplementedError.

Usage: art_flows.py {yes-no-maybe|reregister|sft-schedule|retrain-after-restore} ART_PATH GRPC_TARGET, or art_flows.py seed-yes-no-maybe
ART_PATH with TINKER_BASE_URL / TINKER_API_KEY naming the engine; prints a JSON result (with the flow's
timings), exits non-zero when a check fails.
"""

from __future__ import annotations

import asyncio
import json
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from typing import Any

import art
import openai
import pytest
import tinker
from art.tinker_native import TinkerNativeBackend
from art.tinker_native.backend import STATE_KEY_RUN_IDS
from tinker_cookbook.supervised.common import datum_from_model_input_weights

import tinkerrpc
from tinkerrpc.art import TinkerRPCBackend
from tinkerrpc.art._trajectories import convert_groups
from tinkerrpc_server.model_store import TINY_CHAT
from tinkerrpc_server.recipes.yes_no_maybe.task import ANSWERS, prompts, reward_of

BASE_MODEL = TINY_CHAT
TARGET_REWARD = 0.9
SFT_STEPS = 20
SFT_BATCH_SIZE = 32
SFT_LEARNING_RATE = 1e-2
RL_LEARNING_RATE = 4e-3
MAX_RL_STEPS = 30


# ART's yes-no-maybe example, as its docs write it (max_tokens sized for the tiny model's answers; the
# model named by its inference name, model@step, which the TinkerNativeBackend's server requires).
async def rollout(client: openai.AsyncOpenAI, model: art.TrainableModel, prompt: str) -> art.Trajectory:
    messages: art.Messages = [{"role": "user", "content": prompt}]
    chat_completion = await client.chat.completions.create(
        messages=messages, model=model.get_inference_name(), max_tokens=8, timeout=100
    )
    choice = chat_completion.choices[0]
    # The TinkerNativeBackend's server answers an empty completion with no content.
    reward = reward_of(choice.message.content or "")
    return art.Trajectory(messages_and_choices=[*messages, choice], reward=reward)


PROMPTS = prompts()


def warm_up_trajectories(rng: random.Random, count: int) -> list[art.Trajectory]:
    """The demo's SFT recipe: every prompt answered with one of the three words, drawn uniformly."""
    return [
        art.Trajectory(
            messages_and_choices=[
                {"role": "user", "content": prompt},
                {"role": "assistant", "content": rng.choice(ANSWERS)},
            ]
        )
        for prompt in rng.choices(PROMPTS, k=count)
    ]


def mean_reward(groups: list[art.TrajectoryGroup]) -> float:
    rewards = [t.reward for g in groups for t in g.trajectories]
    return sum(rewards) / len(rewards)


def trainable_model(**fields: Any) -> art.TrainableModel:
    """The flows' model; `fields`: more TrainableModel fields (ART 0.5.23 requires run_name)."""
    return art.TrainableModel(
        **fields,
        name="yes-no-maybe-001",
        project="yes-no-maybe",
        base_model=BASE_MODEL,
        # ART's Tinker options: the renderer without a think block answers in two tokens; the LoRA init
        # pinned (Tinker and the seed leave it random, and some draws never reach the target).
        _internal_config={
            "tinker_native_args": {
                "renderer_name": "qwen3_disable_thinking",
                "training_client_args": {"rank": 8, "seed": 0, "train_unembed": True},
            }
        },
    )


@dataclass
class RLRun:
    """One flow's RL steps: the mean reward of each step's rollouts, and the seconds each step's rollouts
    and Train took (a step whose rollouts reach the target trains no more); `seconds_to_target` counts
    from before register to the rollouts that reached it (None when none did)."""

    rewards: list[float] = field(default_factory=list)
    rollout_seconds: list[float] = field(default_factory=list)
    train_seconds: list[float] = field(default_factory=list)
    train_metrics: list[dict[str, float]] = field(default_factory=list)
    seconds_to_target: float | None = None


async def rl_until_target(
    model: art.TrainableModel, backend: art.Backend, rng: random.Random, started: float
) -> RLRun:
    """ART's RL loop: 8 prompts x 8 rollouts a step, CISPO (ART's default loss), until the rollouts'
    mean reward reaches the target or MAX_RL_STEPS steps have trained."""
    openai_client = model.openai_client()
    run = RLRun()
    for _ in range(MAX_RL_STEPS + 1):
        rollouts_started = time.perf_counter()
        train_groups = await art.gather_trajectory_groups(
            (
                art.TrajectoryGroup(rollout(openai_client, model, prompt) for _ in range(8))
                for prompt in rng.sample(PROMPTS, 8)
            ),
            pbar_desc="gather",
        )
        run.rollout_seconds.append(time.perf_counter() - rollouts_started)
        run.rewards.append(mean_reward(train_groups))
        if run.rewards[-1] >= TARGET_REWARD:
            run.seconds_to_target = time.perf_counter() - started
            break
        if len(run.train_seconds) == MAX_RL_STEPS:
            break
        await model.delete_checkpoints()
        train_started = time.perf_counter()
        result = await backend.train(model, train_groups, learning_rate=RL_LEARNING_RATE)
        run.train_seconds.append(time.perf_counter() - train_started)
        run.train_metrics.append(result.metrics)
        await model.log(train_groups, metrics=result.metrics, step=result.step, split="train")
        assert result.step == await model.get_step()
        assert model.get_inference_name() == f"{model.name}@{result.step}"
    return run


async def yes_no_maybe(art_path: str, target: str) -> dict[str, Any]:
    started = time.perf_counter()
    rng = random.Random(0)
    backend = TinkerRPCBackend(target, path=art_path)
    model = trainable_model()
    await model.register(backend)

    sft_started = time.perf_counter()
    await model.train_sft(
        warm_up_trajectories(rng, SFT_BATCH_SIZE * SFT_STEPS),
        config=art.TrainSFTConfig(learning_rate=SFT_LEARNING_RATE, batch_size=SFT_BATCH_SIZE),
    )
    sft_seconds = time.perf_counter() - sft_started
    assert await model.get_step() == 1, "ART's SFT ends in one checkpoint"

    run = await rl_until_target(model, backend, rng, started)
    await backend.close()
    # The rollouts asked for no logprobs: every Choice trained on the sampler's own, by its sample key.
    scored_tokens = [m["data/step_scored_tokens"] for m in run.train_metrics]
    assert scored_tokens and not any(scored_tokens), scored_tokens
    return {
        **asdict(run),
        "sft_seconds": sft_seconds,
        "inference_base_url": model.inference_base_url,
        "scored_tokens": scored_tokens,
    }


def answer_datum(trajectory: art.Trajectory, renderer: Any) -> tinker.Datum:
    """A warm-up conversation as the seed samples and trains it in RL: the renderer's generation prompt
    (with its empty think block) and, trained, the answer and its stop token."""
    messages = trajectory.messages_and_choices
    model_input, weights = renderer.build_supervised_example(messages)
    weights[: renderer.build_generation_prompt(messages[:-1]).length] = 0
    return datum_from_model_input_weights(model_input, weights)


async def warm_up_raw(training_client: tinker.TrainingClient, renderer: Any, rng: random.Random) -> None:
    """The demo's SFT recipe (same trajectories, batches and learning rate as ART's SFT path above) as
    cross-entropy steps on a raw tinker training client, saved as the step the seed resumes from."""
    trajectories = warm_up_trajectories(rng, SFT_BATCH_SIZE * SFT_STEPS)
    adam = tinker.AdamParams(learning_rate=SFT_LEARNING_RATE)
    for start in range(0, len(trajectories), SFT_BATCH_SIZE):
        batch = [answer_datum(t, renderer) for t in trajectories[start : start + SFT_BATCH_SIZE]]
        trained = training_client.forward_backward(batch, loss_fn="cross_entropy")
        stepped = training_client.optim_step(adam)
        await trained
        await stepped
    # The seed's checkpoint names: step N's training state and sampler weights.
    name = f"step_{SFT_STEPS:06d}"
    saved = [training_client.save_state(name), training_client.save_weights_for_sampler(name)]
    for future in saved:
        await future


async def engine_checkpoints(rest_client: tinker.RestClient, run_ids: list[str]) -> set[str]:
    """Every checkpoint the engine lists for the runs, as the tinker paths the seed names them by."""
    return {
        f"tinker://{run_id}/{c.checkpoint_id}"
        for run_id in run_ids
        for c in (await rest_client.list_checkpoints(run_id)).checkpoints
    }


async def seed_yes_no_maybe(art_path: str) -> dict[str, Any]:
    """The same flow through ART's TinkerNativeBackend, which finds the engine by TINKER_BASE_URL and
    TINKER_API_KEY alone: warmed up through its raw training client, then resumed by a fresh backend from
    the saved step by its own register, RL, then its checkpoints against the engine's list."""
    started = time.perf_counter()
    rng = random.Random(0)
    backend = TinkerNativeBackend(path=art_path)
    model = trainable_model()
    await model.register(backend)
    with pytest.raises(NotImplementedError):
        await model.train_sft(warm_up_trajectories(random.Random(), 1))
    state = backend._model_state[model.name]
    sft_started = time.perf_counter()
    await warm_up_raw(state.training_client, state.renderer, rng)
    sft_seconds = time.perf_counter() - sft_started
    await backend.close()

    backend = TinkerNativeBackend(path=art_path)
    model = trainable_model()
    await model.register(backend)
    assert await model.get_step() == SFT_STEPS, "register resumes from the warmed-up state"
    run = await rl_until_target(model, backend, rng, started)

    state = backend._model_state[model.name]
    rest_client = tinker.RestClient()
    run_ids = list(model.read_state()[STATE_KEY_RUN_IDS])
    # The engine may list more than the seed recorded: the seed's step pattern skips the sampler
    # checkpoints of earlier runs ("sampler_weights/step_N") and saves the resumed step's again.
    listed = await engine_checkpoints(rest_client, run_ids)
    recorded = {*state.sampler_checkpoint_paths.values(), *state.training_checkpoint_paths.values()}
    assert recorded <= listed, recorded - listed
    # ART's delete_checkpoints on the seed deletes nothing ("not yet implemented"): its user deletes
    # through the tinker SDK, here every sampler but the current step's.
    await model.delete_checkpoints()
    assert await engine_checkpoints(rest_client, run_ids) == listed
    doomed = {p for step, p in state.sampler_checkpoint_paths.items() if step != state.current_step}
    for path in doomed:
        await rest_client.delete_checkpoint_from_tinker_path(path)
    assert await engine_checkpoints(rest_client, run_ids) == listed - doomed
    assert state.sampler_checkpoint_paths[state.current_step] in listed - doomed
    await backend.close()
    return {
        **asdict(run),
        "sft_seconds": sft_seconds,
        "inference_base_url": model.inference_base_url,
        "deleted": len(doomed),
    }


async def reregister_and_score(art_path: str, target: str) -> dict[str, Any]:
    backend = TinkerRPCBackend(target, path=art_path)
    # The same name with other Tinker options is refused, naming the differences.
    other = art.TrainableModel(name="yes-no-maybe-001", project="yes-no-maybe", base_model=BASE_MODEL)
    with pytest.raises(tinkerrpc.AlreadyExistsError, match="rank"):
        await other.register(backend)
    model = trainable_model()
    await model.register(backend)
    step = await model.get_step()
    assert step > 1, "register gets the model the test above trained"
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
    (sampled,) = convert_groups([art.TrajectoryGroup(with_logprobs)], model.name)
    (keyed,) = convert_groups([art.TrajectoryGroup(without)], model.name)
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
    flat = await backend.train(model, [art.TrajectoryGroup(with_logprobs)], learning_rate=RL_LEARNING_RATE)
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


# ART's train_sft with a learning rate per batch of 4: six batches.
SFT_RATES = [1e-3 * (index + 1) for index in range(6)]


async def scheduled_sft(
    art_path: str, target: str, project: str
) -> tuple[TinkerRPCBackend, art.TrainableModel]:
    """A model of `project` registered on TinkerRPCBackend, warmed up by ART's train_sft over
    len(SFT_RATES) batches of 4, each at its rate of SFT_RATES."""
    backend = TinkerRPCBackend(target, path=art_path)
    model = art.TrainableModel(name=f"{project}-001", project=project, base_model=BASE_MODEL)
    await model.register(backend)
    await model.train_sft(
        warm_up_trajectories(random.Random(1), 4 * len(SFT_RATES)),
        config=art.TrainSFTConfig(learning_rate=SFT_RATES, batch_size=4),
    )
    return backend, model


async def sft_schedule(art_path: str, target: str) -> dict[str, Any]:
    """ART's train_sft with a learning rate per batch: as ART's own backends end an SFT run in one
    checkpoint, the batches are the minibatches of one Train: one version, one loss per batch, each batch
    stepped at its own rate."""
    backend, model = await scheduled_sft(art_path, target, "sft-order")
    rates = SFT_RATES
    assert await model.get_step() == 1
    async with tinkerrpc.AsyncClient(target) as client:
        (step,) = (await client.model(model.name).history()).steps
    assert step.policy_version == 1
    assert step.metrics.trajectories_used == 4 * len(rates)
    assert len(step.metrics.minibatch_losses) == len(rates)
    assert step.metrics.loss == pytest.approx(sum(step.metrics.minibatch_losses))
    await backend.close()
    return {"minibatches": len(step.metrics.minibatch_losses)}


async def retrain_after_restore(art_path: str, target: str) -> dict[str, Any]:
    """train(save_checkpoint=True) to versions 1 and 2, a restore to version 1, then a train to version 2
    again: its art-step-000002 replaces the one the restore discarded (a newer state of that name, the
    only one), as ART's own backends overwrite a step's checkpoint."""
    backend = TinkerRPCBackend(target, path=art_path)
    model = art.TrainableModel(name="restore-001", project="restore", base_model=BASE_MODEL)
    await model.register(backend)
    messages: art.Messages = [{"role": "user", "content": "respond with yes, no or maybe"}]

    async def train_saving() -> int:
        completion = await model.openai_client().chat.completions.create(
            messages=messages, model=model.get_inference_name(), max_tokens=8, n=2, seed=5, timeout=100
        )
        group = art.TrajectoryGroup(
            art.Trajectory(messages_and_choices=[*messages, choice], reward=float(index))
            for index, choice in enumerate(completion.choices)
        )
        result = await backend.train(model, [group], learning_rate=RL_LEARNING_RATE, save_checkpoint=True)
        return result.step

    async def art_states() -> list[tinkerrpc.CheckpointInfo]:
        listed = await client.model(model.name).checkpoints()
        return [c for c in listed if c.kind == "state" and c.name.startswith("art-step-")]

    async with tinkerrpc.AsyncClient(target) as client:
        assert [await train_saving(), await train_saving()] == [1, 2]
        discarded = {c.name: c for c in await art_states()}
        assert {name: c.policy_version for name, c in discarded.items()} == {
            "art-step-000001": 1,
            "art-step-000002": 2,
        }
        restored = await client.model(model.name).restore("art-step-000001")
        assert restored.policy_version == 1 == await model.get_step()
        assert await train_saving() == 2
        states = {c.name: c for c in await art_states()}
    assert {name: c.policy_version for name, c in states.items()} == {
        "art-step-000001": 1,
        "art-step-000002": 2,
    }
    assert states["art-step-000001"] == discarded["art-step-000001"]
    replaced, before = states["art-step-000002"], discarded["art-step-000002"]
    assert replaced.tinker_path != before.tinker_path
    assert replaced.create_time and before.create_time and replaced.create_time > before.create_time
    step = await model.get_step()
    await backend.close()
    return {"step": step}


async def sft_split(art_path: str, target: str) -> dict[str, Any]:
    """ART's train_sft against a server whose per-Train token limit is below the whole warm-up: the
    refused Train goes again as Trains of half as many batches, every batch trained once, in order."""
    backend, model = await scheduled_sft(art_path, target, "sft-split")
    rates = SFT_RATES
    async with tinkerrpc.AsyncClient(target) as client:
        steps = (await client.model(model.name).history()).steps
        limit = (await client.server_info()).limits.max_train_tokens
    await backend.close()
    assert await model.get_step() == len(steps) > 1
    assert sum(len(s.metrics.minibatch_losses) for s in steps) == len(rates)
    assert sum(s.metrics.trajectories_used for s in steps) == 4 * len(rates)
    assert all(s.metrics.total_tokens <= limit for s in steps)
    # Each Train starts at the first rate of its own batches.
    firsts = [sum(len(t.metrics.minibatch_losses) for t in steps[:i]) for i in range(len(steps))]
    assert [s.metrics.learning_rate for s in steps] == pytest.approx([rates[f] for f in firsts])
    return {"trains": len(steps), "tokens": [s.metrics.total_tokens for s in steps]}


FLOWS = {
    "retrain-after-restore": retrain_after_restore,
    "sft-schedule": sft_schedule,
    "sft-split": sft_split,
    "yes-no-maybe": yes_no_maybe,
    "reregister": reregister_and_score,
    "seed-yes-no-maybe": seed_yes_no_maybe,
}

if __name__ == "__main__":
    flow, art_path, *args = sys.argv[1:]
    print(json.dumps(asyncio.run(FLOWS[flow](art_path, *args))))
