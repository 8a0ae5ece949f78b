"""The sampler/learner mismatch an RL step reports (service/mismatch.py), checked against a reference
computed here token by token, and over the sampled positions of real datums (datums.rl_batch) only."""

from __future__ import annotations

import math
import random
from pathlib import Path

import numpy as np
import pytest
import tinker
from mismatch_reference import reference_mismatch, reported_mismatch
from svc import TINY, user
from tinker_cookbook.renderers import Message

from tinkerrpc.contract.limits import MISMATCH_RATIO_MAX, MISMATCH_RATIO_MIN
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service.datums import rl_batch, sft_batch
from tinkerrpc_server.service.mismatch import mismatch_of, sampler_mismatch
from tinkerrpc_server.service.rendering import ROLE_NAMES, ChatCodec, ChatCodecs

pytestmark = pytest.mark.unit


def test_the_figures_equal_a_token_by_tokenreference_mismatch() -> None:
    rng = random.Random(7)
    sampler = [-rng.uniform(0.0, 6.0) for _ in range(500)]
    learner = [q + rng.gauss(0.0, 0.5) for q in sampler]

    mismatch = mismatch_of(np.asarray(learner) - np.asarray(sampler))

    expected = reference_mismatch(learner, sampler)
    assert reported_mismatch(mismatch) == pytest.approx(expected, rel=1e-12)
    assert mismatch.tokens == 500
    # The draw puts some tokens past each bound: the fraction is neither 0 nor 1.
    assert 0.05 < mismatch.outside_fraction < 0.5


def test_equal_logprobs_give_zero_kl_and_unit_ratios_and_a_known_shift_its_exactreported_mismatch() -> None:
    same = mismatch_of(np.zeros(10))
    assert reported_mismatch(same) == {
        "kl": 0.0,
        "mean_ratio": 1.0,
        "max_ratio": 1.0,
        "outside_fraction": 0.0,
    }
    # d = ln 3 on every token: ratio 3 (past MISMATCH_RATIO_MAX), k3 = 3 − 1 − ln 3.
    shifted = mismatch_of(np.full(4, math.log(3.0)))
    assert reported_mismatch(shifted) == pytest.approx(
        {"kl": 2.0 - math.log(3.0), "mean_ratio": 3.0, "max_ratio": 3.0, "outside_fraction": 1.0}
    )
    # The bounds themselves are inside.
    at_bounds = mismatch_of(np.log([MISMATCH_RATIO_MIN, MISMATCH_RATIO_MAX]))
    assert at_bounds.outside_fraction == 0.0


@pytest.fixture(scope="module")
def codec(service_model_dir: Path) -> ChatCodec:
    return ChatCodecs(service_model_dir, allow_remote_tokenizers=False).get(TINY)


def _prompt(codec: ChatCodec, text: str) -> list[int]:
    conversation: list[Message] = [{"role": ROLE_NAMES[types_pb2.ROLE_USER], "content": text}]
    return list(codec.renderer.build_generation_prompt(conversation).to_ints())


def _tokens(codec: ChatCodec, text: str) -> list[int]:
    return list(codec.tokenizer.encode(text, add_special_tokens=False))


def _learner_outputs(
    datums: list[tinker.types.Datum], learner_of: dict[tuple[int, int], float]
) -> list[dict[str, tinker.types.TensorData]]:
    """Per datum, a learner logprob at every position: learner_of[(datum, position)] where given and
    −7 elsewhere (prompt positions: far from the sampler's 0 there, so counting them would show)."""
    outputs = []
    for d, datum in enumerate(datums):
        values = [learner_of.get((d, i), -7.0) for i in range(datum.model_input.length)]
        outputs.append(
            {"logprobs": tinker.types.TensorData(data=values, dtype="float32", shape=[len(values)])}
        )
    return outputs


def test_only_sampled_positions_count_in_merged_datums_whatever_their_advantage(codec: ChatCodec) -> None:
    """A two-turn trajectory merged into one datum (environment tokens between its completions) and two
    single turns; the middle reward of three makes one trajectory's advantage 0, and a sampled token of
    logprob exactly 0 still counts: the mask follows the sampled tokens, not advantages or logprobs."""
    first_prompt = _prompt(codec, "respond with yes")
    first = _tokens(codec, "maybe")
    environment = _tokens(
        codec, "<|im_end|>\n<|im_start|>user\nnow say no<|im_end|>\n<|im_start|>assistant\n"
    )
    second_prompt = first_prompt + first + environment
    second = _tokens(codec, "no way")
    other = _tokens(codec, "yes")

    def turn(prompt: list[int], completion: list[int], logprobs: list[float]) -> types_pb2.SampledTurn:
        return types_pb2.SampledTurn(
            prompt_token_ids=prompt, completion_token_ids=completion, completion_logprobs=logprobs
        )

    first_lps = [0.0] + [-0.5] * (len(first) - 1)
    second_lps = [-1.0 - 0.25 * i for i in range(len(second))]
    request = pb.TrainRequest(model="m")
    group = request.groups.add()
    group.trajectories.add(
        reward=2.0, turns=[turn(first_prompt, first, first_lps), turn(second_prompt, second, second_lps)]
    )
    group.trajectories.add(reward=1.0, turns=[turn(first_prompt, other, [-2.0])])
    group.trajectories.add(reward=0.0, turns=[turn(first_prompt, other, [-3.0])])
    batch = rl_batch(request, 0, codec)
    assert len(batch.datums) == 3 and float(batch.datums[1].loss_fn_inputs["advantages"].data[-1]) == 0.0

    # The learner's logprob of each sampled token: the sampler's plus a shift of its own.
    shifts = [0.1, -0.3, 0.7, -1.2, 0.05, 0.9, -0.6, 0.4, -0.2, 1.5]
    sampler_lps: list[float] = []
    learner_lps: list[float] = []
    learner_of: dict[tuple[int, int], float] = {}
    spans = [
        (0, len(first_prompt) - 1, first_lps),
        (0, len(second_prompt) - 1, second_lps),
        (1, len(first_prompt) - 1, [-2.0]),
        (2, len(first_prompt) - 1, [-3.0]),
    ]
    for d, start, lps in spans:
        for j, q in enumerate(lps):
            lp = q + shifts[len(learner_lps) % len(shifts)]
            learner_of[(d, start + j)] = lp
            sampler_lps.append(q)
            learner_lps.append(lp)
    assert sum(sum(mask) for mask in batch.sampled_masks) == len(learner_lps) == batch.trained_tokens

    mismatch = sampler_mismatch(batch.datums, batch.sampled_masks, _learner_outputs(batch.datums, learner_of))

    assert mismatch is not None and mismatch.tokens == len(learner_lps)
    # float32 on the wire: the reference reads the learner's logprobs as the backend sends them.
    learner_f32 = [float(np.float32(lp)) for lp in learner_lps]
    assert reported_mismatch(mismatch) == pytest.approx(
        reference_mismatch(learner_f32, sampler_lps), rel=1e-6
    )


def test_supervised_steps_and_backends_without_logprobs_report_none(codec: ChatCodec) -> None:
    request = pb.TrainRequest(model="m")
    request.examples.add(
        messages=[user("hi"), types_pb2.Message(role=types_pb2.ROLE_ASSISTANT, content="yo")]
    )
    supervised = sft_batch(request, codec)
    assert supervised.datums and not any(any(mask) for mask in supervised.sampled_masks)
    outputs = _learner_outputs(supervised.datums, {})
    assert sampler_mismatch(supervised.datums, supervised.sampled_masks, outputs) is None

    rl = pb.TrainRequest(model="m")
    group = rl.groups.add()
    prompt = _prompt(codec, "respond with yes")
    for reward in (0.0, 1.0):
        group.trajectories.add(
            reward=reward,
            turns=[
                types_pb2.SampledTurn(
                    prompt_token_ids=prompt, completion_token_ids=[5], completion_logprobs=[-1.0]
                )
            ],
        )
    batch = rl_batch(rl, 0, codec)
    assert sampler_mismatch(batch.datums, batch.sampled_masks, [{} for _ in batch.datums]) is None
    assert sampler_mismatch(batch.datums, batch.sampled_masks, []) is None
