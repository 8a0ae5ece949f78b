"""The SDK against the REAL service: one `tinkerrpc serve` (embedded engine) for the module.

Train steps cost seconds each on a loaded 2-core machine, so every test takes as few as it can.
"""

from __future__ import annotations

import dataclasses
import math
import re
import uuid
from collections.abc import Awaitable, Callable, Iterator
from pathlib import Path
from typing import Any

import grpc
import pytest

import tinkerrpc
from tinkerrpc.v1 import trainer_service_pb2 as service_pb
from tinkerrpc_server.local.stack import LocalStack

pytestmark = pytest.mark.process

TINY = "tinkerrpc/tiny-chat"
PROMPT = [tinkerrpc.Message.user("respond with yes or no")]
# The probe whose prompt logprobs fingerprint a policy's weights.
PROBE_TOKENS = [1, 291, 201, 305, 310, 338, 33, 2]
FAST_RETRY = tinkerrpc.RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.05)
TRAIN_METHOD = "/tinkerrpc.v1.TrainerService/Train"


@pytest.fixture(scope="module")
def target(tmp_path_factory: pytest.TempPathFactory) -> Iterator[str]:
    work = tmp_path_factory.mktemp("client-e2e")
    stack = LocalStack(
        work / "data", work / "serve.log", ("--model-dir", str(work / "models")), startup_timeout=240
    )
    with stack:
        yield stack.target


@pytest.fixture(scope="module")
def client(target: str) -> Iterator[tinkerrpc.Client]:
    with tinkerrpc.Client(target, retry=FAST_RETRY) as sync_client:
        yield sync_client


def unique(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex[:8]}"


def group_of(samples: list[tinkerrpc.Sample]) -> tinkerrpc.TrajectoryGroup:
    """Single-turn trajectories of `PROMPT` with distinct rewards (a group with variance trains)."""
    return tinkerrpc.TrajectoryGroup(
        [tinkerrpc.Trajectory.from_sample(PROMPT, s, reward=float(i)) for i, s in enumerate(samples)]
    )


LOGPROB_SHIFT = 0.5


def lowered_logprobs(group: tinkerrpc.TrajectoryGroup) -> tinkerrpc.TrajectoryGroup:
    """Lowers every sampler logprob of the group by LOGPROB_SHIFT (in place): the importance ratios at the
    sampling policy become e^LOGPROB_SHIFT."""
    for trajectory in group.trajectories:
        trajectory.turns = [
            dataclasses.replace(turn, logprobs=tuple(lp - LOGPROB_SHIFT for lp in turn.logprobs))
            for turn in trajectory.turns
        ]
    return group


def expected_loss(groups: list[tinkerrpc.TrajectoryGroup], clip_high: float) -> float:
    """PPO's summed loss, −Σ min(r·A, min(r, clip_high)·A), at the sampling policy (r = e^LOGPROB_SHIFT on
    every completion token); an infinite clip_high gives importance sampling's."""
    ratio = math.exp(LOGPROB_SHIFT)
    total = 0.0
    for group in groups:
        mean = sum(group.rewards) / len(group.rewards)
        for trajectory in group.trajectories:
            advantage = trajectory.reward - mean
            tokens = sum(len(turn.completion_token_ids) for turn in trajectory.turns)
            total -= min(ratio * advantage, min(ratio, clip_high) * advantage) * tokens
    return total


def probe_logprobs(model: tinkerrpc.Model, version: int | None = None) -> list[float]:
    sample = model.sample(
        PROBE_TOKENS, max_tokens=1, seed=0, include_prompt_logprobs=True, policy_version=version
    )
    return list(sample[0].prompt_logprobs[1:])


def test_sync_client_whole_api(client: tinkerrpc.Client) -> None:
    name = unique("sync")
    model = client.create_model(name, base_model=TINY, lora_rank=8, seed=5, train_attn=False)
    info = model.info()
    assert (info.name, info.base_model, info.lora_rank, info.seed, info.train_attn) == (
        name,
        TINY,
        8,
        5,
        False,
    )
    assert info.policy_version == 0 and info.sampleable_versions == (0,) and info.vocab_size > 0
    assert name in [m.name for m in client.list_models()]

    samples = model.sample(PROMPT, n=3, max_tokens=4, seed=11)
    assert len(samples) == 3
    for sample in samples:
        assert len(sample.tokens) == len(sample.logprobs) <= 4 and sample.policy_version == 0
        assert sample.prompt_token_ids and sample.message is not None and sample.message.role == "assistant"
    assert [s.tokens for s in model.sample(PROMPT, n=3, max_tokens=4, seed=11)] == [s.tokens for s in samples]
    by_tokens = model.sample(list(samples[0].prompt_token_ids), max_tokens=4, seed=3)
    assert by_tokens[0].prompt_token_ids == samples[0].prompt_token_ids and by_tokens[0].message is None
    from_text = model.sample("plain text", max_tokens=2)[0]
    assert from_text.prompt_token_ids and from_text.message is None

    first = model.train([group_of(samples)], learning_rate=1e-2)
    assert first.policy_version == 1 and not first.replayed
    assert first.metrics.trajectories_used == 3 and first.metrics.mean_reward == pytest.approx(1.0)
    assert first.sampler_checkpoint is not None and first.sampler_checkpoint.policy_version == 1
    assert model.sample(PROMPT, max_tokens=2)[0].policy_version == 1
    assert model.sample(PROMPT, max_tokens=2, policy_version=0)[0].policy_version == 0

    sft = model.train_supervised([[*PROMPT, tinkerrpc.Message.assistant("yes")]], learning_rate=1e-2)
    assert sft.policy_version == 2 and sft.metrics.trained_tokens > 0
    assert model.info().sampleable_versions == (0, 1, 2)

    saved = model.save_checkpoint("after-sft")
    assert (saved.name, saved.policy_version, saved.kind) == ("after-sft", 2, "state")
    listed = {(c.name, c.kind): c.policy_version for c in model.checkpoints()}
    assert listed[("after-sft", "state")] == 2 and listed[("step_000001", "state")] == 1
    at_two = probe_logprobs(model)

    restored = model.restore("step_000001")
    assert restored.policy_version == 1 and model.info().policy_version == 1
    assert model.restore(saved).policy_version == 2
    assert probe_logprobs(model) == pytest.approx(at_two, abs=1e-5)

    # `after-sft` is now the state the model recovers from, so older ones are what can go.
    model.delete_checkpoint("step_000001")
    model.delete_checkpoint("v000001", kind="sampler")
    assert ("step_000001", "state") not in {(c.name, c.kind) for c in model.checkpoints()}
    assert model.info().sampleable_versions == (0, 2)
    with pytest.raises(tinkerrpc.NotFoundError):
        model.restore("step_000001")
    with pytest.raises(tinkerrpc.NotFoundError):
        model.sample(PROMPT, max_tokens=2, policy_version=1)
    with pytest.raises(tinkerrpc.FailedPreconditionError, match="after-sft"):
        model.delete_checkpoint(saved)

    client.delete_model(name)
    with pytest.raises(tinkerrpc.NotFoundError, match=name):
        client.get_model(name)
    assert name not in [m.name for m in client.list_models()]


def test_typed_errors_carry_the_servers_details(client: tinkerrpc.Client) -> None:
    name = unique("errors")
    model = client.create_model(name, base_model=TINY, lora_rank=4, seed=1)
    with pytest.raises(tinkerrpc.AlreadyExistsError, match=name):
        client.create_model(name, base_model=TINY)
    with pytest.raises(tinkerrpc.NotFoundError):
        client.model(unique("missing")).info()
    with pytest.raises(tinkerrpc.NotFoundError):
        model.sample(PROMPT, max_tokens=2, policy_version=7)

    with pytest.raises(tinkerrpc.InvalidArgumentError) as bad_sample:
        model.sample(PROMPT, max_tokens=2, top_p=2.0)
    assert [f for f, _ in bad_sample.value.field_violations] == ["params.top_p"]

    stale_samples = model.sample(PROMPT, n=2, max_tokens=3, seed=2)
    out_of_vocab = tinkerrpc.Trajectory(
        messages=list(PROMPT),
        turns=[tinkerrpc.SampledTurn(stale_samples[0].prompt_token_ids, (10**6,), (-1.0,), 0)],
        reward=1.0,
    )
    with pytest.raises(tinkerrpc.InvalidArgumentError) as bad_train:
        model.train([[out_of_vocab, tinkerrpc.Trajectory.from_sample(PROMPT, stale_samples[1])]])
    fields = [f for f, _ in bad_train.value.field_violations]
    assert fields == ["groups[0].trajectories[0].turns[0].completion_token_ids"]
    assert model.info().policy_version == 0, "a refused Train changes nothing"

    model.train_supervised([[*PROMPT, tinkerrpc.Message.assistant("no")]], learning_rate=1e-3)
    with pytest.raises(tinkerrpc.StalePolicyError) as stale:
        model.train([group_of(stale_samples)], max_staleness=0, strict_staleness=True)
    assert (stale.value.current_version, stale.value.sampled_version) == (1, 0)
    assert stale.value.code == grpc.StatusCode.FAILED_PRECONDITION
    assert model.info().policy_version == 1
    client.delete_model(name)


async def test_async_client_whole_api(target: str) -> None:
    name = unique("async")
    async with tinkerrpc.AsyncClient(target, retry=FAST_RETRY) as client:
        model = await client.create_model(name, base_model=TINY, lora_rank=4, seed=9)
        assert (await model.info()).policy_version == 0
        assert name in [m.name for m in await client.list_models()]

        async def rollout(seed: int) -> tinkerrpc.TrajectoryGroup:
            return group_of(await model.sample(PROMPT, n=2, max_tokens=3, seed=seed))

        gathered = await tinkerrpc.gather_groups([rollout(1), rollout(2)], max_concurrency=2, progress=False)
        assert len(gathered.results) == 2 and gathered.rewards.count == 4 and gathered.rewards.mean == 0.5
        groups = [lowered_logprobs(group) for group in gathered.results]
        result = await model.train(groups, learning_rate=1e-2, loss="ppo")
        assert result.policy_version == 1 and result.metrics.trajectories_used == 4
        # Every importance ratio is e^0.5, above PPO's default clip (1.2): importance sampling would
        # report a different loss.
        ppo = expected_loss(groups, clip_high=1.2)
        assert abs(ppo - expected_loss(groups, clip_high=math.inf)) > 0.1
        assert result.metrics.loss == pytest.approx(ppo, abs=1e-3)
        assert (await model.sample(PROMPT, max_tokens=2, policy_version=0))[0].policy_version == 0

        saved = await model.save_checkpoint("one")
        assert (saved.name, saved.policy_version) == ("one", 1)
        assert (await model.restore("step_000000")).policy_version == 0
        await model.delete_checkpoint(saved)
        assert "one" not in [c.name for c in await model.checkpoints()]
        with pytest.raises(tinkerrpc.NotFoundError):
            await model.restore("one")

        with pytest.raises(tinkerrpc.InvalidArgumentError) as bad:
            await model.sample(PROMPT, max_tokens=2, top_p=2.0)
        assert [f for f, _ in bad.value.field_violations] == ["params.top_p"]
        await client.delete_model(name)
        with pytest.raises(tinkerrpc.NotFoundError):
            await client.get_model(name)


class LostResponse(grpc.RpcError):
    """UNAVAILABLE as the caller sees it when the connection drops after the server answered."""

    def code(self) -> grpc.StatusCode:
        return grpc.StatusCode.UNAVAILABLE

    def details(self) -> str:
        return "connection lost before the response arrived (injected)"

    def trailing_metadata(self) -> tuple[()]:
        return ()


class DropFirstTrainResponse(grpc.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    """Lets every Train reach the server; the first one's response is discarded once it arrived."""

    def __init__(self) -> None:
        self.train_attempts: list[service_pb.TrainRequest] = []

    def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.ClientCallDetails, Any], Any],
        client_call_details: grpc.ClientCallDetails,
        request: Any,
    ) -> Any:
        if client_call_details.method != TRAIN_METHOD:
            return continuation(client_call_details, request)
        self.train_attempts.append(request)
        outcome = continuation(client_call_details, request)
        if len(self.train_attempts) == 1:
            outcome.result()  # the server has applied the step and answered
            raise LostResponse()
        return outcome


class AsyncDropFirstTrainResponse(grpc.aio.UnaryUnaryClientInterceptor):  # type: ignore[type-arg]
    """The grpc.aio twin of DropFirstTrainResponse."""

    def __init__(self) -> None:
        self.train_attempts: list[service_pb.TrainRequest] = []

    async def intercept_unary_unary(
        self,
        continuation: Callable[[grpc.aio.ClientCallDetails, Any], Awaitable[Any]],
        client_call_details: grpc.aio.ClientCallDetails,
        request: Any,
    ) -> Any:
        call = await continuation(client_call_details, request)
        method: str | bytes = client_call_details.method  # bytes at runtime, str in grpc-stubs
        if (method.decode() if isinstance(method, bytes) else method) != TRAIN_METHOD:
            return call
        self.train_attempts.append(request)
        if len(self.train_attempts) == 1:
            await call  # the server has applied the step and answered
            raise grpc.aio.AioRpcError(
                grpc.StatusCode.UNAVAILABLE,
                grpc.aio.Metadata(),
                grpc.aio.Metadata(),
                "connection lost before the response arrived (injected)",
                "",
            )
        return call


def test_train_is_exactly_once_when_the_response_is_lost(target: str, client: tinkerrpc.Client) -> None:
    """The faulty model and a reference trained once without the fault start from the same seed and
    train on the same trajectories: the same version and the same weights prove one step was applied."""
    faulty_name, reference_name = unique("faulty"), unique("reference")
    reference = client.create_model(reference_name, base_model=TINY, lora_rank=4, seed=21)
    samples = reference.sample(PROMPT, n=3, max_tokens=4, seed=4)
    interceptor = DropFirstTrainResponse()
    with tinkerrpc.Client(target, retry=FAST_RETRY, interceptors=[interceptor]) as faulty_client:
        faulty = faulty_client.create_model(faulty_name, base_model=TINY, lora_rank=4, seed=21)
        assert faulty.sample(PROMPT, n=3, max_tokens=4, seed=4) == samples
        before = probe_logprobs(faulty)

        result = faulty.train([group_of(samples)], learning_rate=1e-2)

        keys = [attempt.idempotency_key for attempt in interceptor.train_attempts]
        assert len(keys) == 2 and keys[0] == keys[1] != "", "the lost response is retried with the same key"
        assert result.replayed and result.policy_version == 1
        assert faulty.info().policy_version == 1 and faulty.info().sampleable_versions == (0, 1)
        after_fault = probe_logprobs(faulty)

    once = reference.train([group_of(samples)], learning_rate=1e-2)
    assert once.policy_version == 1 and not once.replayed
    after_once = probe_logprobs(reference)
    assert after_fault != pytest.approx(before, abs=1e-4), "the step moved the weights"
    assert after_fault == pytest.approx(after_once, abs=1e-5), "the step was applied exactly once"
    client.delete_model(faulty_name)
    client.delete_model(reference_name)


async def test_async_train_is_exactly_once_when_the_response_is_lost(
    target: str, client: tinkerrpc.Client
) -> None:
    name = unique("async-faulty")
    interceptor = AsyncDropFirstTrainResponse()
    async with tinkerrpc.AsyncClient(target, retry=FAST_RETRY, interceptors=[interceptor]) as faulty_client:
        model = await faulty_client.create_model(name, base_model=TINY, lora_rank=4, seed=3)
        samples = await model.sample(PROMPT, n=2, max_tokens=3, seed=8)
        result = await model.train([group_of(samples)], learning_rate=1e-2)
        keys = {attempt.idempotency_key for attempt in interceptor.train_attempts}
        assert len(interceptor.train_attempts) == 2 and len(keys) == 1
        assert result.replayed and result.policy_version == 1
        assert (await model.info()).policy_version == 1
        await faulty_client.delete_model(name)


def test_the_readme_quick_start_runs_twice(target: str, client: tinkerrpc.Client) -> None:
    """The README's SDK quick start, as written but for the address and fewer steps, run twice against
    one server: the second run continues the same model (exist_ok=True) instead of failing."""
    readme = (Path(__file__).resolve().parents[2] / "README.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", readme, flags=re.DOTALL)
    quick_start = next(b for b in blocks if 'create_model("my-run"' in b)
    code = quick_start.replace('"127.0.0.1:50051"', repr(target)).replace("range(10)", "range(1)")
    assert code != quick_start
    for _ in range(2):
        exec(compile(code, "README quick start", "exec"), {"__name__": "quick_start"})
    assert client.get_model("my-run").policy_version == 2
    assert {c.name for c in client.model("my-run").checkpoints()} >= {"after-rl-v1", "after-rl-v2"}
    client.delete_model("my-run")
