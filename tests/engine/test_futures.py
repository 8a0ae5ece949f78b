"""The engine's request table keeps every pending request and only the last finished ones (a client that
lost a poll response asks again by id), bounded in count and in payload bytes, however many requests a
long run makes."""

from __future__ import annotations

import pytest

from tinkerrpc_server.engine.futures import FailedResult, FutureTable

pytestmark = pytest.mark.unit


def _finish(table: FutureTable, request_id: str) -> None:
    future = table.get(request_id)
    assert future is not None
    future.set_result(FailedResult(f"outcome of {request_id}", "user"))


def test_finished_requests_are_kept_up_to_the_bound_and_pending_ones_always() -> None:
    table = FutureTable[str](len, keep_finished=3, always_kept=1)
    pending = [table.create()[0] for _ in range(5)]
    finished_in_order = []
    for _ in range(200):
        request_id, _ = table.create()
        _finish(table, request_id)
        finished_in_order.append(request_id)
    # A request finishing long after it was created counts as finished last.
    _finish(table, pending[0])
    newest, _ = table.create()
    still_pending = [*pending[1:], newest]
    assert len(table) == len(still_pending) + 3
    for request_id in pending:
        assert table.get(request_id) is not None
    kept = [pending[0], *finished_in_order[-2:]]
    for request_id in kept:
        future = table.get(request_id)
        assert future is not None and future.result() == FailedResult(f"outcome of {request_id}", "user")
    assert all(table.get(request_id) is None for request_id in finished_in_order[:-2])


def test_a_request_rejected_before_queueing_is_answered_and_counts_as_finished() -> None:
    table = FutureTable[str](len, keep_finished=1, always_kept=1)
    first = table.failed("bad input")
    future = table.get(first)
    assert future is not None and future.result() == FailedResult("bad input", "user")
    table.failed("bad input again")
    table.create()
    assert table.get(first) is None


def test_finished_outcomes_are_bounded_in_bytes_but_the_last_few_always_kept() -> None:
    table = FutureTable[str](len, keep_finished=1000, keep_finished_bytes=100, always_kept=2)
    small = []
    for index in range(10):
        request_id, future = table.create()
        future.set_result(FailedResult(f"{index:040d}", "user"))  # 40 bytes
        small.append(request_id)
    table.create()
    # 2 x 40 bytes fit the budget, a third would not.
    assert [request_id for request_id in small if table.get(request_id) is not None] == small[-2:]
    large = []
    for _ in range(3):
        request_id, future = table.create()
        future.set_result(FailedResult("x" * 1000, "user"))
        large.append(request_id)
    table.create()
    assert [request_id for request_id in small + large if table.get(request_id) is not None] == large[-2:]
