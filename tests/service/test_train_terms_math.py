"""The math of Train's per-token terms against references written here one token at a time: the KL
penalty's and distillation's advantage terms, given per-token advantages in the datums (aggregation
weight included, a group of equal rewards kept), truncated importance sampling as the cispo form Train
sends (its gradient is min(r, cap)·A·∇lp), and the tokenizer check a reference or teacher must pass."""

from __future__ import annotations

import math
from pathlib import Path

import numpy as np
import pytest
import torch
from svc import TINY
from transformers import AutoTokenizer

from tinkerrpc.contract.limits import TRUNCATED_IS_CLIP_LOW
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.engine.losses import LOSS_FUNCTIONS
from tinkerrpc_server.service.datums import rl_batch
from tinkerrpc_server.service.rendering import ChatCodec, ChatCodecs
from tinkerrpc_server.service.train_options import loss_config, loss_name
from tinkerrpc_server.service.train_terms import distillation_terms, kl_penalty_terms, same_tokenizer
from tinkerrpc_server.service.validation import check_train_request

pytestmark = pytest.mark.unit

SMOLLM2 = "HuggingFaceTB/SmolLM2-135M-Instruct"
RNG = np.random.default_rng(3)
# Three datums of 6 target positions, the sampled ones marked.
MASKS = [np.array(m, dtype=bool) for m in ([0, 0, 1, 1, 1, 0], [0, 1, 1, 1, 1, 1], [0, 0, 0, 0, 1, 1])]
SAMPLER = [np.where(m, RNG.uniform(-3, 0, len(m)), 0.0) for m in MASKS]
SCORER = [RNG.uniform(-4, 0, len(m)) for m in MASKS]


def test_the_kl_penalty_term_is_the_coefficient_times_the_mean_gap_minus_each_tokens() -> None:
    terms, mean = kl_penalty_terms(SAMPLER, SCORER, MASKS, 0.3)

    gaps = [
        q - r
        for q, r, m in zip(SAMPLER, SCORER, MASKS, strict=True)
        for q, r, s in zip(q, r, m, strict=True)
        if s
    ]
    assert mean == pytest.approx(sum(gaps) / len(gaps))
    for q, r, m, term in zip(SAMPLER, SCORER, MASKS, terms, strict=True):
        for i in range(len(m)):
            assert term[i] == pytest.approx(0.3 * (mean - (q[i] - r[i])) if m[i] else 0.0)


def test_the_distillation_term_is_the_teachers_logprob_minus_the_students() -> None:
    terms, reverse_kl = distillation_terms(SAMPLER, SCORER, MASKS, 2.0)

    gaps = [
        q - p
        for q, p, m in zip(SAMPLER, SCORER, MASKS, strict=True)
        for q, p, s in zip(q, p, m, strict=True)
        if s
    ]
    assert reverse_kl == pytest.approx(sum(gaps) / len(gaps))
    for q, p, m, term in zip(SAMPLER, SCORER, MASKS, terms, strict=True):
        for i in range(len(m)):
            assert term[i] == pytest.approx(2.0 * (p[i] - q[i]) if m[i] else 0.0)


def _truncated_request(loss: int, cap: float, clip_high: float | None = None) -> pb.TrainRequest:
    request = pb.TrainRequest(loss=types_pb2.LossConfig(function=loss), importance_ratio_cap=cap)  # type: ignore[arg-type]
    if clip_high is not None:
        request.loss.clip_high_threshold = clip_high
    return request


def test_a_capped_importance_sampling_step_has_the_truncated_gradient() -> None:
    request = _truncated_request(types_pb2.LOSS_FUNCTION_IMPORTANCE_SAMPLING, 2.0)
    assert loss_name(request) == "cispo"
    config = loss_config(request)
    assert config == {"clip_low_threshold": TRUNCATED_IS_CLIP_LOW, "clip_high_threshold": 2.0}
    sampler = torch.tensor([-1.0, -2.0, -0.5, -3.0, -0.2], dtype=torch.float64)
    values = torch.tensor([-1.0, -0.5, -0.6, -0.1, -3.0], dtype=torch.float64)
    lp = values.clone().requires_grad_(True)
    advantages = torch.tensor([1.0, -0.5, 2.0, 0.7, -1.2], dtype=torch.float64)

    LOSS_FUNCTIONS["cispo"](lp, {"logprobs": sampler, "advantages": advantages}, config).backward()

    assert lp.grad is not None
    for i in range(5):
        ratio = math.exp(float(values[i] - sampler[i]))
        # Truncated importance sampling: −min(r, cap)·A per token (importance_sampling's is −r·A).
        assert float(lp.grad[i]) == pytest.approx(-min(ratio, 2.0) * float(advantages[i]), rel=1e-12)
    assert sum(math.exp(float(values[i] - sampler[i])) > 2.0 for i in range(5)) == 2


def test_a_cap_lowers_cispos_clip_high_only_where_it_is_lower() -> None:
    cispo = types_pb2.LOSS_FUNCTION_CISPO
    assert loss_name(_truncated_request(cispo, 2.0)) == "cispo"
    assert loss_config(_truncated_request(cispo, 2.0, clip_high=3.0))["clip_high_threshold"] == 2.0  # type: ignore[index]
    assert loss_config(_truncated_request(cispo, 2.0, clip_high=1.5))["clip_high_threshold"] == 1.5  # type: ignore[index]
    assert loss_config(_truncated_request(cispo, 2.0))["clip_low_threshold"] == 0.8  # type: ignore[index]


@pytest.fixture(scope="module")
def codec(service_model_dir: Path) -> ChatCodec:
    return ChatCodecs(service_model_dir, allow_remote_tokenizers=False).get(TINY)


def test_per_token_advantages_add_to_the_group_advantage_and_keep_an_equal_reward_group(
    codec: ChatCodec,
) -> None:
    request = pb.TrainRequest(
        model="m",
        adam=types_pb2.AdamParams(learning_rate=1e-4),
        loss=types_pb2.LossConfig(aggregation=types_pb2.LOSS_AGGREGATION_TOKEN_MEAN),
    )
    given = {(0, 0): [0.5, -1.0, 2.0], (1, 1): [1.0, 1.0]}
    for g, rewards in enumerate(([1.0, 0.0], [0.3, 0.3])):
        group = request.groups.add()
        for t, reward in enumerate(rewards):
            completion = [40 + t, 41 + t, 42][: 3 - g]
            turn = group.trajectories.add(reward=reward).turns.add(
                prompt_token_ids=[5, 6, 7],
                completion_token_ids=completion,
                completion_logprobs=[-0.5] * len(completion),
            )
            turn.advantages.extend(given.get((g, t), []))
    check_train_request(request, 0, codec.vocab_size, codec.max_context_length)

    batch = rl_batch(request, 0, codec)

    # The second group's rewards are equal: it trains (its second trajectory has per-token advantages).
    assert (batch.used, batch.dropped_zero_variance, batch.zero_variance_groups) == (4, 0, 0)
    weight = 1.0 / 10  # token_mean over the 3 + 3 + 2 + 2 sampled tokens
    expected = [[0.5 + 0.5, 0.5 - 1.0, 0.5 + 2.0], [-0.5] * 3, [0.0, 0.0], [1.0, 1.0]]
    for datum, values, advantage_weight in zip(batch.datums, expected, batch.advantage_weights, strict=True):
        carried = list(datum.loss_fn_inputs["advantages"].data)[2:]
        assert carried == pytest.approx([weight * v for v in values])
        assert advantage_weight == pytest.approx(weight)


def test_a_reference_must_share_the_tokenizer(codec: ChatCodec) -> None:
    assert same_tokenizer(codec.tokenizer, codec.tokenizer)
    other = AutoTokenizer.from_pretrained(SMOLLM2, local_files_only=True)
    assert not same_tokenizer(codec.tokenizer, other)
