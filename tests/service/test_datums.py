"""The RL datums Train builds (datums.rl_batch), checked position by position without a server.

Layout of one sampled turn with prompt P (p tokens) and completion C (c tokens): the model reads
(P + C)[:-1] and predicts (P + C)[1:]; the sampler's logprobs and the trajectory's advantage sit on the c
positions whose target is a completion token, and every one of the p − 1 prompt positions carries 0.
Turns whose prompt continues the previous turn's sequence merge into one datum of the later sequence
(that layout here; that it trains exactly as the separate datums: test_merged_turns.py).
"""

from __future__ import annotations

import dataclasses
import math
from pathlib import Path

import pytest
import tinker
from svc import TINY, assistant, user
from tinker_cookbook.renderers import Message

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service.datums import RenderedPrompts, rl_batch, sft_batch, turn_prompt
from tinkerrpc_server.service.rendering import ROLE_NAMES, ChatCodec, ChatCodecs

pytestmark = pytest.mark.unit

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


def _two_turns(codec: ChatCodec) -> tuple[types_pb2.SampledTurn, types_pb2.SampledTurn, list[int]]:
    """Turn 2's prompt is turn 1's prompt and completion followed by the environment's reply; returns both
    turns and the reply's tokens."""
    first_prompt = _prompt(codec, [user("respond with yes")])
    first = _turn(first_prompt, _completion(codec, "maybe"), -0.25)
    environment = _completion(
        codec, "<|im_end|>\n<|im_start|>user\nnow say no<|im_end|>\n<|im_start|>assistant\n"
    )
    second_prompt = first_prompt + list(first.completion_token_ids) + environment
    return first, _turn(second_prompt, _completion(codec, "no way"), -1.5), environment


def test_each_turn_of_a_multi_turn_trajectory_gets_its_own_positions_when_merging_is_off(
    codec: ChatCodec,
) -> None:
    """Turn 2's prompt holds turn 1's completion and the environment's reply: there they are prompt
    (zero), and only turn 2's own completion carries its logprobs."""
    first, second, _ = _two_turns(codec)
    other_prompt = _prompt(codec, [user("respond with no")])
    other = _turn(other_prompt, _completion(codec, "yes"), -0.75)

    batch = rl_batch(_request([(2.0, [first, second]), (0.0, [other])]), VERSION, codec, merge_turns=False)

    assert len(batch.datums) == 3
    _assert_turn_layout(batch.datums[0], list(first.prompt_token_ids), first, 1.0)
    _assert_turn_layout(batch.datums[1], list(second.prompt_token_ids), second, 1.0)
    _assert_turn_layout(batch.datums[2], other_prompt, other, -1.0)
    assert batch.used == 2


def test_a_turn_that_continues_the_previous_one_merges_into_one_datum_with_each_span_in_place(
    codec: ChatCodec,
) -> None:
    """One datum of turn 2's whole sequence: turn 1's logprobs and advantage on turn 1's completion
    targets, zeros on the reply between, turn 2's on its own completion."""
    first, second, environment = _two_turns(codec)
    other_prompt = _prompt(codec, [user("respond with no")])
    other = _turn(other_prompt, _completion(codec, "yes"), -0.75)

    batch = rl_batch(_request([(2.0, [first, second]), (0.0, [other])]), VERSION, codec)

    assert len(batch.datums) == 2
    tokens = list(second.prompt_token_ids) + list(second.completion_token_ids)
    inputs, targets, logprobs, advantages = _columns(batch.datums[0])
    assert inputs == tokens[:-1] and targets == tokens[1:]
    first_positions = len(first.prompt_token_ids) - 1
    between = [0.0] * len(environment)
    assert logprobs == (
        [0.0] * first_positions + list(first.completion_logprobs) + between + list(second.completion_logprobs)
    )
    completions = len(first.completion_token_ids), len(second.completion_token_ids)
    assert advantages == [0.0] * first_positions + [1.0] * completions[0] + between + [1.0] * completions[1]
    _assert_turn_layout(batch.datums[1], other_prompt, other, -1.0)
    assert batch.trained_tokens == sum(completions) + 1 and batch.used == 2
    assert batch.total_tokens == len(tokens) + len(other_prompt) + 1


def test_a_turn_whose_prompt_does_not_continue_the_previous_one_starts_a_new_datum(
    codec: ChatCodec,
) -> None:
    """Turn 2 continues turn 1 and merges; turn 3's prompt drops turn 2's completion (as a renderer that
    strips earlier thinking would), so it is a datum of its own; turn 4 continues turn 3 and merges."""
    first, second, environment = _two_turns(codec)
    second_tokens = list(second.prompt_token_ids) + list(second.completion_token_ids)
    third_prompt = list(second.prompt_token_ids) + environment
    third = _turn(third_prompt, _completion(codec, "fine"), -0.5)
    fourth = _turn(
        third_prompt + list(third.completion_token_ids) + environment, _completion(codec, "ok"), -0.75
    )
    turns = [first, second, third, fourth]
    request = _request([(1.0, turns), (0.0, [_turn(list(first.prompt_token_ids), [7], -1.0)])])

    merged = rl_batch(request, VERSION, codec)
    separate = rl_batch(request, VERSION, codec, merge_turns=False)

    assert [d.model_input.to_ints() for d in merged.datums[:2]] == [
        second_tokens[:-1],
        separate.datums[3].model_input.to_ints(),
    ]
    assert len(merged.datums) == 3 and len(separate.datums) == 5
    assert merged.trained_tokens == separate.trained_tokens
    assert (
        merged.total_tokens
        == len(second_tokens) + len(fourth.prompt_token_ids) + 2 + len(first.prompt_token_ids) + 1
    )


def test_dro_keeps_one_datum_per_turn(codec: ChatCodec) -> None:
    first, second, _ = _two_turns(codec)
    request = _request([(1.0, [first, second]), (0.0, [first, second])])
    request.loss.function = types_pb2.LOSS_FUNCTION_DRO

    batch = rl_batch(request, VERSION, codec)

    assert len(batch.datums) == 4
    _assert_turn_layout(batch.datums[0], list(first.prompt_token_ids), first, 0.5)
    _assert_turn_layout(batch.datums[1], list(second.prompt_token_ids), second, 0.5)


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

    batch = rl_batch(request, VERSION, codec, merge_turns=False)

    _assert_turn_layout(batch.datums[0], first_prompt, first, 0.5)
    _assert_turn_layout(batch.datums[1], second_prompt, second, 0.5)


def test_a_conversation_shared_by_trajectories_renders_once_per_request(codec: ChatCodec) -> None:
    """A group's trajectories share their prompt: it renders once, and each turn gets it whole; another
    conversation (other messages, or the same messages up to another assistant message) renders anew."""
    rendered: RenderedPrompts = {}
    one = [user("respond with yes"), assistant("maybe")]
    other = [user("respond with no"), assistant("no")]
    trajectories = [types_pb2.Trajectory(messages=m, turns=[_turn([], [7], -1.0)]) for m in (one, one, other)]
    prompts = [turn_prompt(t, 0, codec, rendered) for t in trajectories]
    assert prompts == [_prompt(codec, one[:1]), _prompt(codec, one[:1]), _prompt(codec, other[:1])]
    assert len(rendered) == 2
    prompts[0].append(99)  # each turn's prompt is its own list
    assert turn_prompt(trajectories[1], 0, codec, rendered) == prompts[1]
    two_turns = types_pb2.Trajectory(
        messages=[*one, user("now say no"), assistant("no")], turns=[_turn([], [7], -1.0)] * 2
    )
    assert turn_prompt(two_turns, 0, codec, rendered) == prompts[1] and len(rendered) == 2
    assert turn_prompt(two_turns, 1, codec, rendered) == _prompt(codec, two_turns.messages[:3])
    assert len(rendered) == 3


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


def test_identical_supervised_examples_render_once_and_train_as_each_alone(codec: ChatCodec) -> None:
    yes = types_pb2.SupervisedExample(messages=[user("respond with yes"), assistant("yes")])
    no = types_pb2.SupervisedExample(messages=[user("respond with yes"), assistant("no")])
    rendered: list[object] = []
    render = codec.supervised_examples

    def counting(*args: object) -> list[tuple[list[int], list[float]]]:
        rendered.append(args)
        return render(*args)  # type: ignore[arg-type]

    examples = [yes, no, yes, yes, no]
    counting_codec = dataclasses.replace(codec, _variants={})
    object.__setattr__(counting_codec, "supervised_examples", counting)

    batch = sft_batch(pb.TrainRequest(examples=examples), counting_codec)

    assert len(rendered) == 2
    alone = [sft_batch(pb.TrainRequest(examples=[e]), codec).datums[0] for e in examples]
    assert [d.model_input.to_ints() for d in batch.datums] == [d.model_input.to_ints() for d in alone]
    assert [d.loss_fn_inputs["weights"].tolist() for d in batch.datums] == [
        d.loss_fn_inputs["weights"].tolist() for d in alone
    ]
    assert batch.example_ends == [1, 2, 3, 4, 5]
