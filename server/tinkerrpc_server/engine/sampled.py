"""What the engine sampled: each sampled sequence by its `sequence_id`, so training requests can name it.

A sample request's sequences get the ids `<request id>:<index>` (the SDK's `sample_sequence_ids`); once
it is answered each is recorded with its request's prompt, its tokens, which weights produced which of
its tokens (the weights version, see snapshots.py), and, when the request asked for it
(`record_stability_info`), its stability information: the sampler's own logprob of each token, which
stable_reinforce uses in place of the datum's `logprobs`.

Bounded: the MAX_ENGINE_SAMPLED_SEQUENCES most recently answered sequences are kept (tokens as int32, 4
bytes each, a request's prompt once for all its sequences); an older one's id is remembered (as many
again) so naming it says that it expired rather than that it was never sampled.
"""

from __future__ import annotations

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
        self._kept: OrderedDict[str, SampledRecord] = OrderedDict()
        self._expired: OrderedDict[str, None] = OrderedDict()

    def record(self, request_id: str, sampler: Sampler, job: SampleJob, outcome: object) -> None:
        """A sample request's outcome: each sequence of its answer under `<request_id>:<index>` (a failed
        request sampled nothing)."""
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
        with self._lock:
            for record in records:
                self._kept[record.sequence_id] = record
            while len(self._kept) > self.capacity:
                gone, _ = self._kept.popitem(last=False)
                self._expired[gone] = None
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
            raise UnknownSequence(
                f"sequence id {sequence_id!r} has expired: the engine keeps the {self.capacity} most "
                "recently sampled sequences"
            )
        raise UnknownSequence(
            f"sequence id {sequence_id!r} was not sampled by this engine (or expired long ago: it keeps the "
            f"{self.capacity} most recently sampled sequences)"
        )
