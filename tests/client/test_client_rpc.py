"""The clients against a real grpc.aio server on 127.0.0.1 (see fake_trainer.py for why a test double)."""

from __future__ import annotations

import random
import uuid

import grpc
import pytest
from fake_trainer import FAST_RETRY, UNAVAILABLE_AFTER, UNAVAILABLE_BEFORE, Delay, FakeServer

import tinkerrpc
from tinkerrpc_server.processes.probes import free_port

pytestmark = pytest.mark.unit

PROMPT = [tinkerrpc.Message.user("yes or no?")]


@pytest.fixture
def name() -> str:
    return f"run-{uuid.uuid4().hex[:10]}"


def rollout_group(model: tinkerrpc.Model) -> tinkerrpc.TrajectoryGroup:
    samples = model.sample(PROMPT, n=2, max_tokens=4)
    return tinkerrpc.TrajectoryGroup(
        [tinkerrpc.Trajectory.from_sample(PROMPT, s, reward=float(i)) for i, s in enumerate(samples)]
    )


def test_sync_client_whole_api(client: tinkerrpc.Client, fake_server: FakeServer, name: str) -> None:
    model = client.create_model(name, base_model="tinkerrpc/tiny-chat", lora_rank=8, seed=3, train_attn=False)
    info = model.info()
    assert (info.name, info.lora_rank, info.seed, info.train_attn, info.policy_version) == (
        name,
        8,
        3,
        False,
        0,
    )
    assert name in [m.name for m in client.list_models()]

    samples = model.sample(PROMPT, n=3, max_tokens=4, temperature=0.7)
    assert len(samples) == 3
    assert samples[2].tokens == (102, 202) and samples[0].message == tinkerrpc.Message.assistant("answer 0")
    assert samples[0].prompt_token_ids == (len("yes or no?"),) and samples[0].policy_version == 0
    assert model.sample([7, 8], max_tokens=2)[0].prompt_token_ids == (7, 8)
    assert model.sample("ab", max_tokens=2)[0].message is None

    result = model.train([rollout_group(model)], learning_rate=1e-3)
    assert result.policy_version == 1 and not result.replayed
    assert result.metrics.mean_reward == 0.5 and result.metrics.trajectories_used == 2
    assert result.sampler_checkpoint is not None and result.sampler_checkpoint.kind == "sampler"
    sft = model.train_supervised(
        [[*PROMPT, tinkerrpc.Message.assistant("yes")]], learning_rate=1e-3, train_on="last"
    )
    assert sft.policy_version == 2
    sent = fake_server.trainer.calls_to("Train")[-1].request
    assert sent.examples[0].train_on == tinkerrpc.v1.types_pb2.TRAIN_ON_LAST_ASSISTANT_MESSAGE

    saved = model.save_checkpoint("mid")
    assert (saved.name, saved.policy_version, saved.kind) == (
        "mid",
        2,
        "state",
    ) and saved.create_time is not None
    model.train([rollout_group(model)])
    assert model.info().policy_version == 3
    assert [(c.name, c.kind) for c in model.checkpoints()][-2:] == [
        ("mid", "state"),
        ("step_000003", "sampler"),
    ]
    assert model.restore(saved).policy_version == 2
    model.delete_checkpoint("mid")
    model.delete_checkpoint(model.checkpoints()[0])  # a CheckpointInfo brings its own kind (sampler)
    assert [c.name for c in model.checkpoints()] == ["step_000002", "step_000003"]
    client.delete_model(name)
    with pytest.raises(tinkerrpc.NotFoundError, match=name):
        client.get_model(name)


async def test_async_client_whole_api(fake_server: FakeServer, name: str) -> None:
    async with tinkerrpc.AsyncClient(fake_server.target, retry=FAST_RETRY) as client:
        model = await client.create_model(name, base_model="tinkerrpc/tiny-chat")
        assert (await model.info()).policy_version == 0
        assert name in [m.name for m in await client.list_models()]
        samples = await model.sample(PROMPT, n=2, max_tokens=4)
        group = [tinkerrpc.Trajectory.from_sample(PROMPT, s, reward=float(i)) for i, s in enumerate(samples)]
        assert (await model.train([group], loss="cispo", clip_high_threshold=1.1)).policy_version == 1
        sent = [c.request for c in fake_server.trainer.calls_to("Train") if c.request.model == name][-1]
        assert sent.loss == tinkerrpc.v1.types_pb2.LossConfig(
            function=tinkerrpc.v1.types_pb2.LOSS_FUNCTION_CISPO, clip_high_threshold=1.1
        )
        assert (
            await model.train_supervised([[*PROMPT, tinkerrpc.Message.assistant("no")]])
        ).policy_version == 2
        saved = await model.save_checkpoint()
        assert saved.name == "step_000002"
        await model.train([group])
        assert (await model.restore("step_000002")).policy_version == 2
        await model.delete_checkpoint(saved)
        assert "step_000002" not in [c.name for c in await model.checkpoints() if c.kind == "state"]
        await client.delete_model(name)
        with pytest.raises(tinkerrpc.NotFoundError):
            await client.get_model(name)


def test_train_is_exactly_once_when_the_response_is_lost(
    client: tinkerrpc.Client, fake_server: FakeServer, name: str
) -> None:
    model = client.create_model(name, base_model="tinkerrpc/tiny-chat")
    group = rollout_group(model)
    applied_before = fake_server.trainer.steps_applied
    fake_server.trainer.inject("Train", UNAVAILABLE_AFTER)

    result = model.train([group])

    attempts = [c.request for c in fake_server.trainer.calls_to("Train") if c.request.model == name]
    assert len(attempts) == 2, "the lost response must be retried"
    assert attempts[0].idempotency_key == attempts[1].idempotency_key != ""
    assert result.policy_version == 1 and result.replayed
    assert fake_server.trainer.steps_applied - applied_before == 1
    assert model.info().policy_version == 1

    second = model.train([group])  # a new logical call: a new key, a real step
    assert second.policy_version == 2 and not second.replayed
    assert fake_server.trainer.calls_to("Train")[-1].request.idempotency_key != attempts[0].idempotency_key


async def test_async_train_is_exactly_once_when_the_response_is_lost(
    fake_server: FakeServer, name: str
) -> None:
    async with tinkerrpc.AsyncClient(fake_server.target, retry=FAST_RETRY) as client:
        model = await client.create_model(name, base_model="tinkerrpc/tiny-chat")
        samples = await model.sample(PROMPT, n=2, max_tokens=4)
        group = [tinkerrpc.Trajectory.from_sample(PROMPT, s, reward=float(i)) for i, s in enumerate(samples)]
        fake_server.trainer.inject("Train", UNAVAILABLE_AFTER, UNAVAILABLE_BEFORE)
        result = await model.train([group])
        attempts = [c.request for c in fake_server.trainer.calls_to("Train") if c.request.model == name]
        assert len(attempts) == 3 and len({a.idempotency_key for a in attempts}) == 1
        assert result.policy_version == 1 and result.replayed
        assert (await model.info()).policy_version == 1


def test_unavailable_is_retried_on_every_call_within_bounded_attempts(
    client: tinkerrpc.Client, fake_server: FakeServer, name: str
) -> None:
    fake_server.trainer.inject("CreateModel", UNAVAILABLE_BEFORE, UNAVAILABLE_BEFORE)
    client.create_model(name, base_model="tinkerrpc/tiny-chat")
    assert len([c for c in fake_server.trainer.calls_to("CreateModel") if c.request.name == name]) == 3

    fake_server.trainer.inject("GetModel", *[UNAVAILABLE_BEFORE] * 10)
    calls_before = len(fake_server.trainer.calls_to("GetModel"))
    with pytest.raises(tinkerrpc.UnavailableError, match="backend restarting"):
        client.get_model(name)
    assert len(fake_server.trainer.calls_to("GetModel")) - calls_before == FAST_RETRY.max_attempts
    fake_server.trainer.faults["GetModel"].clear()


def test_deadline_exceeded_is_retried_only_where_safe(
    client: tinkerrpc.Client, fake_server: FakeServer, name: str
) -> None:
    model = client.create_model(name, base_model="tinkerrpc/tiny-chat")
    fake_server.trainer.inject("Sample", Delay(1.0))
    before = len(fake_server.trainer.calls_to("Sample"))
    assert len(model.sample(PROMPT, max_tokens=2, timeout=0.3)) == 1
    assert len(fake_server.trainer.calls_to("Sample")) - before == 2

    fake_server.trainer.inject("SaveCheckpoint", Delay(1.0))
    with pytest.raises(tinkerrpc.RPCError) as caught:
        model.save_checkpoint("slow", timeout=0.3)
    assert caught.value.code == grpc.StatusCode.DEADLINE_EXCEEDED
    assert len([c for c in fake_server.trainer.calls_to("SaveCheckpoint") if c.request.model == name]) == 1


def test_backoff_is_full_jitter_under_an_exponential_cap() -> None:
    policy = tinkerrpc.RetryPolicy(initial_backoff=0.1, max_backoff=1.0, multiplier=2.0)
    rng = random.Random(0)
    for retry_number, cap in [(0, 0.1), (1, 0.2), (3, 0.8), (4, 1.0), (10, 1.0)]:
        draws = [policy.backoff(retry_number, rng) for _ in range(400)]
        assert all(0.0 <= d <= cap for d in draws)
        assert min(draws) < 0.1 * cap and max(draws) > 0.9 * cap  # spread over the whole range
    with pytest.raises(ValueError):
        tinkerrpc.RetryPolicy(max_attempts=0)


def test_turnless_trajectory_is_refused_before_any_network_call(
    client: tinkerrpc.Client, fake_server: FakeServer
) -> None:
    model = client.model("never-contacted")
    good = tinkerrpc.Trajectory(turns=[tinkerrpc.SampledTurn((1,), (2,), (-0.1,), 0)], reward=1.0)
    calls_before = len(fake_server.trainer.calls)
    with pytest.raises(ValueError, match=r"groups\[1\]\.trajectories\[1\] has no sampled turns"):
        model.train([[good, good], [good, tinkerrpc.Trajectory(messages=PROMPT, reward=1.0)]])
    with pytest.raises(ValueError, match=r"groups\[0\]\.trajectories\[0\]\.turns\[0\] has 1 logprobs for 2"):
        model.train([[tinkerrpc.Trajectory(turns=[tinkerrpc.SampledTurn((1,), (2, 3), (-0.1,), 0)])]])
    with pytest.raises(ValueError, match="no assistant message"):
        model.train_supervised([PROMPT])
    assert len(fake_server.trainer.calls) == calls_before


def test_server_errors_arrive_typed_with_details(client: tinkerrpc.Client, name: str) -> None:
    model = client.create_model(name, base_model="tinkerrpc/tiny-chat")
    with pytest.raises(tinkerrpc.AlreadyExistsError):
        client.create_model(name, base_model="tinkerrpc/tiny-chat")
    with pytest.raises(tinkerrpc.InvalidArgumentError) as invalid:
        model.sample(PROMPT, max_tokens=5000)
    assert invalid.value.field_violations == [("params.max_tokens", "must be <= 1000")]

    old_group = rollout_group(model)  # sampled at version 0
    model.train([old_group])
    model.train([old_group])
    with pytest.raises(tinkerrpc.StalePolicyError) as stale:
        model.train([old_group], max_staleness=1, strict_staleness=True)
    assert (stale.value.current_version, stale.value.sampled_version) == (2, 0)
    assert stale.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert stale.value.reason == tinkerrpc.ErrorReason.ERROR_REASON_STALE_POLICY_VERSION
    with pytest.raises(tinkerrpc.NotFoundError) as missing:
        client.model("no-such-model").info()
    resource = missing.value.details[0]
    assert resource.resource_name == "no-such-model"  # type: ignore[attr-defined]
    assert missing.value.reason is None


async def test_async_errors_are_typed_too(fake_server: FakeServer) -> None:
    async with tinkerrpc.AsyncClient(fake_server.target, retry=FAST_RETRY) as client:
        with pytest.raises(tinkerrpc.NotFoundError, match="no-such-model"):
            await client.model("no-such-model").sample(PROMPT, max_tokens=2)


def test_health_check_on_connect() -> None:
    not_serving = FakeServer(serving=False).start()
    try:
        with pytest.raises(tinkerrpc.UnavailableError, match="NOT_SERVING"):
            tinkerrpc.Client(not_serving.target, connect_timeout=5)
        unchecked = tinkerrpc.Client(not_serving.target, check_health=False)  # opt-out for advanced use
        assert isinstance(unchecked.stub, tinkerrpc.v1.trainer_service_pb2_grpc.TrainerServiceStub)
        unchecked.close()
    finally:
        not_serving.stop()
    # Nothing listening is said at once (issue 13), not after connect_timeout.
    with pytest.raises(
        tinkerrpc.UnavailableError, match=r"cannot connect to 127\.0\.0\.1:\d+ \(connection refused\)"
    ):
        tinkerrpc.Client(f"127.0.0.1:{free_port()}", connect_timeout=0.5)


async def test_async_health_check_on_connect() -> None:
    not_serving = FakeServer(serving=False).start()
    try:
        client = tinkerrpc.AsyncClient(not_serving.target, connect_timeout=5)
        with pytest.raises(tinkerrpc.UnavailableError, match="NOT_SERVING"):
            await client.list_models()  # the first call runs the health check
        await client.close()
    finally:
        not_serving.stop()


def test_bearer_token_reaches_the_server_on_plaintext(name: str) -> None:
    server = FakeServer(required_token="s3cret").start()
    try:
        with tinkerrpc.Client(server.target, token="s3cret", retry=FAST_RETRY) as client:
            client.create_model(name, base_model="tinkerrpc/tiny-chat").info()
        assert {c.metadata["authorization"] for c in server.trainer.calls} == {"Bearer s3cret"}
        with (
            tinkerrpc.Client(server.target, token="wrong") as client,
            pytest.raises(tinkerrpc.UnauthenticatedError),
        ):
            client.list_models()
        with tinkerrpc.Client(server.target) as client, pytest.raises(tinkerrpc.UnauthenticatedError):
            client.list_models()
    finally:
        server.stop()
