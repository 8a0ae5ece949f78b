"""The sample cache and Train's use of it: a turn without logprobs that names a genuine, unexpired key of
its exact tokens trains on the cached sampler logprobs with no scoring pass; a tampered, mismatched or
expired key is scored, never trusted; the cache's bounds evict. In-process over the fake backend (its
scoring pass gives every token SCORED_LOGPROB); test_train.py covers keys from the real Sample RPC."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from fake_backend import SCORED_LOGPROB, FakeTinker
from in_process import InProcessService

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service.rendering import ChatCodecs
from tinkerrpc_server.service.sample_cache import SampleCache

pytestmark = pytest.mark.unit

PROMPT = [5, 6, 7]
COMPLETION = [8, 9]
LOGPROBS = [-0.25, -1.5]


# The sampler weights every version has in the unit tests' caches.
WEIGHTS = "tinker://run/sampler_weights/v"


def cache_of(**bounds: Any) -> SampleCache:
    return SampleCache(lambda model, version: WEIGHTS, **bounds)


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_a_key_finds_its_entry_only_with_the_same_model_version_and_tokens() -> None:
    cache = cache_of()
    key = cache.put("m", 3, PROMPT, COMPLETION, LOGPROBS, sampled_from=WEIGHTS)
    assert cache.logprobs(key, "m", 3, PROMPT, COMPLETION) == tuple(LOGPROBS)
    assert cache.logprobs(key, "other", 3, PROMPT, COMPLETION) is None
    assert cache.logprobs(key, "m", 2, PROMPT, COMPLETION) is None
    assert cache.logprobs(key, "m", 3, [5, 6], COMPLETION) is None
    assert cache.logprobs(key, "m", 3, PROMPT, [8, 10]) is None
    nonce, mac = key.split(".")
    forged = f"{nonce}.{mac[:-1]}{'0' if mac[-1] != '0' else '1'}"
    assert cache.logprobs(forged, "m", 3, PROMPT, COMPLETION) is None
    # Another server's secret signs differently: its keys are not ours.
    assert cache_of().logprobs(key, "m", 3, PROMPT, COMPLETION) is None


def test_entries_expire_and_the_bounds_evict_the_least_recently_used() -> None:
    clock = Clock()
    cache = cache_of(ttl_seconds=10, max_entries=2, clock=clock)
    first = cache.put("m", 0, PROMPT, COMPLETION, LOGPROBS, sampled_from=WEIGHTS)
    second = cache.put("m", 0, PROMPT, [9], [-1.0], sampled_from=WEIGHTS)
    assert cache.logprobs(first, "m", 0, PROMPT, COMPLETION) is not None  # first is now the most recent
    cache.put("m", 0, PROMPT, [10], [-1.0], sampled_from=WEIGHTS)
    assert len(cache) == 2 and cache.logprobs(second, "m", 0, PROMPT, [9]) is None
    clock.now += 10
    assert cache.logprobs(first, "m", 0, PROMPT, COMPLETION) is None
    assert len(cache) == 1

    measured = cache_of()
    measured.put("m", 0, PROMPT, COMPLETION, LOGPROBS, sampled_from=WEIGHTS)
    by_bytes = cache_of(max_bytes=2 * measured.size_bytes)
    keys = [by_bytes.put("m", 0, PROMPT, COMPLETION, LOGPROBS, sampled_from=WEIGHTS) for _ in range(3)]
    assert len(by_bytes) == 2 and by_bytes.size_bytes == 2 * measured.size_bytes
    assert by_bytes.logprobs(keys[0], "m", 0, PROMPT, COMPLETION) is None
    assert by_bytes.logprobs(keys[2], "m", 0, PROMPT, COMPLETION) == tuple(LOGPROBS)
    # An entry larger than the whole bound is not kept: its key finds nothing.
    tiny = cache_of(max_bytes=1)
    assert (
        tiny.logprobs(
            tiny.put("m", 0, PROMPT, COMPLETION, LOGPROBS, sampled_from=WEIGHTS), "m", 0, PROMPT, COMPLETION
        )
        is None
    )
    for bad in ({"ttl_seconds": 0}, {"max_entries": 0}, {"max_bytes": 0}):
        with pytest.raises(ValueError):
            cache_of(**bad)


def test_discard_forgets_the_models_keys_from_a_version_on() -> None:
    cache = cache_of()
    keys = {
        (model, version): cache.put(model, version, PROMPT, COMPLETION, LOGPROBS, sampled_from=WEIGHTS)
        for model in ("m", "other")
        for version in range(4)
    }

    def kept() -> set[tuple[str, int]]:
        return {(m, v) for (m, v), key in keys.items() if cache.logprobs(key, m, v, PROMPT, COMPLETION)}

    cache.discard("m", 2)  # a restore to version 2: versions 2 and 3 of m are other weights from now on
    assert kept() == {("m", 0), ("m", 1)} | {("other", v) for v in range(4)}
    cache.discard("other")  # DeleteModel
    assert kept() == {("m", 0), ("m", 1)} and len(cache) == 2


def test_a_sample_whose_version_lost_its_weights_during_the_call_is_not_kept() -> None:
    first = "tinker://run-a/sampler_weights/v000001"
    current: dict[tuple[str, int], str] = {("m", 1): first}
    cache = SampleCache(lambda model, version: current.get((model, version)))
    drawn = cache.put("m", 1, PROMPT, COMPLETION, LOGPROBS, sampled_from=first)
    assert cache.logprobs(drawn, "m", 1, PROMPT, COMPLETION) == tuple(LOGPROBS)
    del current["m", 1]  # DeleteModel (or a restore) while the sample was drawn
    gone = cache.put("m", 1, PROMPT, COMPLETION, LOGPROBS, sampled_from=first)
    current["m", 1] = "tinker://run-b/sampler_weights/v000001"  # ... and version 1 trained again
    replaced = cache.put("m", 1, PROMPT, COMPLETION, LOGPROBS, sampled_from=first)
    assert cache.logprobs(gone, "m", 1, PROMPT, COMPLETION) is None
    assert cache.logprobs(replaced, "m", 1, PROMPT, COMPLETION) is None
    assert len(cache) == 1


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


def _put(service: InProcessService, version: int, completion: list[int] = COMPLETION) -> str:
    """A key for `completion` as Sample keeps it: drawn from the version's sampler weights now."""
    sampled_from = service.store.sampler_path("m", version)
    assert sampled_from is not None
    return service.sample_cache.put("m", version, PROMPT, completion, LOGPROBS, sampled_from=sampled_from)


def _trained_logprobs(service: InProcessService) -> list[list[float]]:
    client = service.fake.clients[-1]
    return [inputs["logprobs"][len(PROMPT) - 1 :] for _tokens, inputs in client.last_batch]


async def test_train_takes_the_cached_logprobs_and_scores_a_tampered_mismatched_or_expired_key(
    tmp_path: Path, codecs: ChatCodecs
) -> None:
    clock = Clock()
    service = InProcessService.open(
        tmp_path / "db.sqlite3",
        FakeTinker(),
        codecs,
        sample_cache=lambda sampler_of: SampleCache(sampler_of, ttl_seconds=60, clock=clock),
    )
    await service.create("m")
    keys = [_put(service, 0) for _ in range(2)]
    taken = await _train(service, _request(keys))
    assert taken.metrics.scored_tokens == 0
    assert _trained_logprobs(service) == [LOGPROBS, LOGPROBS]  # exactly the sampler's (float32-exact values)

    # Version 1 from here on: a tampered key, and a genuine key of other tokens.
    nonce, mac = _put(service, 1).split(".")
    tampered = f"{nonce}.{'0' * len(mac)}"
    other_tokens = _put(service, 1, [8, 10])
    request = _request([tampered, other_tokens])
    for trajectory in request.groups[0].trajectories:
        trajectory.turns[0].policy_version = 1
    scored = await _train(service, request)
    assert scored.metrics.scored_tokens == 2 * len(COMPLETION)
    assert _trained_logprobs(service) == [[SCORED_LOGPROB] * 2] * 2

    expiring = [_put(service, 2) for _ in range(2)]
    clock.now += 60
    request = _request(expiring)
    for trajectory in request.groups[0].trajectories:
        trajectory.turns[0].policy_version = 2
    expired = await _train(service, request)
    assert expired.metrics.scored_tokens == 2 * len(COMPLETION)
    assert _trained_logprobs(service) == [[SCORED_LOGPROB] * 2] * 2
    service.close()


def _turns_at(keys: list[tuple[str, int]]) -> pb.TrainRequest:
    """_request's two trajectories, each turn naming its (key, policy version)."""
    request = _request([key for key, _version in keys])
    for trajectory, (_key, version) in zip(request.groups[0].trajectories, keys, strict=True):
        trajectory.turns[0].policy_version = version
    return request


async def test_keys_of_versions_a_restore_or_delete_discarded_are_scored(
    tmp_path: Path, codecs: ChatCodecs
) -> None:
    """Issue 40 item 5: after a restore to an earlier version and a new step, or DeleteModel and a model
    of the same name, a key of a discarded version names weights that are gone: its turn is scored."""
    service = InProcessService.open(tmp_path / "db.sqlite3", FakeTinker(), codecs)
    await service.create("m")
    await service.train("m", "one")
    await service.checkpoints.save(pb.SaveCheckpointRequest(model="m", name="at-one"))
    at_zero, at_one = _put(service, 0), _put(service, 1)
    await service.train("m", "two")
    discarded = _put(service, 2)
    await service.checkpoints.restore(pb.RestoreCheckpointRequest(model="m", checkpoint="at-one"))
    await service.train("m", "another two")  # version 2 again, other weights
    fresh = _put(service, 2)

    one_turn = len(COMPLETION)
    # The discarded version 2's key is scored; the new version 2's is taken.
    assert (await _train(service, _turns_at([(discarded, 2), (fresh, 2)]))).metrics.scored_tokens == one_turn
    # The restored version itself is scored too (a restored checkpoint may come from another timeline);
    # versions before it were not discarded.
    assert (await _train(service, _turns_at([(at_one, 1), (at_zero, 0)]))).metrics.scored_tokens == one_turn

    before_delete = [_put(service, 0), _put(service, 1)]
    await service.models.delete("m")
    await service.create("m")
    await service.train("m", "one")
    scored = await _train(service, _turns_at([(before_delete[0], 0), (before_delete[1], 1)]))
    assert scored.metrics.scored_tokens == 2 * one_turn
    assert _trained_logprobs(service) == [[SCORED_LOGPROB] * 2] * 2
    service.close()
