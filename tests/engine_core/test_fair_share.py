"""The compute thread's fair share (engine/fair_share.py) and the worker running it: the least served
participant goes next, a newcomer at once, and a lane's batch pauses between steps for another lane."""

from __future__ import annotations

import threading
import time
from collections.abc import Iterator

import pytest

from tinkerrpc_server.engine.compute.feed import RequestFeed
from tinkerrpc_server.engine.fair_share import FairShare
from tinkerrpc_server.engine.futures import FailedResult, Outcome, RequestFuture
from tinkerrpc_server.engine.worker import ComputeWorker

pytestmark = pytest.mark.unit


def test_the_least_served_goes_next_and_a_newcomer_starts_one_pass_ahead() -> None:
    share = FairShare()
    assert share.next_turn(["big"]) == "big"
    share.charge("big", 0.5)
    # A newcomer starts one pass (big's last, 0.5 s) ahead of the least served, with no turn behind it:
    # it runs until its time reaches big's with big's last turn added (1.0 s), then big's turn comes.
    for _ in range(7):
        assert share.next_turn(["big", "small"]) == "small"
        share.charge("small", 0.125)
    assert share.next_turn(["big", "small"]) == "big"  # a tie at 1.0 s: big waited longer
    share.charge("big", 0.5)
    assert share.next_turn(["big", "small"]) == "small"
    # Idle time earns no more credit than that: back after a pause, a participant starts one pass ahead
    # of the others again (big's 2.0 s pass), not with the seconds it was away.
    assert share.next_turn(["big"]) == "big"
    share.charge("big", 2.0)
    assert share.next_turn(["big", "small"]) == "small"
    share.charge("small", 3.0)
    assert share.next_turn(["big", "small"]) == "big"


def test_a_turn_of_many_passes_credits_a_newcomer_with_one_pass() -> None:
    share = FairShare()
    assert share.next_turn(["big"]) == "big"
    share.charge("big", 10.0, passes=100)  # decoding alone: 100 steps of 0.1 s in one turn
    assert share.next_turn(["big", "small"]) == "small"  # starts at 10.0 - 0.1 s
    share.charge("small", 0.15)
    assert share.next_turn(["big", "small"]) == "big"  # 10.0 + 0.1 < 10.05 + 0.15


def test_a_lane_s_request_runs_between_the_steps_of_another_lane_s_long_batch() -> None:
    """A long batch of 40 steps of 50 ms; a request for another lane arrives after a few: it is answered
    after about one step of the long batch, long before the batch ends."""
    worker = ComputeWorker(lambda exc: FailedResult(str(exc), "internal"))
    events: list[str] = []

    def long_batch(feed: RequestFeed[str, Outcome]) -> Iterator[None]:
        [(key, _)] = feed.joining()
        for step in range(40):
            time.sleep(0.05)
            events.append(f"long {step}")
            if step == 2:
                worker.submit_sample("small model", "small", "test", short_batch, "short", short)
            if feed.other_work_waiting():
                yield
        feed.deliver(key, FailedResult("long done", "user"))

    def short_batch(feed: RequestFeed[str, Outcome]) -> Iterator[None]:
        [(key, _)] = feed.joining()
        for step in range(3):
            time.sleep(0.001)
            events.append(f"short {step}")
            if feed.other_work_waiting():
                yield
        feed.deliver(key, FailedResult("short done", "user"))

    long, short = RequestFuture[object](), RequestFuture[object]()
    try:
        worker.submit_sample("large model", "large", "test", long_batch, "long", long)
        assert isinstance(outcome := long.result(timeout=30), FailedResult) and outcome.message == "long done"
        assert (
            isinstance(outcome := short.result(timeout=1), FailedResult) and outcome.message == "short done"
        )
    finally:
        worker.stop()
    # The short lane's 3 steps (about 3 ms) fit in one long step's share: they run back to back once the
    # 5 ms gathering window has passed, at most a few long steps after the request arrived.
    first_short = events.index("short 0")
    assert events[first_short : first_short + 3] == ["short 0", "short 1", "short 2"]
    assert first_short <= events.index("long 2") + 3
    assert worker.stats.sample_turns_to_other_models == 1  # long to short, while long still ran


def test_stopping_finishes_the_running_batch_and_starts_no_other() -> None:
    worker = ComputeWorker(lambda exc: FailedResult(str(exc), "internal"))
    running, release = threading.Event(), threading.Event()

    def blocking_batch(feed: RequestFeed[str, Outcome]) -> Iterator[None]:
        [(key, _)] = feed.joining()
        running.set()
        release.wait(timeout=10)
        feed.deliver(key, FailedResult("finished", "user"))
        yield from ()

    def never_started(feed: RequestFeed[str, Outcome]) -> Iterator[None]:
        raise AssertionError("a batch started after stop()")

    first, second = RequestFuture[object](), RequestFuture[object]()
    worker.submit_sample("large model", "large", "test", blocking_batch, "first", first)
    assert running.wait(timeout=10)
    worker.submit_sample("small model", "small", "test", never_started, "second", second)
    stopping = threading.Thread(target=worker.stop)
    stopping.start()
    time.sleep(0.05)
    release.set()
    stopping.join(timeout=30)
    assert isinstance(outcome := first.result(timeout=1), FailedResult) and outcome.message == "finished"
    assert not second.done()
