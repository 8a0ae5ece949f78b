"""The sample cache and Train's use of it: a turn without logprobs that names a genuine, unexpired key of
its exact tokens trains on the cached sampler logprobs with no scoring pass; a tampered, mismatched or
expired key is scored, never trusted; the cache's bounds evict. In-process over the fake backend (its
scoring pass gives every token SCORED_LOGPROB); test_train.py covers keys from the real Sample RPC."""

from __future__ import annotations

from pathlib import Path

import pytest
from fake_backend import SCORED_LOGPROB, FakeTinker
from in_process import InProcessService

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service.rendering import ChatCodecs
from tinkerrpc_server.service.sample_cache import SampleCache

PROMPT = [5, 6, 7]
COMPLETION = [8, 9]
LOGPROBS = [-0.25, -1.5]


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_key_finds_its_entry_only_with_the_same_model_version_and_tokens() -> None:
    cache = SampleCache()
    key = cache.put("m", 3, PROMPT, COMPLETION, LOGPROBS)
    assert cache.logprobs(key, "m", 3, PROMPT, COMPLETION) == tuple(LOGPROBS)
    assert cache.logprobs(key, "other", 3, PROMPT, COMPLETION) is None
    assert cache.logprobs(key, "m", 2, PROMPT, COMPLETION) is None
    assert cache.logprobs(key, "m", 3, [5, 6], COMPLETION) is None
    assert cache.logprobs(key, "m", 3, PROMPT, [8, 10]) is None
    nonce, mac = key.split(".")
    forged = f"{nonce}.{mac[:-1]}{'0' if mac[-1] != '0' else '1'}"
    assert cache.logprobs(forged, "m", 3, PROMPT, COMPLETION) is None
    # Another server's secret signs differently: its keys are not ours.
    assert SampleCache().logprobs(key, "m", 3, PROMPT, COMPLETION) is None


def test_entries_expire_and_the_bounds_evict_the_least_recently_used() -> None:
    clock = Clock()
    cache = SampleCache(ttl_seconds=10, max_entries=2, clock=clock)
    first = cache.put("m", 0, PROMPT, COMPLETION, LOGPROBS)
    second = cache.put("m", 0, PROMPT, [9], [-1.0])
    assert cache.logprobs(first, "m", 0, PROMPT, COMPLETION) is not None  # first is now the most recent
    cache.put("m", 0, PROMPT, [10], [-1.0])
    assert len(cache) == 2 and cache.logprobs(second, "m", 0, PROMPT, [9]) is None
    clock.now += 10
    assert cache.logprobs(first, "m", 0, PROMPT, COMPLETION) is None
    assert len(cache) == 1

    measured = SampleCache()
    measured.put("m", 0, PROMPT, COMPLETION, LOGPROBS)
    by_bytes = SampleCache(max_bytes=2 * measured.size_bytes)
    keys = [by_bytes.put("m", 0, PROMPT, COMPLETION, LOGPROBS) for _ in range(3)]
    assert len(by_bytes) == 2 and by_bytes.size_bytes == 2 * measured.size_bytes
    assert by_bytes.logprobs(keys[0], "m", 0, PROMPT, COMPLETION) is None
    assert by_bytes.logprobs(keys[2], "m", 0, PROMPT, COMPLETION) == tuple(LOGPROBS)
    # An entry larger than the whole bound is not kept: its key finds nothing.
    tiny = SampleCache(max_bytes=1)
    assert tiny.logprobs(tiny.put("m", 0, PROMPT, COMPLETION, LOGPROBS), "m", 0, PROMPT, COMPLETION) is None
    for bad in ({"ttl_seconds": 0}, {"max_entries": 0}, {"max_bytes": 0}):
        with pytest.raises(ValueError):
            SampleCache(**bad)  # type: ignore[arg-type]


def _request(keys: list[str]) -> pb.TrainRequest:
    """One group of trajectories on PROMPT + COMPLETION without logprobs, each naming its key."""
    request = pb.TrainRequest(model="m", adam=types_pb2.AdamParams(learning_rate=1e-3))
    group = request.groups.add()
    for reward, key in zip([1.0, 0.0], keys, strict=True):
        trajectory = group.trajectories.add(reward=reward)
        trajectory.turns.add(
            prompt_token_ids=PROMPT, completion_token_ids=COMPLETION, policy_version=0, sample_key=key
        )
    return request


async def _train(service: InProcessService, request: pb.TrainRequest) -> pb.TrainResponse:
    response = await service.trainer.train(request)
    await service.models.tidied(request.model)
    return response


def _trained_logprobs(service: InProcessService) -> list[list[float]]:
    client = service.fake.clients[-1]
    return [inputs["logprobs"][len(PROMPT) - 1 :] for _tokens, inputs in client.last_batch]


async def test_train_takes_the_cached_logprobs_and_scores_a_tampered_mismatched_or_expired_key(
    tmp_path: Path, codecs: ChatCodecs
) -> None:
    clock = Clock()
    service = InProcessService.open(
        tmp_path / "db.sqlite3", FakeTinker(), codecs, sample_cache=SampleCache(ttl_seconds=60, clock=clock)
    )
    await service.create("m")
    cache = service.sample_cache
    keys = [cache.put("m", 0, PROMPT, COMPLETION, LOGPROBS) for _ in range(2)]
    taken = await _train(service, _request(keys))
    assert taken.metrics.scored_tokens == 0
    assert _trained_logprobs(service) == [LOGPROBS, LOGPROBS]  # exactly the sampler's (float32-exact values)

    # Version 1 from here on: a tampered key, and a genuine key of other tokens.
    nonce, mac = cache.put("m", 1, PROMPT, COMPLETION, LOGPROBS).split(".")
    tampered = f"{nonce}.{'0' * len(mac)}"
    other_tokens = cache.put("m", 1, PROMPT, [8, 10], LOGPROBS)
    request = _request([tampered, other_tokens])
    for trajectory in request.groups[0].trajectories:
        trajectory.turns[0].policy_version = 1
    scored = await _train(service, request)
    assert scored.metrics.scored_tokens == 2 * len(COMPLETION)
    assert _trained_logprobs(service) == [[SCORED_LOGPROB] * 2] * 2

    expiring = [cache.put("m", 2, PROMPT, COMPLETION, LOGPROBS) for _ in range(2)]
    clock.now += 60
    request = _request(expiring)
    for trajectory in request.groups[0].trajectories:
        trajectory.turns[0].policy_version = 2
    expired = await _train(service, request)
    assert expired.metrics.scored_tokens == 2 * len(COMPLETION)
    assert _trained_logprobs(service) == [[SCORED_LOGPROB] * 2] * 2
    service.close()
