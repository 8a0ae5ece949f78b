"""Train: versions, token-exact datums (multi-turn too), advantages, staleness, idempotency, validation, SFT."""

from __future__ import annotations

import concurrent.futures
import math

import grpc
import pytest
from svc import (
    CALL_TIMEOUT,
    Server,
    assistant,
    create_model,
    error_info,
    prompt_logprobs,
    rl_request,
    sample_chat,
    user,
    violated_fields,
)

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import trainer_service_pb2_grpc, types_pb2

pytestmark = pytest.mark.process

MODEL = "train-model"


@pytest.fixture(scope="module")
def stub(server: Server) -> trainer_service_pb2_grpc.TrainerServiceStub:
    create_model(server.stub, MODEL)
    return server.stub


def _version(stub: trainer_service_pb2_grpc.TrainerServiceStub, model: str = MODEL) -> int:
    return stub.GetModel(pb.GetModelRequest(name=model)).model.policy_version


def _completion_logprob(
    stub: trainer_service_pb2_grpc.TrainerServiceStub, prompt: list[int], completion: list[int], version: int
) -> float:
    """log p(completion | prompt) under the policy at `version`."""
    lps = prompt_logprobs(stub, MODEL, prompt + completion, version)
    return sum(lps[len(prompt) - 1 :])


def test_train_advances_version_and_moves_probability_towards_rewarded_samples(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
) -> None:
    start = _version(stub)
    sample = sample_chat(stub, MODEL, "respond with maybe", n=4, max_tokens=4, seed=11, version=start)
    prompt = list(sample.prompt_token_ids)
    winner = list(sample.sequences[0].token_ids)
    before = _completion_logprob(stub, prompt, winner, start)
    probe_before = prompt_logprobs(stub, MODEL, prompt + winner, start)

    response = stub.Train(rl_request(MODEL, sample, [1.0, 0.0, 0.0, 0.0]), timeout=CALL_TIMEOUT)

    assert response.policy_version == start + 1 and not response.replayed
    metrics = response.metrics
    completions = [len(s.token_ids) for s in sample.sequences]
    assert metrics.trained_tokens == sum(completions)
    assert metrics.total_tokens == sum(len(prompt) + c for c in completions)
    assert metrics.trajectories_used == 4 and metrics.mean_reward == pytest.approx(0.25)
    assert dict(metrics.staleness_histogram) == {0: 4}
    assert metrics.dropped_stale == 0 and metrics.zero_variance_groups == 0
    assert math.isfinite(metrics.loss) and metrics.step_seconds > 0 and metrics.tokens_per_second > 0
    assert response.sampler_checkpoint.policy_version == start + 1
    assert response.sampler_checkpoint.kind == types_pb2.CHECKPOINT_KIND_SAMPLER
    assert response.state_checkpoint.name == f"step_{start + 1:06d}"
    assert _completion_logprob(stub, prompt, winner, start + 1) > before
    # The old version stays pinned and unchanged; the latest is the new one.
    assert prompt_logprobs(stub, MODEL, prompt + winner, start) == pytest.approx(probe_before, abs=1e-5)
    latest = sample_chat(stub, MODEL, "respond with maybe", n=1, max_tokens=2)
    assert latest.policy_version == start + 1 and latest.sequences[0].policy_version == start + 1
    assert list(stub.GetModel(pb.GetModelRequest(name=MODEL)).model.sampleable_versions)[-2:] == [
        start,
        start + 1,
    ]


def test_every_sampled_turn_of_a_multi_turn_trajectory_trains(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
) -> None:
    version = _version(stub)
    first = sample_chat(stub, MODEL, "respond with yes", n=2, max_tokens=3, seed=2, version=version)
    second = sample_chat(stub, MODEL, "now respond with no", n=2, max_tokens=3, seed=3, version=version)
    request = pb.TrainRequest(model=MODEL, adam=types_pb2.AdamParams(learning_rate=1e-2))
    group = request.groups.add()
    for i, reward in enumerate([1.0, 0.0]):
        trajectory = group.trajectories.add(reward=reward)
        for sample in (first, second):
            trajectory.turns.add(
                prompt_token_ids=sample.prompt_token_ids,
                completion_token_ids=sample.sequences[i].token_ids,
                completion_logprobs=sample.sequences[i].logprobs,
                policy_version=version,
            )
    second_prompt = list(second.prompt_token_ids)
    second_winner = list(second.sequences[0].token_ids)
    before = _completion_logprob(stub, second_prompt, second_winner, version)

    response = stub.Train(request, timeout=CALL_TIMEOUT)

    turns = [(s.prompt_token_ids, s.sequences[i].token_ids) for i in range(2) for s in (first, second)]
    assert response.metrics.trained_tokens == sum(len(c) for _, c in turns)
    assert response.metrics.total_tokens == sum(len(p) + len(c) for p, c in turns)
    assert response.metrics.trajectories_used == 2
    # The second turn trained too: its rewarded completion became more likely.
    assert _completion_logprob(stub, second_prompt, second_winner, version + 1) > before


def test_a_turn_without_prompt_ids_is_re_rendered_from_the_messages(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
) -> None:
    version = _version(stub)
    sample = sample_chat(stub, MODEL, "respond with no", n=2, max_tokens=3, seed=4, version=version)
    request = pb.TrainRequest(model=MODEL, adam=types_pb2.AdamParams(learning_rate=1e-3))
    group = request.groups.add()
    for sequence, reward in zip(sample.sequences, [1.0, 0.0], strict=True):
        trajectory = group.trajectories.add(
            reward=reward, messages=[user("respond with no"), assistant(sequence.text)]
        )
        trajectory.turns.add(
            completion_token_ids=sequence.token_ids,
            completion_logprobs=sequence.logprobs,
            policy_version=version,
        )
    response = stub.Train(request, timeout=CALL_TIMEOUT)
    # Re-rendering reproduces exactly the prompt the sampler saw.
    prompt = len(sample.prompt_token_ids)
    assert response.metrics.total_tokens == sum(prompt + len(s.token_ids) for s in sample.sequences)
    assert response.policy_version == version + 1


def _keyed_request(sample: pb.SampleResponse, keys: list[str]) -> pb.TrainRequest:
    """The sampled sequences as trajectories without logprobs, each turn naming the given key."""
    request = rl_request(MODEL, sample, [1.0, 0.0])
    for trajectory, key in zip(request.groups[0].trajectories, keys, strict=True):
        del trajectory.turns[0].completion_logprobs[:]
        trajectory.turns[0].sample_key = key
    return request


def test_a_turn_naming_its_sample_key_trains_without_scoring_and_a_bad_key_is_scored(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
) -> None:
    version = _version(stub)
    sample = sample_chat(stub, MODEL, "respond with yes", n=2, max_tokens=3, seed=5, version=version)
    keys = [s.sample_key for s in sample.sequences]
    assert all(keys) and len(set(keys)) == 2
    taken = stub.Train(_keyed_request(sample, keys), timeout=CALL_TIMEOUT)
    assert taken.metrics.scored_tokens == 0 and taken.policy_version == version + 1

    sample = sample_chat(stub, MODEL, "respond with no", n=2, max_tokens=3, seed=6, version=version + 1)
    first, second = sample.sequences
    nonce, mac = first.sample_key.split(".")
    tampered = f"{nonce}.{mac[::-1]}"
    # The second turn names the first sequence's key: genuine, but not of its tokens (unless equal).
    mismatched = first.sample_key if list(first.token_ids) != list(second.token_ids) else "no.key"
    scored = stub.Train(_keyed_request(sample, [tampered, mismatched]), timeout=CALL_TIMEOUT)
    assert scored.metrics.scored_tokens == len(first.token_ids) + len(second.token_ids)
    assert scored.policy_version == version + 2


def test_idempotent_retry_applies_once(stub: trainer_service_pb2_grpc.TrainerServiceStub) -> None:
    version = _version(stub)
    sample = sample_chat(stub, MODEL, "respond with yes", n=4, max_tokens=3, seed=5, version=version)
    probe = list(sample.prompt_token_ids) + list(sample.sequences[0].token_ids)
    request = rl_request(MODEL, sample, [0.0, 1.0, 0.5, 0.0], idempotency_key="step-a")

    first = stub.Train(request, timeout=CALL_TIMEOUT)
    weights_after_first = prompt_logprobs(stub, MODEL, probe)
    retry = stub.Train(request, timeout=CALL_TIMEOUT)

    assert first.policy_version == version + 1 and not first.replayed
    assert retry.replayed and retry.policy_version == first.policy_version
    assert retry.metrics == first.metrics
    assert _version(stub) == version + 1
    assert prompt_logprobs(stub, MODEL, probe) == pytest.approx(weights_after_first, abs=1e-6)

    changed = rl_request(MODEL, sample, [0.0, 1.0, 0.5, 0.0], learning_rate=5e-2, idempotency_key="step-a")
    with pytest.raises(grpc.RpcError) as err:
        stub.Train(changed, timeout=CALL_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(err.value)
    assert info.reason == "IDEMPOTENCY_KEY_REUSED" and info.domain == "tinkerrpc"
    assert _version(stub) == version + 1


def test_a_retry_arriving_while_the_first_attempt_runs_is_answered_from_it(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
) -> None:
    version = _version(stub)
    sample = sample_chat(stub, MODEL, "respond with no", n=4, max_tokens=3, seed=6, version=version)
    request = rl_request(MODEL, sample, [1.0, 0.0, 0.0, 0.5], idempotency_key="step-b")
    with concurrent.futures.ThreadPoolExecutor(2) as pool:
        attempts = list(pool.map(lambda _: stub.Train(request, timeout=CALL_TIMEOUT), range(2)))
    assert {a.policy_version for a in attempts} == {version + 1}
    assert sorted(a.replayed for a in attempts) == [False, True]
    assert _version(stub) == version + 1


def test_stale_trajectories_are_dropped_or_rejected_in_strict_mode(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
) -> None:
    version = _version(stub)
    assert version >= 2, "earlier tests advanced the model"
    old = sample_chat(stub, MODEL, "respond with yes", n=2, max_tokens=3, seed=7, version=0)
    fresh = sample_chat(stub, MODEL, "respond with yes", n=2, max_tokens=3, seed=7, version=version)
    request = rl_request(MODEL, fresh, [1.0, 0.0])
    request.groups.extend(rl_request(MODEL, old, [1.0, 0.0]).groups)
    request.max_staleness = 1

    strict = pb.TrainRequest()
    strict.CopyFrom(request)
    strict.strict_staleness = True
    with pytest.raises(grpc.RpcError) as err:
        stub.Train(strict, timeout=CALL_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    info = error_info(err.value)
    assert info.reason == "STALE_POLICY_VERSION" and info.domain == "tinkerrpc"
    assert dict(info.metadata) == {"current_version": str(version), "sampled_version": "0"}
    assert _version(stub) == version

    response = stub.Train(request, timeout=CALL_TIMEOUT)
    assert response.policy_version == version + 1
    assert response.metrics.dropped_stale == 2 and response.metrics.trajectories_used == 2
    assert dict(response.metrics.staleness_histogram) == {0: 2, version: 2}


def test_zero_variance_groups_are_skipped_and_counted(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
) -> None:
    version = _version(stub)
    sample = sample_chat(stub, MODEL, "respond with maybe", n=3, max_tokens=3, seed=8, version=version)
    flat = rl_request(MODEL, sample, [0.5, 0.5, 0.5])
    with pytest.raises(grpc.RpcError) as err:
        stub.Train(flat, timeout=CALL_TIMEOUT)
    assert err.value.code() == grpc.StatusCode.FAILED_PRECONDITION
    assert error_info(err.value).reason == "NOTHING_TO_TRAIN"
    assert _version(stub) == version

    mixed = rl_request(MODEL, sample, [1.0, 0.0, 0.0])
    mixed.groups.extend(flat.groups)
    mixed.advantages.normalize_std = True
    for trajectory in mixed.groups[0].trajectories:
        trajectory.metrics["accuracy"] = trajectory.reward
    response = stub.Train(mixed, timeout=CALL_TIMEOUT)
    assert response.metrics.zero_variance_groups == 1 and response.metrics.dropped_zero_variance == 3
    assert response.metrics.trajectories_used == 3
    assert response.metrics.mean_reward == pytest.approx((1.0 + 1.5) / 6)
    assert response.metrics.extra["env/accuracy"] == pytest.approx(1 / 3)


def _valid_request(stub: trainer_service_pb2_grpc.TrainerServiceStub, version: int) -> pb.TrainRequest:
    sample = sample_chat(stub, MODEL, "respond with yes", n=2, max_tokens=3, seed=9, version=version)
    return rl_request(MODEL, sample, [1.0, 0.0])


def _mutations(vocab: int, version: int) -> list[tuple[str, object]]:
    turn = "groups[0].trajectories[1].turns[0]"

    def clear_groups(r: pb.TrainRequest) -> None:
        del r.groups[:]

    def add_example(r: pb.TrainRequest) -> None:
        r.examples.add(messages=[user("q"), assistant("a")])

    return [
        ("groups", clear_groups),
        ("groups", add_example),
        ("groups[0].trajectories[1].turns", lambda r: r.groups[0].trajectories[1].ClearField("turns")),
        (
            f"{turn}.completion_logprobs",
            lambda r: r.groups[0].trajectories[1].turns[0].completion_logprobs.append(-1),
        ),
        (
            f"{turn}.completion_token_ids",
            lambda r: r.groups[0].trajectories[1].turns[0].completion_token_ids.__setitem__(0, vocab),
        ),
        (
            f"{turn}.prompt_token_ids",
            lambda r: r.groups[0].trajectories[1].turns[0].prompt_token_ids.append(-3),
        ),
        (
            f"{turn}.policy_version",
            lambda r: setattr(r.groups[0].trajectories[1].turns[0], "policy_version", version + 5),
        ),
        (turn, lambda r: r.groups[0].trajectories[1].turns[0].prompt_token_ids.extend([1] * 5000)),
        (
            "groups[0].trajectories[1].reward",
            lambda r: setattr(r.groups[0].trajectories[1], "reward", math.nan),
        ),
        (
            "groups[0].trajectories[1].reward",
            lambda r: setattr(r.groups[0].trajectories[1], "reward", math.inf),
        ),
        ("loss.function", lambda r: setattr(r.loss, "function", 99)),
        ("loss.function", lambda r: setattr(r.loss, "function", types_pb2.LOSS_FUNCTION_CROSS_ENTROPY)),
        ("loss.clip_low_threshold", lambda r: setattr(r.loss, "clip_low_threshold", -0.1)),
        ("adam.learning_rate", lambda r: setattr(r.adam, "learning_rate", 0.0)),
        ("adam.learning_rate", lambda r: setattr(r.adam, "learning_rate", -1e-3)),
        ("adam.beta1", lambda r: setattr(r.adam, "beta1", 1.0)),
        ("adam.beta2", lambda r: setattr(r.adam, "beta2", -0.1)),
        ("adam.eps", lambda r: setattr(r.adam, "eps", -1e-8)),
        ("adam.weight_decay", lambda r: setattr(r.adam, "weight_decay", -0.1)),
        ("adam.grad_clip_norm", lambda r: setattr(r.adam, "grad_clip_norm", -1.0)),
        ("max_staleness", lambda r: setattr(r, "max_staleness", -1)),
    ]


def test_each_invalid_request_names_its_field_and_changes_nothing(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
) -> None:
    version = _version(stub)
    valid = _valid_request(stub, version)
    probe = list(valid.groups[0].trajectories[0].turns[0].prompt_token_ids)
    before = prompt_logprobs(stub, MODEL, probe)
    vocab = stub.GetModel(pb.GetModelRequest(name=MODEL)).model.vocab_size
    for field, mutate in _mutations(vocab, version):
        request = pb.TrainRequest()
        request.CopyFrom(valid)
        mutate(request)  # type: ignore[operator]
        with pytest.raises(grpc.RpcError) as err:
            stub.Train(request, timeout=CALL_TIMEOUT)
        assert field in violated_fields(err.value), (field, err.value.details())

    mismatch = pb.TrainRequest()
    mismatch.CopyFrom(valid)
    mismatch.expected_policy_version = version + 3
    with pytest.raises(grpc.RpcError) as err:
        stub.Train(mismatch, timeout=CALL_TIMEOUT)
    assert error_info(err.value).reason == "VERSION_MISMATCH"

    with pytest.raises(grpc.RpcError) as err:
        stub.Train(pb.TrainRequest(model="no-such-model", adam=valid.adam, groups=valid.groups))
    assert err.value.code() == grpc.StatusCode.NOT_FOUND

    assert _version(stub) == version
    assert prompt_logprobs(stub, MODEL, probe) == pytest.approx(before, abs=1e-6)


def test_supervised_examples_train_with_cross_entropy(
    stub: trainer_service_pb2_grpc.TrainerServiceStub,
) -> None:
    examples = [
        types_pb2.SupervisedExample(messages=[user(f"respond with maybe #{i}"), assistant("maybe")])
        for i in range(4)
    ]
    request = pb.TrainRequest(model=MODEL, examples=examples, adam=types_pb2.AdamParams(learning_rate=2e-2))
    version = _version(stub)
    first = stub.Train(request, timeout=CALL_TIMEOUT)
    second = stub.Train(request, timeout=CALL_TIMEOUT)
    assert (first.policy_version, second.policy_version) == (version + 1, version + 2)
    assert first.metrics.trajectories_used == 4 and first.metrics.mean_reward == 0
    # Only the assistant reply (answer + end-of-turn framing) carries weight, not the prompt.
    assert 4 <= first.metrics.trained_tokens < first.metrics.total_tokens
    assert first.metrics.loss > 0 and second.metrics.loss < first.metrics.loss

    last_only = pb.TrainRequest()
    last_only.CopyFrom(request)
    for example in last_only.examples:
        example.messages.extend([user("again"), assistant("maybe")])
        example.train_on = types_pb2.TRAIN_ON_LAST_ASSISTANT_MESSAGE
    with pytest.raises(grpc.RpcError) as err:
        stub.Train(
            pb.TrainRequest(
                model=MODEL,
                examples=[types_pb2.SupervisedExample(messages=[user("no answer")])],
                adam=request.adam,
            ),
            timeout=CALL_TIMEOUT,
        )
    assert violated_fields(err.value) == ["examples[0].messages"]
    third = stub.Train(last_only, timeout=CALL_TIMEOUT)
    assert third.metrics.trained_tokens == first.metrics.trained_tokens
