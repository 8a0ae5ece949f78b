"""How a running decode gets its requests and answers them: the `RequestFeed` protocol, a feed seen
through conversions (`MappedFeed`) and a fixed list of requests (`FixedRequests`)."""

from __future__ import annotations

from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass, field
from typing import Generic, Protocol, TypeVar

from tinkerrpc_server.engine.compute.samples import SampleJob, SampleOutput


@dataclass
class DecodeStats:
    """Counters of the decoding loop (the engine reports them with its worker's counters)."""

    decode_steps: int = 0
    decoded_rows: int = 0  # summed over decode steps: decoded_rows / decode_steps = mean batch size
    largest_decode_rows: int = 0
    rows_left_early: int = 0  # rows that stopped and left while other rows kept decoding
    requests_joined_running_batch: int = 0
    prefill_chunks: int = 0
    prefill_chunks_in_decode_steps: int = 0  # chunks run in the same forward pass as a decode step
    shared_prefill_rows: int = 0  # rows whose prompt KV was copied from another row's prefill
    # Decode steps whose rows all held one prompt's KV: its columns were read once for all of them.
    shared_prompt_decode_steps: int = 0
    # Rows decoding now in each base model's running batch (none listed: nothing decodes): a gauge per
    # model, not a counter. Replaced, never changed in place, so a reader on another thread copies it whole.
    decoding_rows: dict[str, int] = field(default_factory=dict)

    def set_decoding_rows(self, model: str, rows: int) -> None:
        others = {name: count for name, count in self.decoding_rows.items() if name != model}
        self.decoding_rows = {**others, model: rows} if rows else others


In_co = TypeVar("In_co", covariant=True)
Out_contra = TypeVar("Out_contra", contravariant=True)


class RequestFeed(Protocol[In_co, Out_contra]):
    """Where a running batch gets its requests and answers them, and whether it should pause between steps."""

    @property
    def stats(self) -> DecodeStats: ...

    def joining(self) -> Sequence[tuple[int, In_co]]:
        """Requests that arrived since the last call, each with a key unique within the feed."""
        ...

    def deliver(self, key: int, result: Out_contra) -> None:
        """The result of request `key`; called once per request, as soon as it is complete."""
        ...

    def abandoned(self) -> Collection[int]:
        """Keys of requests nobody waits for any more (already answered): they stop decoding."""
        ...

    def other_work_waiting(self) -> bool:
        """Whether work that should not wait for the whole batch is queued: the decode then pauses
        (yields) between two steps so its caller can run that work outside the model's context."""
        ...

    def decoding(self, rows: int) -> None:
        """The batch decodes `rows` rows now (0: none is left): its model's decoding_rows gauge."""
        ...


# What the decode loop serves: checked jobs in, their outputs back.
DecodeFeed = RequestFeed[SampleJob, SampleOutput]

A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")
D = TypeVar("D")


class MappedFeed(Generic[A, B, C, D]):
    """`inner` seen through conversions: `take` turns its requests into ours (None: it answered the
    request itself, e.g. with an error), `give` turns our results into its."""

    def __init__(
        self,
        inner: RequestFeed[A, B],
        take: Callable[[int, A], C | None],
        give: Callable[[int, D], B],
    ) -> None:
        self._inner, self._take, self._give = inner, take, give

    @property
    def stats(self) -> DecodeStats:
        return self._inner.stats

    def joining(self) -> list[tuple[int, C]]:
        taken = []
        for key, item in self._inner.joining():
            converted = self._take(key, item)
            if converted is not None:
                taken.append((key, converted))
        return taken

    def deliver(self, key: int, result: D) -> None:
        self._inner.deliver(key, self._give(key, result))

    def abandoned(self) -> Collection[int]:
        return self._inner.abandoned()

    def other_work_waiting(self) -> bool:
        return self._inner.other_work_waiting()

    def decoding(self, rows: int) -> None:
        self._inner.decoding(rows)


class FixedRequests:
    """A feed of a fixed list of jobs (keyed by their index) that collects their outputs."""

    def __init__(self, jobs: list[SampleJob]) -> None:
        self.stats = DecodeStats()
        self._jobs: list[SampleJob] | None = jobs
        self.results: list[SampleOutput | None] = [None] * len(jobs)

    def joining(self) -> list[tuple[int, SampleJob]]:
        jobs, self._jobs = self._jobs or [], None
        return list(enumerate(jobs))

    def deliver(self, key: int, result: SampleOutput) -> None:
        self.results[key] = result

    def abandoned(self) -> Collection[int]:
        return ()

    def other_work_waiting(self) -> bool:
        return False

    def decoding(self, rows: int) -> None:
        pass  # a fixed list's decode runs to its end unwatched
