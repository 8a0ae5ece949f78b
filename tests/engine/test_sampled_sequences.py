"""The engine's record of what it sampled (engine/sampled.py): bounded, shared fairly between the sessions
that sampled, and an id it no longer keeps is refused saying that it expired, unlike one it never
sampled."""

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
    sampled.record("s1", "req-a", INFLIGHT, job, answer(2))
    sampled.record("s1", "req-b", INFLIGHT, job, answer(2))
    with pytest.raises(UnknownSequence, match="has expired: the engine keeps 3 sampled sequences"):
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
    sampled.record("s1", "req-f", INFLIGHT, SampleJob([1], 1, 1), FailedResult("bad", "user"))
    with pytest.raises(UnknownSequence, match="not sampled"):
        sampled.get("req-f:0")
    sampled.record("s1", "req-g", INFLIGHT, SampleJob([1], 1, 1), answer(1))
    assert sampled.get("req-g:0").stability is None


BASE = Sampler("", "tiny", None, None)


def kept_ids(sampled: SampledSequences, ids: list[str]) -> list[str]:
    """Those of `ids` the engine keeps; each other one must be refused as expired."""
    kept = []
    for sequence_id in ids:
        try:
            sampled.get(sequence_id)
            kept.append(sequence_id)
        except UnknownSequence as exc:
            assert "has expired" in str(exc)
    return kept


def test_a_busy_session_expires_its_own_sequences_not_a_quieter_ones() -> None:
    sampled = SampledSequences(capacity=8)
    job = SampleJob([1, 2], 2, 2)
    quiet = ["quiet-1:0", "quiet-1:1", "quiet-2:0"]
    sampled.record("sA", "quiet-1", BASE, job, answer(2))
    sampled.record("sA", "quiet-2", BASE, job, answer(1))
    busy = [f"busy-{n}" for n in range(5)]
    for request_id in busy:  # 10 sequences of sB, more than the cap alone
        sampled.record("sB", request_id, BASE, job, answer(2))
    # Under a global count sA's 3 would have gone first; here sB's own oldest go.
    assert kept_ids(sampled, quiet) == quiet
    busy_ids = [f"{r}:{i}" for r in busy for i in range(2)]
    assert kept_ids(sampled, busy_ids) == busy_ids[-5:]  # 8 in all: sB keeps its newest 5
    with pytest.raises(UnknownSequence, match="has expired"):
        sampled.get("busy-0:0")
    with pytest.raises(UnknownSequence, match="was not sampled by this engine"):
        sampled.get("busy-99:0")


def test_past_the_cap_the_session_keeping_most_gives_up_its_oldest_and_of_equals_the_oldest() -> None:
    sampled = SampledSequences(capacity=6)
    job = SampleJob([1], 1, 1)
    for session in ("s1", "s2", "s3"):
        sampled.record(session, f"{session}-a", BASE, job, answer(2))
    # Full at 2 each: a third sequence of s2 expires s2's oldest (s2 keeps the most).
    sampled.record("s2", "s2-b", BASE, job, answer(1))
    assert kept_ids(sampled, ["s2-a:0", "s2-a:1", "s2-b:0"]) == ["s2-a:1", "s2-b:0"]
    assert kept_ids(sampled, ["s1-a:0", "s1-a:1", "s3-a:0", "s3-a:1"]) == [
        "s1-a:0",
        "s1-a:1",
        "s3-a:0",
        "s3-a:1",
    ]
    # A new session's sequence: s1, s2 and s3 keep 2 each, and s1's oldest is the oldest of all.
    sampled.record("s4", "s4-a", BASE, job, answer(1))
    assert kept_ids(sampled, ["s1-a:0", "s1-a:1", "s3-a:0", "s3-a:1"]) == ["s1-a:1", "s3-a:0", "s3-a:1"]
    # A session sampling 4 at once past a full cap: it keeps the most, so its own 2 oldest go.
    sampled.record("s5", "s5-a", BASE, job, answer(4))
    assert kept_ids(sampled, [f"s5-a:{i}" for i in range(4)]) == ["s5-a:2", "s5-a:3"]
    # s5's 2 oldest went while it kept the most; then s2, s3 and s5 kept 2 each: s2's and s3's oldest went.
    assert kept_ids(sampled, ["s1-a:1", "s2-a:1", "s2-b:0", "s3-a:0", "s3-a:1", "s4-a:0"]) == [
        "s1-a:1",
        "s2-b:0",
        "s3-a:1",
        "s4-a:0",
    ]  # 6 in all, every session keeps 1 at least
