"""Continuous batching and shared prompts in the sampler: requests join a running batch, finished rows
leave it, shared prefills sample what separate ones do, and the worker feeds arrivals into the batch."""

from __future__ import annotations

import time
from collections.abc import Iterator, Sequence
from pathlib import Path

import numpy as np
import pytest

from bench.gather_then_run import GATHER_THEN_RUN
from tinkerrpc_server.engine.compute.feed import DecodeStats, RequestFeed
from tinkerrpc_server.engine.compute.samples import SampleJob, SampleOutput
from tinkerrpc_server.engine.compute.scheduler import BatchPolicy
from tinkerrpc_server.engine.futures import FailedResult, Outcome, RequestFuture
from tinkerrpc_server.engine.runtime import BaseModelRuntime, EngineUserError
from tinkerrpc_server.engine.worker import ComputeWorker

pytestmark = pytest.mark.unit

PROMPT = [1, 291, 201, 420, 311, 408, 14, 338, 310, 409, 16, 2, 201, 1, 293, 201]
OTHER_PROMPT = [1, 293, 201, 77, 78, 79, 80, 2, 201, 1, 291, 201]


class ScriptedFeed:
    """Offers jobs at chosen turns of the decoding loop (it asks for arrivals once per decode step) and
    records the turn at which each was answered."""

    def __init__(
        self, arrivals: dict[int, list[SampleJob]], abandon_at: dict[int, int] | None = None
    ) -> None:
        self.stats = DecodeStats()
        self.rows_decoding = 0
        self.turn = -1
        self.arrivals = arrivals
        self.abandon_at = abandon_at or {}  # key -> turn at which its caller gives up
        self.results: dict[int, SampleOutput | EngineUserError] = {}
        self.answered_at: dict[int, int] = {}
        self.keys = 0

    def joining(self) -> Sequence[tuple[int, SampleJob]]:
        self.turn += 1
        jobs = self.arrivals.pop(self.turn, [])
        taken = [(self.keys + i, job) for i, job in enumerate(jobs)]
        self.keys += len(jobs)
        return taken

    def deliver(self, key: int, result: SampleOutput | EngineUserError) -> None:
        assert key not in self.results, f"request {key} answered twice"
        self.results[key] = result
        self.answered_at[key] = self.turn

    def abandoned(self) -> list[int]:
        gone = [k for k, turn in self.abandon_at.items() if turn <= self.turn and k not in self.results]
        for key in gone:
            del self.abandon_at[key]
        return gone

    def other_work_waiting(self) -> bool:
        return False

    def decoding(self, rows: int) -> None:
        self.rows_decoding = rows


def serve(
    runtime: BaseModelRuntime, sampler_dir: Path, feed: ScriptedFeed, policy: BatchPolicy | None = None
) -> None:
    """Run `feed`'s decode to its end (it never pauses: the feed has no other work)."""
    for _ in runtime.serve_samples(sampler_dir, feed, policy):
        pass


def output(feed: ScriptedFeed, key: int) -> SampleOutput:
    result = feed.results[key]
    assert isinstance(result, SampleOutput)
    return result


def assert_same_samples(got: SampleOutput, expected: SampleOutput) -> None:
    assert [s.tokens for s in got.sequences] == [s.tokens for s in expected.sequences]
    assert [s.stop_reason for s in got.sequences] == [s.stop_reason for s in expected.sequences]
    for mine, theirs in zip(got.sequences, expected.sequences, strict=True):
        np.testing.assert_allclose(mine.logprobs, theirs.logprobs, rtol=0, atol=1e-4)


@pytest.mark.parametrize(("chunk_tokens", "chunks_in_decode_steps"), [(512, 1), (5, 3)])
def test_a_request_joining_mid_batch_samples_what_it_samples_alone(
    runtime: BaseModelRuntime, sampler_dir: Path, chunk_tokens: int, chunks_in_decode_steps: int
) -> None:
    long = SampleJob(PROMPT, 1, 40, seed=1, stop_token_ids=[])
    joiner = SampleJob(
        OTHER_PROMPT, 2, 12, seed=7, stop_token_ids=[], include_prompt_logprobs=True, topk_prompt_logprobs=2
    )
    feed = ScriptedFeed({0: [long], 5: [joiner]})
    serve(runtime, sampler_dir, feed, policy=BatchPolicy(prefill_chunk_tokens=chunk_tokens))
    assert feed.stats.requests_joined_running_batch == 1
    # Its prompt (12 tokens) was prefilled in the running row's decode passes, one chunk per pass.
    assert feed.stats.prefill_chunks_in_decode_steps == chunks_in_decode_steps
    assert feed.answered_at[1] < feed.answered_at[0]  # answered while the long request still decodes
    assert_same_samples(output(feed, 0), runtime.sample(sampler_dir, [long])[0])
    alone = runtime.sample(sampler_dir, [joiner])[0]
    assert_same_samples(output(feed, 1), alone)
    joined = output(feed, 1)
    assert joined.prompt_logprobs is not None and alone.prompt_logprobs is not None
    np.testing.assert_allclose(
        np.array(joined.prompt_logprobs[1:], dtype=np.float64),
        np.array(alone.prompt_logprobs[1:], dtype=np.float64),
        atol=1e-4,
    )
    assert joined.topk_prompt_logprobs is not None and alone.topk_prompt_logprobs is not None
    assert [[t for t, _ in top or []] for top in joined.topk_prompt_logprobs] == [
        [t for t, _ in top or []] for top in alone.topk_prompt_logprobs
    ]


def test_finished_rows_leave_the_batch_and_their_request_is_answered_at_once(
    runtime: BaseModelRuntime, sampler_dir: Path
) -> None:
    short = SampleJob(PROMPT, 2, 3, seed=2, stop_token_ids=[])
    long = SampleJob(OTHER_PROMPT, 1, 20, seed=3, stop_token_ids=[])
    feed = ScriptedFeed({0: [short, long]})
    serve(runtime, sampler_dir, feed)
    assert feed.answered_at[0] <= 3 < feed.answered_at[1]
    assert [len(s.tokens) for s in output(feed, 0).sequences] == [3, 3]
    assert len(output(feed, 1).sequences[0].tokens) == 20
    stats = feed.stats
    assert stats.rows_left_early == 2 and stats.largest_decode_rows == 3
    # 2 steps with 3 rows, then the long row alone for the rest.
    assert stats.decoded_rows == 2 * 3 + (stats.decode_steps - 2)
    assert feed.rows_decoding == 0, "the last row's leaving is reported"


def test_shared_prefill_samples_what_separate_requests_sample(
    runtime: BaseModelRuntime, sampler_dir: Path
) -> None:
    job = SampleJob(PROMPT, 4, 10, seed=11, stop_token_ids=[], include_prompt_logprobs=True)
    twin = SampleJob(PROMPT, 1, 6, seed=50, stop_token_ids=[])
    feed = ScriptedFeed({0: [job, twin]})
    serve(runtime, sampler_dir, feed)
    assert feed.stats.shared_prefill_rows == 4  # 5 rows, one prefill
    # Until the twin's 6 tokens, all 5 rows hold the prompt's KV: attention reads it once for all.
    assert feed.stats.shared_prompt_decode_steps >= 5
    separate = [
        runtime.sample(sampler_dir, [SampleJob(PROMPT, 1, 10, seed=11 + i, stop_token_ids=[])])[0].sequences[
            0
        ]
        for i in range(4)
    ]
    shared = output(feed, 0)
    assert_same_samples(shared, SampleOutput(separate, None, None))
    assert_same_samples(output(feed, 1), runtime.sample(sampler_dir, [twin])[0])
    unshared = runtime.sample(sampler_dir, [job, twin], policy=BatchPolicy(share_prompts=False))
    assert_same_samples(shared, unshared[0])
    assert shared.prompt_logprobs is not None and unshared[0].prompt_logprobs is not None
    np.testing.assert_allclose(
        np.array(shared.prompt_logprobs[1:], dtype=np.float64),
        np.array(unshared[0].prompt_logprobs[1:], dtype=np.float64),
        atol=1e-4,
    )


def test_chunked_prefill_and_bounded_batches_sample_the_same(
    runtime: BaseModelRuntime, sampler_dir: Path
) -> None:
    jobs = [
        SampleJob(PROMPT * 3, 2, 8, seed=4, stop_token_ids=[], include_prompt_logprobs=True),
        SampleJob(OTHER_PROMPT, 1, 5, seed=5, stop_token_ids=[]),
        SampleJob([5, 6, 7], 3, 6, seed=6, stop_token_ids=[]),
    ]
    reference = runtime.sample(sampler_dir, jobs)
    tight = BatchPolicy(max_rows=3, max_kv_tokens=200, prefill_chunk_tokens=7)
    for got, expected in zip(runtime.sample(sampler_dir, jobs, policy=tight), reference, strict=True):
        assert_same_samples(got, expected)
        if expected.prompt_logprobs is not None:
            np.testing.assert_allclose(
                np.array(got.prompt_logprobs[1:], dtype=np.float64),  # type: ignore[index]
                np.array(expected.prompt_logprobs[1:], dtype=np.float64),
                atol=1e-4,
            )
    feed = ScriptedFeed({0: jobs})
    serve(runtime, sampler_dir, feed, policy=tight)
    assert feed.stats.largest_decode_rows <= 3 and len(feed.results) == 3
    assert feed.stats.prefill_chunks > 3


@pytest.mark.parametrize("field", ["max_rows", "max_kv_tokens", "prefill_chunk_tokens"])
def test_a_policy_bound_below_one_is_refused(field: str) -> None:
    with pytest.raises(ValueError, match=f"{field} must be at least 1"):
        BatchPolicy(**{field: 0})  # type: ignore[arg-type]


def test_gather_then_run_admits_only_into_an_empty_batch_and_answers_when_it_is_done(
    runtime: BaseModelRuntime, sampler_dir: Path
) -> None:
    long = SampleJob(PROMPT, 1, 15, seed=1, stop_token_ids=[])
    short = SampleJob(PROMPT, 1, 3, seed=3, stop_token_ids=[])
    late = SampleJob(OTHER_PROMPT, 1, 4, seed=2, stop_token_ids=[])
    feed = ScriptedFeed({0: [long, short], 3: [late]})
    serve(runtime, sampler_dir, feed, policy=GATHER_THEN_RUN)
    assert feed.stats.requests_joined_running_batch == 0 and feed.stats.shared_prefill_rows == 0
    # As the engine batched before continuous batching: the short row computes until the long one
    # stops (14 decode passes of 2 rows), then the late request's batch runs (3 passes of 1 row).
    assert feed.stats.rows_left_early == 0
    assert (feed.stats.decode_steps, feed.stats.decoded_rows) == (14 + 3, 2 * 14 + 3)
    assert feed.answered_at[0] == feed.answered_at[1] < feed.answered_at[2]
    for key, job in enumerate((long, short, late)):
        assert_same_samples(output(feed, key), runtime.sample(sampler_dir, [job])[0])


def test_abandoned_and_bad_requests_leave_without_disturbing_the_others(
    runtime: BaseModelRuntime, sampler_dir: Path
) -> None:
    kept = SampleJob(PROMPT, 2, 12, seed=8, stop_token_ids=[])
    given_up = SampleJob(OTHER_PROMPT, 3, 30, seed=9, stop_token_ids=[])
    bad = SampleJob([1, 10**6], 1, 4)
    feed = ScriptedFeed({0: [kept, given_up], 2: [bad]}, abandon_at={1: 4})
    serve(runtime, sampler_dir, feed)
    assert 1 not in feed.results
    assert isinstance(feed.results[2], EngineUserError) and "vocabulary" in str(feed.results[2])
    assert_same_samples(output(feed, 0), runtime.sample(sampler_dir, [kept])[0])
    assert feed.stats.decoded_rows < feed.stats.decode_steps * 5


def test_stops_and_max_tokens_end_rows_inside_a_continuous_batch(
    runtime: BaseModelRuntime, sampler_dir: Path
) -> None:
    greedy = runtime.sample(sampler_dir, [SampleJob(PROMPT, 1, 12, temperature=0.0, stop_token_ids=[])])[0]
    stop_id = greedy.sequences[0].tokens[4]
    first = greedy.sequences[0].tokens.index(stop_id)
    stopping = SampleJob(PROMPT, 1, 12, temperature=0.0, stop_token_ids=[stop_id])
    feed = ScriptedFeed({0: [SampleJob(OTHER_PROMPT, 1, 25, seed=1, stop_token_ids=[])], 3: [stopping]})
    serve(runtime, sampler_dir, feed)
    seq = output(feed, 1).sequences[0]
    assert seq.tokens == greedy.sequences[0].tokens[: first + 1] and seq.stop_reason == "stop"
    assert output(feed, 0).sequences[0].stop_reason == "length"


def test_the_worker_feeds_requests_arriving_during_a_batch_into_it() -> None:
    worker = ComputeWorker(lambda exc: FailedResult(str(exc), "internal"))
    seen: list[list[str]] = []

    def answer(feed: RequestFeed[str, Outcome]) -> Iterator[None]:
        joined = list(feed.joining())
        seen.append([payload for _, payload in joined])
        for key, payload in joined:
            feed.deliver(key, FailedResult(f"answered {payload}", "user"))
        yield from ()

    def run_batch(feed: RequestFeed[str, Outcome]) -> Iterator[None]:
        first = list(feed.joining())
        seen.append([payload for _, payload in first])
        worker.submit_sample("model", "weights", "test", run_batch, "late", futures["late"])
        seen.append([payload for _, payload in feed.joining()])
        # Other weights of the same model have now waited longer than this sampler's next request:
        # none joins.
        worker.submit_sample("model", "other weights", "test", answer, "other", futures["other"])
        worker.submit_sample("model", "weights", "test", answer, "later", futures["later"])
        seen.append([payload for _, payload in feed.joining()])
        feed.deliver(first[0][0], FailedResult("answered first", "user"))
        assert not futures["late"].done()  # each request is answered on its own
        feed.deliver(first[0][0] + 1, FailedResult("answered late", "user"))
        yield

    futures = {name: RequestFuture() for name in ("first", "late", "other", "later")}
    try:
        worker.submit_sample("model", "weights", "test", run_batch, "first", futures["first"])
        outcomes = {name: future.result(timeout=30) for name, future in futures.items()}
    finally:
        worker.stop()
    assert seen == [["first"], ["late"], [], ["other"], ["later"]]
    assert {name: o.message for name, o in outcomes.items() if isinstance(o, FailedResult)} == {
        name: f"answered {name}" for name in futures
    }
    stats = worker.stats
    assert (stats.sample_batches, stats.sample_requests, stats.sample_requests_joined_later) == (3, 4, 1)


def test_the_decoding_rows_gauge_is_per_base_model() -> None:
    """Two base models' batches take turns: each reports its own rows, one ending leaves the other's
    count, and a batch that ends without reporting its rows gone is dropped from the gauge anyway."""
    worker = ComputeWorker(lambda exc: FailedResult(str(exc), "internal"))
    futures = {name: RequestFuture() for name in ("a", "b")}
    seen: list[dict[str, int]] = []

    def run_b(feed: RequestFeed[str, Outcome]) -> Iterator[None]:
        ((key, _),) = feed.joining()
        feed.decoding(2)
        seen.append(worker.stats.decoding_rows)
        yield
        feed.decoding(0)
        seen.append(worker.stats.decoding_rows)
        feed.deliver(key, FailedResult("answered b", "user"))

    def run_a(feed: RequestFeed[str, Outcome]) -> Iterator[None]:
        ((key, _),) = feed.joining()
        feed.decoding(3)
        worker.submit_sample("model-b", "weights-b", "test", run_b, "b", futures["b"])
        while not futures["b"].done():
            yield  # model-b's batch takes its turns meanwhile
        seen.append(worker.stats.decoding_rows)
        feed.deliver(key, FailedResult("answered a", "user"))  # its rows never reported gone

    try:
        worker.submit_sample("model-a", "weights-a", "test", run_a, "a", futures["a"])
        for future in futures.values():
            future.result(timeout=30)
        # model-a's batch ends on the compute thread just after its answer.
        deadline = time.monotonic() + 30
        while worker.stats.decoding_rows and time.monotonic() < deadline:
            time.sleep(0.01)
    finally:
        worker.stop()
    assert seen == [{"model-a": 3, "model-b": 2}, {"model-a": 3}, {"model-a": 3}]
    assert worker.stats.decoding_rows == {}


def test_rows_leaving_from_anywhere_in_the_batch_keep_the_others_samples(
    runtime: BaseModelRuntime, sampler_dir: Path
) -> None:
    """Rows leave from the front and the middle (the last rows move into their places), a long prompt
    leaves (its padding columns are cut off), and a request joins after them: every request samples
    what it samples alone."""
    jobs = [
        SampleJob(PROMPT * 4, 1, 3, seed=21, stop_token_ids=[]),  # 64-token prompt, leaves first
        SampleJob(OTHER_PROMPT, 2, 14, seed=22, stop_token_ids=[]),
        SampleJob([7, 8, 9], 1, 6, seed=23, stop_token_ids=[]),  # leaves from the middle
        SampleJob(PROMPT, 3, 18, seed=24, stop_token_ids=[]),
    ]
    late = SampleJob(OTHER_PROMPT[:5], 2, 9, seed=25, stop_token_ids=[])
    feed = ScriptedFeed({0: jobs, 8: [late]})
    serve(runtime, sampler_dir, feed)
    assert feed.stats.rows_left_early >= 2 and feed.stats.requests_joined_running_batch == 1
    for key, job in enumerate([*jobs, late]):
        assert_same_samples(output(feed, key), runtime.sample(sampler_dir, [job])[0])
