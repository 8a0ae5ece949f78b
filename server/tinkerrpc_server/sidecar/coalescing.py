"""Identical sample requests that arrive together go upstream as one Sample call.

An RL rollout loop sends the same prompt many times at once (ART: 8 rollouts of each of 8 prompts, each
its own chat completion with n=1). Each request would cost a gRPC call, a chat rendering and an engine
request of its own; at short completions those per-request costs, not decoding, bound the rollouts.
Requests with equal arguments (model, pinned version, prompt and every sampling knob but n) and no seed
are drawn together as one call with n = the sum of theirs and the samples handed back in arrival order:
unseeded samples of one prompt are independent draws either way, and the engine prefills the prompt once.

A group gathers while identical requests keep arriving, at most GATHER_IDLE_SECONDS apart and for at
most GATHER_MAX_SECONDS in all, and up to MAX_MERGED_N samples; a lone request waits GATHER_IDLE_SECONDS.
Seeded requests (a seed fixes one request's draw) and requests of MAX_MERGED_N samples or more go alone.
A merged call the server refuses as INVALID_ARGUMENT (a limit the sum crossed, --max-sample-n below it)
is retried member by member, so each request gets the answer it would have had alone (its samples or
its own error); any other failure is every member's. A member that goes away (its client disconnected)
leaves the call to the others; the call is cancelled when none is left.

The gathering windows are measured on a `GatherClock`: the event loop's own clock, or one a test
advances by hand."""

from __future__ import annotations

import asyncio
import dataclasses
import json
from collections.abc import Awaitable, Callable
from dataclasses import dataclass, field
from typing import Any, Protocol

import grpc

from tinkerrpc import RPCError, Sample, SamplingOptions
from tinkerrpc_server.sidecar.sampling_args import Prompt

GATHER_IDLE_SECONDS = 0.002
GATHER_MAX_SECONDS = 0.02
MAX_MERGED_N = 16

# One upstream Sample call: (model name, prompt, arguments) -> the samples.
Upstream = Callable[[str, Prompt, SamplingOptions], Awaitable[list[Sample]]]
# One member's answer: its samples, or the error its request alone got.
_Answer = list[Sample] | Exception


class Cancellable(Protocol):
    def cancel(self) -> None: ...


class GatherClock(Protocol):
    """What the gathering windows are measured on; asyncio's event loop is one."""

    def time(self) -> float:
        """Now, in seconds (monotonic)."""
        ...

    def call_later(self, delay: float, callback: Callable[..., object], *args: Any) -> Cancellable:
        """Run `callback(*args)` once, `delay` seconds from now."""
        ...


@dataclass
class _Group:
    name: str
    prompt: Prompt
    args: SamplingOptions
    opened: float
    members: list[int] = field(default_factory=list)  # each member's n, in arrival order
    result: asyncio.Future[list[_Answer]] | None = None
    waiting: int = 0  # members still waiting for the result
    timer: Cancellable | None = None

    @property
    def total(self) -> int:
        return sum(self.members)


class SampleCoalescer:
    """`sample(name, prompt, args)`: the samples of that request, drawn alone or with identical ones."""

    def __init__(
        self,
        upstream: Upstream,
        on_merged: Callable[[int], None] = lambda members: None,
        clock: GatherClock | None = None,
    ) -> None:
        self._upstream = upstream
        self._on_merged = on_merged
        self._clock = clock  # None: the running event loop's
        self._open: dict[str, _Group] = {}

    def _now(self) -> GatherClock:
        return self._clock or asyncio.get_running_loop()

    async def sample(self, name: str, prompt: Prompt, args: SamplingOptions) -> list[Sample]:
        if args.seed is not None or args.n >= MAX_MERGED_N:
            return await self._upstream(name, prompt, args)
        key = _key(name, prompt, args)
        group = self._open.get(key)
        if group is None or group.total + args.n > MAX_MERGED_N:
            group = _Group(name, prompt, args, self._now().time())
            group.result = asyncio.get_running_loop().create_future()
            self._open[key] = group
        index = len(group.members)
        group.members.append(args.n)
        group.waiting += 1
        self._schedule(key, group)
        result = group.result
        assert result is not None
        try:
            answer = (await asyncio.shield(result))[index]
        finally:
            group.waiting -= 1
            if group.waiting == 0 and not result.done():
                result.cancel()  # nobody is left to answer: the upstream call is dropped
        if isinstance(answer, Exception):
            raise answer
        return answer

    def _schedule(self, key: str, group: _Group) -> None:
        """(Re)arm the group's flush: GATHER_IDLE_SECONDS after its latest member, never later than
        GATHER_MAX_SECONDS after its first, at once when it is full."""
        if group.timer is not None:
            group.timer.cancel()
        clock = self._now()
        if group.total >= MAX_MERGED_N:
            delay = 0.0
        else:
            delay = min(GATHER_IDLE_SECONDS, max(0.0, group.opened + GATHER_MAX_SECONDS - clock.time()))
        group.timer = clock.call_later(delay, self._flush, key, group)

    def _flush(self, key: str, group: _Group) -> None:
        if self._open.get(key) is group:
            del self._open[key]
        group.timer = None
        assert group.result is not None
        if group.result.done():  # every member went away before the flush
            return
        task = asyncio.ensure_future(self._draw(group))
        # A member that goes away cancels the result when it was the last; the call goes with it.
        group.result.add_done_callback(lambda result: task.cancel() if result.cancelled() else None)

    async def _draw(self, group: _Group) -> None:
        assert group.result is not None
        try:
            parts = await self._draw_parts(group)
        except Exception as error:  # every member gets the call's failure
            if not group.result.done():
                group.result.set_exception(error)
            return
        if not group.result.done():
            group.result.set_result(parts)

    async def _draw_parts(self, group: _Group) -> list[_Answer]:
        if len(group.members) == 1:
            return [await self._upstream(group.name, group.prompt, group.args)]
        merged = dataclasses.replace(group.args, n=group.total)
        try:
            samples = await self._upstream(group.name, group.prompt, merged)
        except RPCError as error:
            if error.code != grpc.StatusCode.INVALID_ARGUMENT:
                raise
            # Each member alone: one member's refusal is its own, never the others'.
            alone = await asyncio.gather(
                *(
                    self._upstream(group.name, group.prompt, dataclasses.replace(group.args, n=n))
                    for n in group.members
                ),
                return_exceptions=True,
            )
            return [_own_answer(answer) for answer in alone]
        self._on_merged(len(group.members))
        parts: list[_Answer] = []
        start = 0
        for n in group.members:
            parts.append(samples[start : start + n])
            start += n
        return parts


def _own_answer(answer: list[Sample] | BaseException) -> _Answer:
    """A member's answer from its call alone; what is not an Exception (a cancellation) goes on up."""
    if isinstance(answer, BaseException) and not isinstance(answer, Exception):
        raise answer
    return answer


def _key(name: str, prompt: Prompt, args: SamplingOptions) -> str:
    """Equal for requests that may share one call: the same model, prompt and arguments but n."""
    arguments = {**vars(args), "n": 0}
    return json.dumps([name, prompt, arguments], sort_keys=True, separators=(",", ":"), default=repr)
