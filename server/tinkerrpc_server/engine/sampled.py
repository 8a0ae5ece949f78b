"""What the engine sampled: each sampled sequence by its `sequence_id`, so training requests can name it.

A sample request's sequences get the ids `<request id>:<index>` (the SDK's `sample_sequence_ids`); once
it is answered each is recorded with its request's prompt, its tokens, which weights produced which of
its tokens (the weights version, see snapshots.py), and, when the request asked for it
(`record_stability_info`), its stability information: the sampler's own logprob of each token, which
stable_reinforce uses in place of the datum's `logprobs`.

Bounded: MAX_ENGINE_SAMPLED_SEQUENCES sequences are kept in all (tokens as int32, 4 bytes each, a
request's prompt once for all its sequences), shared fairly between the tinker sessions that sampled them:
past the cap, the oldest sequence of the session keeping the most expires (of two keeping as many, the
one whose oldest is older). So one busy session expires its own sequences, never those of a session
keeping fewer: each of k sessions keeping sequences keeps at least its last capacity/k (rounded down),
or all it sampled if fewer. An expired id is remembered (as many again) so naming it says that it
expired rather than that it was never sampled.
"""

from __future__ import annotations

import heapq
import itertools
import threading
from collections import OrderedDict
from dataclasses import dataclass

import numpy as np

from tinkerrpc.contract.limits import MAX_ENGINE_SAMPLED_SEQUENCES
from tinkerrpc_server.engine.compute.samples import SampleJob, SampleOutput
from tinkerrpc_server.engine.snapshots import Sampler


@dataclass(frozen=True)
class WeightsSpan:
    """`length` consecutive sampled tokens from `start` produced by one version of the weights."""

    start: int
    length: int
    model_path: str | None  # None: the base model
    version: int | None  # the inflight weights' version; None for fixed weights


@dataclass(frozen=True)
class StabilityInfo:
    """What the sampler recorded for stable_reinforce: each sampled token's logprob as it was drawn
    (log-softmax(logits / T), the number the sampler answered)."""

    logprobs: np.ndarray  # float32, one per sampled token


@dataclass(frozen=True)
class SampledRecord:
    sequence_id: str
    prompt: np.ndarray  # int32, the request's prompt (shared by its sequences)
    tokens: np.ndarray  # int32, the sampled tokens
    weights: tuple[WeightsSpan, ...]
    stability: StabilityInfo | None


class UnknownSequence(LookupError):
    """A sequence id that names no sequence the engine keeps; the message says why, for the user."""


class SampledSequences:
    """Thread-safe: the compute thread records answers, routes look sequences up."""

    def __init__(self, capacity: int = MAX_ENGINE_SAMPLED_SEQUENCES) -> None:
        self.capacity = capacity
        self._lock = threading.Lock()
        self._kept: dict[str, SampledRecord] = {}
        # Each sampling tinker session's kept sequence ids, oldest first, with when each was recorded.
        self._by_session: dict[str, OrderedDict[str, int]] = {}
        self._recorded = itertools.count()
        self._expired: OrderedDict[str, None] = OrderedDict()

    def record(
        self, session_id: str, request_id: str, sampler: Sampler, job: SampleJob, outcome: object
    ) -> None:
        """A sample request's outcome: each sequence of its answer under `<request_id>:<index>`, in the
        share of `session_id`, the tinker session that sampled it (a failed request sampled nothing)."""
        if not isinstance(outcome, SampleOutput):
            return
        output = outcome
        prompt = np.asarray(job.prompt_tokens, dtype=np.int32)
        records = []
        for index, seq in enumerate(output.sequences):
            span = WeightsSpan(0, len(seq.tokens), sampler.model_path, sampler.weights_version)
            stability = (
                StabilityInfo(np.asarray(seq.logprobs, dtype=np.float32))
                if job.record_stability_info
                else None
            )
            sequence_id = f"{request_id}:{index}"
            tokens = np.asarray(seq.tokens, dtype=np.int32)
            records.append(SampledRecord(sequence_id, prompt, tokens, (span,), stability))
        if not records:
            return
        with self._lock:
            kept = self._by_session.setdefault(session_id, OrderedDict())
            for record in records:
                self._kept[record.sequence_id] = record
                kept[record.sequence_id] = next(self._recorded)
            self._expire(len(self._kept) - self.capacity)

    def _expire(self, count: int) -> None:
        """Expire `count` sequences, each the oldest of the session then keeping the most (caller holds
        the lock)."""
        if count <= 0:
            return
        # Most kept first, then the oldest first sequence: (-kept, when its oldest was recorded, session).
        heap = [(-len(ids), next(iter(ids.values())), session) for session, ids in self._by_session.items()]
        heapq.heapify(heap)
        for _ in range(count):
            _, _, session = heapq.heappop(heap)
            ids = self._by_session[session]
            gone, _ = ids.popitem(last=False)
            del self._kept[gone]
            self._expired[gone] = None
            if ids:
                heapq.heappush(heap, (-len(ids), next(iter(ids.values())), session))
            else:
                del self._by_session[session]
        while len(self._expired) > self.capacity:
            self._expired.popitem(last=False)

    def get(self, sequence_id: str) -> SampledRecord:
        """The sequence's record; UnknownSequence when it was never sampled here or has expired."""
        with self._lock:
            record = self._kept.get(sequence_id)
            expired = sequence_id in self._expired
        if record is not None:
            return record
        if expired:
            raise UnknownSequence(f"sequence id {sequence_id!r} has expired: {self._kept_what()}")
        raise UnknownSequence(
            f"sequence id {sequence_id!r} was not sampled by this engine (or expired long ago: "
            f"{self._kept_what()})"
        )

    def _kept_what(self) -> str:
        return (
            f"the engine keeps {self.capacity} sampled sequences, expiring first the oldest of the session "
            "keeping the most"
        )
