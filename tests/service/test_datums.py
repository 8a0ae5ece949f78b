"""The RL datums Train builds (datums.rl_batch), checked position by position without a server.

Layout of one sampled turn with prompt P (p tokens) and completion C (c tokens): the model reads
(P + C)[:-1] and predicts (P + C)[1:]; the sampler's logprobs and the trajectory's advantage sit on the c
positions whose target is a completion token, and every one of the p − 1 prompt positions carries 0.
"""

from __future__ import annotations

import math
from pathlib import Path

import pytest
import tinker
from svc import TINY, assistant, user
from tinker_cookbook.renderers import Message

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service.datums import rl_batch
from tinkerrpc_server.service.rendering import ROLE_NAMES, ChatCodec, ChatCodecs

VERSION = 3


@pytest.fixture(scope="module")
def codec(service_model_dir: Path) -> ChatCodec:
    return ChatCodecs(service_model_dir, allow_remote_tokenizers=False).get(TINY)


def _prompt(codec: ChatCodec, messages: list[types_pb2.Message]) -> list[int]:
    """The generation prompt straight from the cookbook renderer (text without control-token strings)."""
    conversation: list[Message] = [{"role": ROLE_NAMES[m.role], "content": m.content} for m in messages]
    return list(codec.renderer.build_generation_prompt(conversation).to_ints())


def _completion(codec: ChatCodec, text: str) -> list[int]:
    return list(codec.tokenizer.encode(text, add_special_tokens=False))


def _turn(prompt: list[int], completion: list[int], first_logprob: float) -> types_pb2.SampledTurn:
    """A sampled turn whose logprobs are distinct and exact in float32, so a value at the wrong position
    shows."""
    return types_pb2.SampledTurn(
        prompt_token_ids=prompt,
        completion_token_ids=completion,
        completion_logprobs=[first_logprob - 0.125 * i for i in range(len(completion))],
        policy_version=VERSION,
    )


def _request(
    *groups: list[tuple[float, list[types_pb2.SampledTurn]]], normalize_std: bool = False
) -> pb.TrainRequest:
    request = pb.TrainRequest(model="m", advantages=types_pb2.AdvantageOptions(normalize_std=normalize_std))
    for group in groups:
        added = request.groups.add()
        for reward, turns in group:
            added.trajectories.add(reward=reward, turns=turns)
    return request


def _columns(datum: tinker.types.Datum) -> tuple[list[int], list[int], list[float], list[float]]:
    inputs = datum.loss_fn_inputs
    for name in ("target_tokens", "logprobs", "advantages"):
        assert inputs[name].shape == [datum.model_input.length], name
    return (
        datum.model_input.to_ints(),
        [int(t) for t in inputs["target_tokens"].data],
        [float(v) for v in inputs["logprobs"].data],
        [float(v) for v in inputs["advantages"].data],
    )


def _assert_turn_layout(
    datum: tinker.types.Datum, prompt: list[int], turn: types_pb2.SampledTurn, advantage: float
) -> None:
    tokens = prompt + list(turn.completion_token_ids)
    inputs, targets, logprobs, advantages = _columns(datum)
    assert inputs == tokens[:-1]
    assert targets == tokens[1:]
    prompt_positions = len(prompt) - 1
    # Position i predicts tokens[i + 1]: the completion's j-th token is the target of position p − 1 + j.
    assert logprobs == [0.0] * prompt_positions + list(turn.completion_logprobs)
    assert advantages == pytest.approx(
        [0.0] * prompt_positions + [advantage] * len(turn.completion_token_ids)
    )


def test_a_single_turn_puts_logprobs_and_advantages_on_the_completion_targets(codec: ChatCodec) -> None:
    prompt = _prompt(codec, [user("respond with yes")])
    winner = _turn(prompt, _completion(codec, "yes it is"), -0.5)
    loser = _turn(prompt, _completion(codec, "no"), -2.0)
    assert len(winner.completion_token_ids) == 3 and len(loser.completion_token_ids) == 1

    batch = rl_batch(_request([(1.0, [winner]), (0.0, [loser])]), VERSION, codec)

    assert len(batch.datums) == 2
    _assert_turn_layout(batch.datums[0], prompt, winner, 0.5)
    _assert_turn_layout(batch.datums[1], prompt, loser, -0.5)
    assert batch.trained_tokens == 4 and batch.total_tokens == 2 * len(prompt) + 4
    assert batch.used == 2 and batch.staleness_histogram == {0: 2}


def test_each_turn_of_a_multi_turn_trajectory_gets_its_own_positions(codec: ChatCodec) -> None:
    """Turn 2's prompt holds turn 1's completion and the environment's reply: there they are prompt
    (zero), and only turn 2's own completion carries its logprobs."""
    conversation = [user("respond with yes")]
    first_prompt = _prompt(codec, conversation)
    first = _turn(first_prompt, _completion(codec, "maybe"), -0.25)
    environment = _completion(
        codec, "<|im_end|>\n<|im_start|>user\nnow say no<|im_end|>\n<|im_start|>assistant\n"
    )
    second_prompt = first_prompt + list(first.completion_token_ids) + environment
    second = _turn(second_prompt, _completion(codec, "no way"), -1.5)
    other_prompt = _prompt(codec, [user("respond with no")])
    other = _turn(other_prompt, _completion(codec, "yes"), -0.75)

    batch = rl_batch(_request([(2.0, [first, second]), (0.0, [other])]), VERSION, codec)

    assert len(batch.datums) == 3
    _assert_turn_layout(batch.datums[0], first_prompt, first, 1.0)
    _assert_turn_layout(batch.datums[1], second_prompt, second, 1.0)
    _assert_turn_layout(batch.datums[2], other_prompt, other, -1.0)
    assert batch.used == 2


def test_a_later_turn_without_prompt_ids_renders_the_conversation_before_its_own_assistant_message(
    codec: ChatCodec,
) -> None:
    messages = [user("respond with yes"), assistant("maybe"), user("now say no"), assistant("no")]
    first_prompt = _prompt(codec, messages[:1])
    second_prompt = _prompt(codec, messages[:3])
    assert second_prompt != first_prompt
    first = _turn([], _completion(codec, "maybe"), -0.25)
    second = _turn([], _completion(codec, "no"), -1.0)
    request = _request([(1.0, [first, second]), (0.0, [_turn(first_prompt, [7], -1.0)])])
    request.groups[0].trajectories[0].messages.extend(messages)

    batch = rl_batch(request, VERSION, codec)

    _assert_turn_layout(batch.datums[0], first_prompt, first, 0.5)
    _assert_turn_layout(batch.datums[1], second_prompt, second, 0.5)


@pytest.mark.parametrize("normalize_std", [False, True])
def test_advantages_are_the_reward_minus_its_group_mean_optionally_over_the_group_std(
    codec: ChatCodec, normalize_std: bool
) -> None:
    prompt = _prompt(codec, [user("respond with yes")])
    groups = [[1.0, 0.0, 0.5, 0.0], [3.0, 5.0]]
    request = _request(
        *[[(reward, [_turn(prompt, [7, 8], -1.0)]) for reward in rewards] for rewards in groups],
        normalize_std=normalize_std,
    )

    batch = rl_batch(request, VERSION, codec)

    expected = []
    for rewards in groups:
        mean = sum(rewards) / len(rewards)
        std = math.sqrt(sum((r - mean) ** 2 for r in rewards) / len(rewards))  # population std (ddof 0)
        expected += [(r - mean) / (std + 1e-6) if normalize_std else r - mean for r in rewards]
    if normalize_std:
        assert expected[:4] == pytest.approx([1.5076, -0.9045, 0.3015, -0.9045], abs=1e-4)
        assert expected[4:] == pytest.approx([-1.0, 1.0], abs=1e-5)
    else:
        assert expected == [0.625, -0.375, 0.125, -0.375, -1.0, 1.0]
    for datum, advantage in zip(batch.datums, expected, strict=True):
        _assert_turn_layout(datum, prompt, _turn(prompt, [7, 8], -1.0), advantage)
    assert batch.mean_reward == pytest.approx(9.5 / 6)
