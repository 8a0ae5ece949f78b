"""The engine's record of what it sampled (engine/sampled.py): bounded, and an id it no longer keeps is
refused saying that it expired, unlike one it never sampled."""

from __future__ import annotations

import pytest

from tinkerrpc.contract.limits import MAX_ENGINE_SAMPLED_SEQUENCES
from tinkerrpc_server.engine.compute.samples import SampledSeq, SampleJob, SampleOutput
from tinkerrpc_server.engine.futures import FailedResult
from tinkerrpc_server.engine.sampled import SampledSequences, UnknownSequence
from tinkerrpc_server.engine.snapshots import Sampler

pytestmark = pytest.mark.unit

INFLIGHT = Sampler("s1:sample:0", "tiny", "tinker://m/sampler_weights/a", None, "m", 3)


def answer(n: int) -> SampleOutput:
    return SampleOutput([SampledSeq([7 + i, 8], [-0.5, -0.25], "length") for i in range(n)], None, None)


def test_the_most_recent_sequences_are_kept_and_older_ones_expire() -> None:
    sampled = SampledSequences(capacity=3)
    job = SampleJob([1, 2, 3], 2, 2, temperature=0.7, record_stability_info=True)
    sampled.record("req-a", INFLIGHT, job, answer(2))
    sampled.record("req-b", INFLIGHT, job, answer(2))
    with pytest.raises(UnknownSequence, match="has expired: the engine keeps the 3 most recently"):
        sampled.get("req-a:0")
    kept = sampled.get("req-a:1")
    assert kept.prompt.tolist() == [1, 2, 3] and kept.tokens.tolist() == [8, 8]
    assert [(s.start, s.length, s.model_path, s.version) for s in kept.weights] == [
        (0, 2, "tinker://m/sampler_weights/a", 3)
    ]
    assert kept.stability is not None and kept.stability.logprobs.tolist() == [-0.5, -0.25]
    with pytest.raises(UnknownSequence, match="was not sampled by this engine"):
        sampled.get("req-c:0")


def test_a_failed_request_records_nothing_and_stability_only_when_asked() -> None:
    sampled = SampledSequences()
    assert sampled.capacity == MAX_ENGINE_SAMPLED_SEQUENCES
    sampled.record("req-f", INFLIGHT, SampleJob([1], 1, 1), FailedResult("bad", "user"))
    with pytest.raises(UnknownSequence, match="not sampled"):
        sampled.get("req-f:0")
    sampled.record("req-g", INFLIGHT, SampleJob([1], 1, 1), answer(1))
    assert sampled.get("req-g:0").stability is None
