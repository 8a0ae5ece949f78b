"""The gathering rules of sidecar/coalescing.py on their own: the windows are measured on a clock the test
advances by hand, and the upstream call answers when the test lets it, so nothing here depends on how
fast this machine runs."""

from __future__ import annotations

import asyncio
import dataclasses
import heapq
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import grpc
import pytest

from tinkerrpc import RPCError, Sample, SamplingOptions
from tinkerrpc_server.sidecar.coalescing import (
    GATHER_IDLE_SECONDS,
    GATHER_MAX_SECONDS,
    MAX_MERGED_N,
    SampleCoalescer,
)
from tinkerrpc_server.sidecar.sampling_args import Prompt

pytestmark = pytest.mark.unit

ARGS = SamplingOptions(max_tokens=4, return_token_texts=True)
MS = 0.001


def args(**changes: Any) -> SamplingOptions:
    return dataclasses.replace(ARGS, **changes)


@dataclass(order=True)
class _Timer:
    due: float
    order: int
    callback: Callable[..., object] = field(compare=False)
    args: tuple[Any, ...] = field(compare=False)
    cancelled: bool = field(default=False, compare=False)

    def cancel(self) -> None:
        self.cancelled = True


class ManualClock:
    """A GatherClock that only moves when `advance` is called; due timers run then, in order."""

    def __init__(self) -> None:
        self.now = 0.0
        self._timers: list[_Timer] = []
        self._made = 0

    def time(self) -> float:
        return self.now

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> _Timer:
        self._made += 1
        timer = _Timer(self.now + delay, self._made, callback, args)
        heapq.heappush(self._timers, timer)
        return timer

    async def advance(self, seconds: float) -> None:
        """Move the clock, run the timers now due, and let the tasks they start take their first steps."""
        self.now += seconds
        while self._timers and self._timers[0].due <= self.now + 1e-12:
            timer = heapq.heappop(self._timers)
            if not timer.cancelled:
                timer.callback(*timer.args)
        await settle()


async def settle() -> None:
    """Let every ready task run until it waits on something that is not ready."""
    for _ in range(10):
        await asyncio.sleep(0)


class Upstream:
    """An upstream Sample call that answers n numbered samples once `release` is set (at once when
    `gated` is False), or fails as told."""

    def __init__(self, max_n: int | None = None, gated: bool = False) -> None:
        self.calls: list[int] = []
        self.cancelled = 0
        self.max_n = max_n
        self.release = asyncio.Event()
        if not gated:
            self.release.set()

    async def __call__(self, name: str, prompt: Prompt, args: SamplingOptions) -> list[Sample]:
        self.calls.append(args.n)
        start = sum(self.calls[:-1])
        if self.max_n is not None and args.n > self.max_n:
            raise RPCError(grpc.StatusCode.INVALID_ARGUMENT, f"params.n: {args.n} is over the limit")
        try:
            await self.release.wait()
        except asyncio.CancelledError:
            self.cancelled += 1
            raise
        return [Sample((start + i,), (0.0,), f"{start + i}", None, "length", 0, (1,)) for i in range(args.n)]


def start(
    coalescer: SampleCoalescer, *requests: tuple[Prompt, SamplingOptions]
) -> list[asyncio.Task[list[Sample]]]:
    return [asyncio.ensure_future(coalescer.sample("m", prompt, a)) for prompt, a in requests]


async def test_a_lone_request_waits_the_idle_window_and_no_longer() -> None:
    clock, upstream = ManualClock(), Upstream()
    coalescer = SampleCoalescer(upstream, clock=clock)
    (lone,) = start(coalescer, ("p", ARGS))
    await settle()
    await clock.advance(GATHER_IDLE_SECONDS - 0.1 * MS)
    assert upstream.calls == [] and not lone.done()
    await clock.advance(0.1 * MS)
    assert upstream.calls == [1]
    assert [s.tokens for s in await lone] == [(0,)]


async def test_a_group_gathers_while_members_keep_coming_and_closes_at_its_longest_window() -> None:
    clock, upstream = ManualClock(), Upstream()
    merged: list[int] = []
    coalescer = SampleCoalescer(upstream, merged.append, clock=clock)
    members: list[asyncio.Task[list[Sample]]] = []
    # One member every 1.5 ms (inside the 2 ms idle window), the last at 19.5 ms: the group stays open
    # until 20 ms after its first member, then closes; the member arriving after that opens the next group.
    arrivals = 14
    for k in range(arrivals):
        assert upstream.calls == [], f"drawn before member {k} arrived at {clock.now * 1000:.1f} ms"
        members += start(coalescer, ("p", ARGS))
        await settle()
        if k < arrivals - 1:
            await clock.advance(1.5 * MS)
    await clock.advance(GATHER_MAX_SECONDS - clock.now - 0.01 * MS)
    assert upstream.calls == []
    await clock.advance(0.01 * MS)
    assert upstream.calls == [arrivals] and merged == [arrivals]
    late = start(coalescer, ("p", ARGS))
    await settle()
    await clock.advance(GATHER_IDLE_SECONDS)
    assert upstream.calls == [arrivals, 1]
    answers = await asyncio.gather(*members, *late)
    tokens = [s.tokens for answer in answers for s in answer]
    assert len(tokens) == len(set(tokens)) == arrivals + 1, "each member has samples of its own"


async def test_members_further_apart_than_the_idle_window_are_drawn_apart() -> None:
    clock, upstream = ManualClock(), Upstream()
    coalescer = SampleCoalescer(upstream, clock=clock)
    first = start(coalescer, ("p", ARGS))
    await settle()
    await clock.advance(GATHER_IDLE_SECONDS + 0.5 * MS)
    second = start(coalescer, ("p", ARGS))
    await settle()
    await clock.advance(GATHER_IDLE_SECONDS)
    assert upstream.calls == [1, 1]
    await asyncio.gather(*first, *second)


async def test_a_full_group_is_drawn_at_once_and_the_rest_go_on_gathering() -> None:
    clock, upstream = ManualClock(), Upstream()
    merged: list[int] = []
    coalescer = SampleCoalescer(upstream, merged.append, clock=clock)
    members = start(coalescer, *[("p", ARGS)] * (MAX_MERGED_N + 3))
    await settle()
    await clock.advance(0.0)
    assert upstream.calls == [MAX_MERGED_N], "the full group does not wait for the window"
    await clock.advance(GATHER_IDLE_SECONDS)
    assert upstream.calls == [MAX_MERGED_N, 3] and merged == [MAX_MERGED_N, 3]
    tokens = [s.tokens for answer in await asyncio.gather(*members) for s in answer]
    assert len(tokens) == len(set(tokens)) == MAX_MERGED_N + 3


async def test_different_requests_never_share_a_call_and_seeded_ones_go_alone() -> None:
    clock, upstream = ManualClock(), Upstream()
    coalescer = SampleCoalescer(upstream, clock=clock)
    members = start(
        coalescer,
        ("p", ARGS),
        ("q", ARGS),
        ("p", args(temperature=0.5)),
        ("p", args(stop=["x"])),
        ("p", args(max_tokens=5)),
        ("p", args(seed=3)),
        ("p", args(seed=3)),
        ("p", args(n=MAX_MERGED_N)),
    )
    await settle()
    # The seeded and the full-size requests were sent without waiting.
    assert sorted(upstream.calls) == [1, 1, MAX_MERGED_N]
    await clock.advance(GATHER_IDLE_SECONDS)
    assert sorted(upstream.calls) == [1] * 7 + [MAX_MERGED_N]
    await asyncio.gather(*members)
    # And a request of another model never joins this model's group.
    other = asyncio.ensure_future(coalescer.sample("other", "p", ARGS))
    same = start(coalescer, ("p", ARGS))
    await settle()
    await clock.advance(GATHER_IDLE_SECONDS)
    assert upstream.calls[-2:] == [1, 1]
    await asyncio.gather(other, *same)


async def test_a_refused_merged_call_gives_each_member_its_own_answer() -> None:
    """--max-sample-n 4: n=5, n=1 and n=1 together are refused as n=7; alone, the n=5 request is
    refused and the two n=1 requests are answered (issue 40 item 3)."""
    clock, upstream = ManualClock(), Upstream(max_n=4)
    coalescer = SampleCoalescer(upstream, clock=clock)
    big, one, other = start(coalescer, ("p", args(n=5)), ("p", ARGS), ("p", ARGS))
    await settle()
    await clock.advance(GATHER_IDLE_SECONDS)
    await settle()
    assert upstream.calls == [7, 5, 1, 1]
    with pytest.raises(RPCError) as refused:
        await big
    assert refused.value.code == grpc.StatusCode.INVALID_ARGUMENT and "5 is over" in refused.value.message
    assert [s.tokens for s in await one] == [(12,)] and [s.tokens for s in await other] == [(13,)]
    # Two refused members each get their own refusal (not one shared object with the other's n).
    first, second, fine = start(coalescer, ("p", args(n=6)), ("p", args(n=5)), ("p", ARGS))
    await settle()
    await clock.advance(GATHER_IDLE_SECONDS)
    await settle()
    errors = []
    for member in (first, second):
        with pytest.raises(RPCError) as own:
            await member
        errors.append(own.value.message)
    assert errors == ["params.n: 6 is over the limit", "params.n: 5 is over the limit"]
    assert len(await fine) == 1


async def test_a_failure_other_than_a_refusal_is_every_members() -> None:
    clock = ManualClock()

    async def unavailable(name: str, prompt: Prompt, a: SamplingOptions) -> list[Sample]:
        raise RPCError(grpc.StatusCode.UNAVAILABLE, "the server is restarting")

    coalescer = SampleCoalescer(unavailable, clock=clock)
    members = start(coalescer, ("p", ARGS), ("p", ARGS))
    await settle()
    await clock.advance(GATHER_IDLE_SECONDS)
    for member in members:
        with pytest.raises(RPCError) as failed:
            await member
        assert failed.value.code == grpc.StatusCode.UNAVAILABLE


async def test_a_member_that_goes_away_leaves_the_call_to_the_others() -> None:
    clock, upstream = ManualClock(), Upstream(gated=True)
    coalescer = SampleCoalescer(upstream, clock=clock)
    leaving, staying = start(coalescer, ("p", ARGS), ("p", ARGS))
    await settle()
    await clock.advance(GATHER_IDLE_SECONDS)
    assert upstream.calls == [2]
    leaving.cancel()
    await settle()
    upstream.release.set()
    assert len(await staying) == 1 and upstream.cancelled == 0
    # When every member goes away, the call is dropped.
    upstream.release.clear()
    lone = start(coalescer, ("p", ARGS), ("p", ARGS))
    await settle()
    await clock.advance(GATHER_IDLE_SECONDS)
    assert upstream.calls == [2, 2]
    for member in lone:
        member.cancel()
    await settle()
    assert upstream.cancelled == 1
    # Members that go away before the flush leave nothing to draw.
    gone = start(coalescer, ("p", ARGS))
    await settle()
    gone[0].cancel()
    await settle()
    await clock.advance(GATHER_IDLE_SECONDS)
    assert upstream.calls == [2, 2]
