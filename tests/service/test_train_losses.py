"""Train hands the chosen loss, its settings and the advantage options to the backend.

Twin models (same base, same seed, version 0) take one step each on the same sampled data; each step's
reported loss (Tinker's `loss:sum`, computed before the optimizer moves) must equal the loss formula for
its config, worked out here by hand from the policy's own logprobs of the data. The data's sampler
logprobs are shifted so that importance ratios fall inside and outside the clip thresholds: a loss or a
threshold that did not reach the backend gives a different number.
"""

from __future__ import annotations

import math
from dataclasses import dataclass
from typing import Literal

import pytest
from svc import CALL_TIMEOUT, TINY, Server, create_model, prompt_logprobs, rl_request, sample_chat

import tinkerrpc
from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import trainer_service_pb2_grpc, types_pb2

pytestmark = pytest.mark.process

REWARDS = [1.0, 0.0, 0.5, 0.0]
# Added to the sampler's logprobs token by token, so that r = exp(lp − q) ≈ exp(−offset) spreads over
# [0.55, 1.8]: below, inside and above both the tight and the default clip thresholds.
LOGPROB_OFFSETS = [-0.5, 0.3, -0.25, 0.15, -0.03, 0.6, 0.02, -0.6]
TIGHT_CLIP = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
DEFAULT_CLIP = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
DRO_BETA = 0.5
DEFAULT_DRO_BETA = 0.05
STD_EPSILON = 1e-6
# Sampler-side and trainer-side logprobs of the same weights agree to float32 rounding (~1e-6 seen).
LOSS_TOLERANCE = 2e-4


@dataclass(frozen=True)
class Token:
    """One target position of a datum: learner logprob, sampler logprob sent, advantage."""

    lp: float
    q: float
    advantage: float


def expected_loss(function: str, tokens: list[Token], config: dict[str, float]) -> float:
    """Tinker's per-token loss for `function`, summed over every target position (TINKER_FACTS.md;
    stable_reinforce as docs/tinker_parity.md defines it, its default kl_coeff 0)."""
    total = 0.0
    for t in tokens:
        ratio = math.exp(t.lp - t.q)
        if function == "importance_sampling":
            total -= ratio * t.advantage
        elif function == "ppo":
            clipped = min(max(ratio, config["clip_low_threshold"]), config["clip_high_threshold"])
            total -= min(ratio * t.advantage, clipped * t.advantage)
        elif function == "cispo":
            clipped = min(max(ratio, config["clip_low_threshold"]), config["clip_high_threshold"])
            total -= clipped * t.lp * t.advantage
        elif function == "dro":
            total -= t.lp * t.advantage - 0.5 * config["beta"] * (t.lp - t.q) ** 2
        elif function == "stable_reinforce":
            total -= ratio * t.lp * t.advantage
        else:
            raise AssertionError(function)
    return total


def expected_gspo_loss(
    sequences: list[list[Token]], prompt_positions: int, config: dict[str, float]
) -> float:
    """GSPO-token (docs/tinker_parity.md): each sampled turn is one sequence whose ratio s is the geometric
    mean of the token ratios over its sampled tokens (the positions after the prompt); every token counts
    −min(s·A, clip(s)·A)."""
    total = 0.0
    for tokens in sequences:
        sampled = tokens[prompt_positions:]
        s = math.exp(sum(t.lp - t.q for t in sampled) / len(sampled))
        clipped = min(max(s, config["clip_low_threshold"]), config["clip_high_threshold"])
        total -= sum(min(s * t.advantage, clipped * t.advantage) for t in tokens)
    return total


def advantages(rewards: list[float], normalize_std: bool) -> list[float]:
    mean = sum(rewards) / len(rewards)
    centred = [r - mean for r in rewards]
    if not normalize_std:
        return centred
    std = math.sqrt(sum(c * c for c in centred) / len(centred))
    return [c / (std + STD_EPSILON) for c in centred]


@dataclass(frozen=True)
class StepData:
    """The group every twin trains on, and each trajectory's target positions at version 0."""

    sample: pb.SampleResponse
    shifted_logprobs: list[list[float]]
    learner_logprobs: list[list[float]]  # per trajectory: every target position, prompt included

    def request(self, model: str, loss: types_pb2.LossConfig, normalize_std: bool = False) -> pb.TrainRequest:
        request = rl_request(model, self.sample, REWARDS)
        for trajectory, shifted in zip(request.groups[0].trajectories, self.shifted_logprobs, strict=True):
            trajectory.turns[0].completion_logprobs[:] = shifted
        request.loss.CopyFrom(loss)
        request.advantages.normalize_std = normalize_std
        return request

    @property
    def prompt_positions(self) -> int:
        return len(self.sample.prompt_token_ids) - 1

    def sequences(self, normalize_std: bool) -> list[list[Token]]:
        """Each trajectory's target positions."""
        out = []
        for lp, shifted, advantage in zip(
            self.learner_logprobs, self.shifted_logprobs, advantages(REWARDS, normalize_std), strict=True
        ):
            q = [0.0] * self.prompt_positions + shifted
            a = [0.0] * self.prompt_positions + [advantage] * len(shifted)
            out.append([Token(*position) for position in zip(lp, q, a, strict=True)])
        return out

    def tokens(self, normalize_std: bool) -> list[Token]:
        return [token for sequence in self.sequences(normalize_std) for token in sequence]


TWINS = [
    "loss-twin-is",
    "loss-twin-is-std",
    "loss-twin-ppo",
    "loss-twin-cispo",
    "loss-twin-dro",
    "loss-twin-stable-reinforce",
    "loss-twin-gspo",
]


@pytest.fixture(scope="module")
def stub(server: Server) -> trainer_service_pb2_grpc.TrainerServiceStub:
    for name in TWINS:
        create_model(server.stub, name)
    return server.stub


@pytest.fixture(scope="module")
def data(stub: trainer_service_pb2_grpc.TrainerServiceStub) -> StepData:
    sample = sample_chat(
        stub, TWINS[0], "respond with maybe", n=len(REWARDS), max_tokens=4, seed=21, version=0
    )
    prompt = list(sample.prompt_token_ids)
    shifted = []
    learner = []
    for i, sequence in enumerate(sample.sequences):
        offsets = [LOGPROB_OFFSETS[(i + j) % len(LOGPROB_OFFSETS)] for j in range(len(sequence.logprobs))]
        shifted.append([lp + offset for lp, offset in zip(sequence.logprobs, offsets, strict=True)])
        learner.append(prompt_logprobs(stub, TWINS[0], prompt + list(sequence.token_ids), version=0))
    return StepData(sample, shifted, learner)


def _train(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
    data: StepData,
    model: str,
    loss: types_pb2.LossConfig,
    normalize_std: bool = False,
) -> float:
    response = stub.Train(data.request(model, loss, normalize_std), timeout=CALL_TIMEOUT)
    assert response.policy_version == 1, "every twin takes its first step from version 0"
    return response.metrics.loss


def _fingerprint(
    stub: trainer_service_pb2_grpc.TrainerServiceStub, data: StepData, model: str
) -> list[float]:
    probe = list(data.sample.prompt_token_ids) + list(data.sample.sequences[0].token_ids)
    return prompt_logprobs(stub, model, probe, version=1)


def test_ppo_with_tight_clip_and_importance_sampling_train_differently_each_by_its_own_loss(
    stub: trainer_service_pb2_grpc.TrainerServiceStub, data: StepData
) -> None:
    tokens = data.tokens(normalize_std=False)
    is_expected = expected_loss("importance_sampling", tokens, {})
    ppo_expected = expected_loss("ppo", tokens, TIGHT_CLIP)
    # The data tells the configs apart by far more than the tolerance.
    assert abs(ppo_expected - is_expected) > 20 * LOSS_TOLERANCE
    assert abs(ppo_expected - expected_loss("ppo", tokens, DEFAULT_CLIP)) > 20 * LOSS_TOLERANCE

    is_loss = _train(
        stub, data, "loss-twin-is", types_pb2.LossConfig(function=types_pb2.LOSS_FUNCTION_IMPORTANCE_SAMPLING)
    )
    ppo_loss = _train(
        stub,
        data,
        "loss-twin-ppo",
        types_pb2.LossConfig(function=types_pb2.LOSS_FUNCTION_PPO, **TIGHT_CLIP),
    )

    assert is_loss == pytest.approx(is_expected, abs=LOSS_TOLERANCE)
    assert ppo_loss == pytest.approx(ppo_expected, abs=LOSS_TOLERANCE)
    # Different losses, different gradients: the twins' weights part.
    is_weights = _fingerprint(stub, data, "loss-twin-is")
    ppo_weights = _fingerprint(stub, data, "loss-twin-ppo")
    assert max(abs(a - b) for a, b in zip(is_weights, ppo_weights, strict=True)) > 1e-4


def test_cispo_uses_its_clip_thresholds(
    stub: trainer_service_pb2_grpc.TrainerServiceStub, data: StepData
) -> None:
    tokens = data.tokens(normalize_std=False)
    expected = expected_loss("cispo", tokens, TIGHT_CLIP)
    assert abs(expected - expected_loss("cispo", tokens, DEFAULT_CLIP)) > 20 * LOSS_TOLERANCE
    assert abs(expected - expected_loss("ppo", tokens, TIGHT_CLIP)) > 20 * LOSS_TOLERANCE

    loss = _train(
        stub,
        data,
        "loss-twin-cispo",
        types_pb2.LossConfig(function=types_pb2.LOSS_FUNCTION_CISPO, **TIGHT_CLIP),
    )
    assert loss == pytest.approx(expected, abs=LOSS_TOLERANCE)


def test_dro_uses_its_beta(stub: trainer_service_pb2_grpc.TrainerServiceStub, data: StepData) -> None:
    tokens = data.tokens(normalize_std=False)
    expected = expected_loss("dro", tokens, {"beta": DRO_BETA})
    assert abs(expected - expected_loss("dro", tokens, {"beta": DEFAULT_DRO_BETA})) > 20 * LOSS_TOLERANCE

    loss = _train(
        stub, data, "loss-twin-dro", types_pb2.LossConfig(function=types_pb2.LOSS_FUNCTION_DRO, beta=DRO_BETA)
    )
    # The drift term also counts on prompt positions (sampler logprob 0 there), so the loss runs into the
    # hundreds: compare relative to its size.
    assert loss == pytest.approx(expected, rel=LOSS_TOLERANCE / 10)


def test_normalize_std_divides_the_advantages_by_the_group_std(
    stub: trainer_service_pb2_grpc.TrainerServiceStub, data: StepData
) -> None:
    centred = expected_loss("importance_sampling", data.tokens(normalize_std=False), {})
    normalized = expected_loss("importance_sampling", data.tokens(normalize_std=True), {})
    assert abs(normalized - centred) > 20 * LOSS_TOLERANCE

    loss = _train(
        stub,
        data,
        "loss-twin-is-std",
        types_pb2.LossConfig(function=types_pb2.LOSS_FUNCTION_IMPORTANCE_SAMPLING),
        normalize_std=True,
    )
    assert loss == pytest.approx(normalized, abs=LOSS_TOLERANCE)


def _assert_trains_by(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
    data: StepData,
    model: str,
    loss: types_pb2.LossConfig,
    expected: float,
    others: list[float],
) -> None:
    """The step reports `expected`, a loss the data tells apart from each of `others` (another loss or
    another config) by far more than the tolerance."""
    assert all(abs(expected - other) > 20 * LOSS_TOLERANCE for other in others)
    assert _train(stub, data, model, loss) == pytest.approx(expected, abs=LOSS_TOLERANCE)


def test_stable_reinforce_weighs_reinforce_by_the_detached_ratio(
    stub: trainer_service_pb2_grpc.TrainerServiceStub, data: StepData
) -> None:
    tokens = data.tokens(normalize_std=False)
    expected = expected_loss("stable_reinforce", tokens, {})
    others = [expected_loss("importance_sampling", tokens, {}), expected_loss("cispo", tokens, DEFAULT_CLIP)]
    config = types_pb2.LossConfig(function=types_pb2.LOSS_FUNCTION_STABLE_REINFORCE)
    _assert_trains_by(stub, data, "loss-twin-stable-reinforce", config, expected, others)


def test_gspo_takes_one_ratio_per_sampled_turn_and_its_clip_thresholds(
    stub: trainer_service_pb2_grpc.TrainerServiceStub, data: StepData
) -> None:
    sequences = data.sequences(normalize_std=False)
    expected = expected_gspo_loss(sequences, data.prompt_positions, TIGHT_CLIP)
    others = [
        expected_gspo_loss(sequences, data.prompt_positions, DEFAULT_CLIP),
        expected_loss("ppo", data.tokens(normalize_std=False), TIGHT_CLIP),
    ]
    config = types_pb2.LossConfig(function=types_pb2.LOSS_FUNCTION_GSPO, **TIGHT_CLIP)
    _assert_trains_by(stub, data, "loss-twin-gspo", config, expected, others)


SDK_PROMPT = [tinkerrpc.Message.user("respond with yes or no")]


@pytest.mark.parametrize("loss", ["stable_reinforce", "gspo"])
def test_the_sdk_trains_a_few_steps_with_each_new_loss(
    server: Server, loss: Literal["stable_reinforce", "gspo"]
) -> None:
    with tinkerrpc.Client(server.proc.target) as client:
        model = client.create_model(
            f"loss-sdk-{loss.replace('_', '-')}", base_model=TINY, lora_rank=8, seed=7
        )
        for step in range(1, 4):
            samples = model.sample(SDK_PROMPT, n=4, max_tokens=4, seed=step)
            group = tinkerrpc.TrajectoryGroup(
                [
                    tinkerrpc.Trajectory.from_sample(SDK_PROMPT, s, reward=float(i))
                    for i, s in enumerate(samples)
                ]
            )
            result = model.train([group], loss=loss, learning_rate=1e-2)
            assert result.policy_version == step
            assert math.isfinite(result.metrics.loss)
