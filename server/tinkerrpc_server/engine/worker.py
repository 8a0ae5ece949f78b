"""The compute worker: one thread runs every runtime call (the runtime is not thread-safe).

Scheduling rules:
- training operations of one model run in seq_id order (the SDK numbers a model's requests from 1;
  creation is seq 0); a request whose predecessor never arrives runs after `gap_timeout` seconds;
- sample requests that are pending together for the same weights go to the runtime as ONE batch, and
  requests for those weights that arrive while it runs join it (the scheduler admits them at its next
  decode step; see BatchPolicy in compute/scheduler.py), unless requests for other weights of the same
  base model have waited longer: then the batch takes no one new, finishes, and the other weights'
  batch runs next (one batch per base model at a time keeps one merged decoder per runtime); each
  request is answered as soon as its own sequences finish;
- each base model's running batch (its lane) and training share the compute thread by compute time
  (engine/fair_share.py): a batch pauses between two decode steps whenever another lane or a training
  operation is ready, and the least served of them runs next, so a long Sample holds neither another
  model's Sample nor a Train until it finishes;
- a request whose caller gave up (RequestFuture.abandoned: its SDK call was cancelled) is dropped when
  its turn comes instead of run, and a running sample batch stops decoding for it.

Threads: in the engine process the compute thread is the only one that runs torch's parallel ops
(`torch_threads`, `in_passing_thread`). torch's OpenMP runtime (libgomp) counts every thread that ever
led a parallel op, with its team, against the CPUs; once they outnumber the CPUs, a thread waiting for
the next op sleeps almost at once instead of spinning, and every op of a decode step (about a thousand)
then pays a wake-up: SmolLM2's one-row decode took 1.4x as long on the compute thread once the main
thread had run parallel ops too.
"""

from __future__ import annotations

import heapq
import itertools
import logging
import threading
import time
from collections import OrderedDict
from collections.abc import Callable, Hashable, Iterator
from dataclasses import dataclass, field
from typing import Generic, TypeAlias, TypeVar

import torch

from tinkerrpc_server.engine.compute.feed import DecodeStats, RequestFeed
from tinkerrpc_server.engine.fair_share import FairShare
from tinkerrpc_server.engine.futures import AnswerT, FailedResult, Outcome, RequestFuture

log = logging.getLogger("tinkerrpc.engine")

JobT = TypeVar("JobT")
# Runs one sample batch, one stretch per next(): takes the requests' jobs from the feed as they come,
# answers each one through it, and yields between two decode steps while the feed has other work waiting.
BatchWork: TypeAlias = Callable[[RequestFeed[JobT, Outcome[AnswerT]]], Iterator[None]]

ABANDONED = (
    "dropped without running: its caller stopped waiting for the result (cancelled or past its deadline)"
)


@dataclass(order=True)
class _TrainingOp(Generic[AnswerT]):
    seq_id: int
    arrival: int
    enqueued_at: float = field(compare=False)
    name: str = field(compare=False)
    work: Callable[[], AnswerT] = field(compare=False)
    future: RequestFuture[AnswerT] = field(compare=False)


@dataclass
class _ModelQueue(Generic[AnswerT]):
    next_seq: int = 0
    pending: list[_TrainingOp[AnswerT]] = field(default_factory=list)  # heap by seq_id
    # Requests without a seq_id are outside the client's numbering: they run in arrival order
    # and never take a seq_id a client may still send.
    unsequenced: list[_TrainingOp[AnswerT]] = field(default_factory=list)


@dataclass
class _PendingSample(Generic[JobT, AnswerT]):
    job: JobT
    future: RequestFuture[AnswerT]


@dataclass
class _SampleGroup(Generic[JobT, AnswerT]):
    lane: Hashable  # the base model: its groups run one after another
    run_batch: BatchWork[JobT, AnswerT]
    description: str
    requests: list[_PendingSample[JobT, AnswerT]] = field(default_factory=list)
    created: float = field(default_factory=time.monotonic)


@dataclass
class _RunningBatch(Generic[JobT, AnswerT]):
    group_key: Hashable
    group: _SampleGroup[JobT, AnswerT]
    started: float = field(default_factory=time.perf_counter)
    session: _SampleBatch[JobT, AnswerT] | None = None  # with `steps`, made at its first turn
    steps: Iterator[None] | None = None


# Training, as a participant of the fair share beside the lanes (no base model's name).
_TRAINING: Hashable = object()

SAMPLE_GATHER_SECONDS = 0.005


@dataclass
class WorkerStats(DecodeStats):
    sample_requests: int = 0
    sample_batches: int = 0
    # Most requests of one batch decoding (or being prefilled) at the same time.
    largest_sample_batch: int = 0
    # Requests that joined a sample batch after it had started.
    sample_requests_joined_later: int = 0
    training_ops: int = 0
    # Requests dropped because their caller gave up: before they ran, or (samples) while decoding.
    abandoned_sample_requests: int = 0
    abandoned_training_ops: int = 0
    # Training operations run between two decode steps of a sample batch.
    training_ops_between_decode_steps: int = 0
    # Turns that went from one lane's running batch to another's between two of its decode steps.
    sample_turns_to_other_models: int = 0


class ComputeWorker(Generic[JobT, AnswerT]):
    """Runs training work (`Callable[[], AnswerT]`) and batches of sample jobs (`JobT`), answering each
    request's future with its answer or a FailedResult (`classify_error` of what the work raised)."""

    def __init__(
        self,
        classify_error: Callable[[BaseException], FailedResult],
        gap_timeout: float = 10.0,
        torch_threads: int | None = None,
    ) -> None:
        """`torch_threads`: the threads torch's parallel ops use on the compute thread, set there when it
        starts (None: as the process has them)."""
        self._classify_error = classify_error
        self._torch_threads = torch_threads
        self._gap_timeout = gap_timeout
        self._cond = threading.Condition()
        self._models: dict[str, _ModelQueue[AnswerT]] = {}
        self._model_rotation: list[str] = []
        # Sample groups waiting to start, in arrival order; each lane's running batch.
        self._samples: OrderedDict[Hashable, _SampleGroup[JobT, AnswerT]] = OrderedDict()
        self._running: dict[Hashable, _RunningBatch[JobT, AnswerT]] = {}
        self._fair_share = FairShare()
        self._last_lane: Hashable = None
        self._arrivals = itertools.count()
        self._stopping = False
        self.stats = WorkerStats()
        self._thread = threading.Thread(target=self._loop, name="engine-compute", daemon=True)
        self._thread.start()

    # ---- submission (any thread) ----

    def submit_training(
        self,
        model_id: str,
        seq_id: int | None,
        name: str,
        work: Callable[[], AnswerT],
        future: RequestFuture[AnswerT],
    ) -> None:
        """Queue `work` for `model_id`; seq_id None runs after everything already queued for it."""
        with self._cond:
            queue = self._models.get(model_id)
            if queue is None:
                queue = self._models[model_id] = _ModelQueue[AnswerT]()
                self._model_rotation.append(model_id)
            if seq_id is None:
                queue.unsequenced.append(
                    _TrainingOp(-1, next(self._arrivals), time.monotonic(), name, work, future)
                )
            elif seq_id < queue.next_seq or any(op.seq_id == seq_id for op in queue.pending):
                future.set_result(
                    FailedResult(f"seq_id {seq_id} was already used for model {model_id}", "user")
                )
                return
            else:
                op = _TrainingOp(seq_id, next(self._arrivals), time.monotonic(), name, work, future)
                heapq.heappush(queue.pending, op)
            self._cond.notify()

    def submit_sample(
        self,
        lane: Hashable,
        group_key: Hashable,
        description: str,
        run_batch: BatchWork[JobT, AnswerT],
        job: JobT,
        future: RequestFuture[AnswerT],
    ) -> None:
        """Queue one sample request; pending requests with the same group_key run as one batch, the
        batches of one lane one after another, and the lanes' running batches share the compute thread."""
        with self._cond:
            group = self._samples.get(group_key)
            if group is None:
                group = self._samples[group_key] = _SampleGroup(lane, run_batch, description)
            group.requests.append(_PendingSample(job, future))
            self._cond.notify()

    def stop(self) -> None:
        with self._cond:
            self._stopping = True
            self._cond.notify()
        self._thread.join(timeout=30)

    # ---- the compute thread ----

    def _runnable_training_op(self, now: float) -> tuple[int, _TrainingOp[AnswerT] | None, float | None]:
        """The model (index in the rotation) whose training op may run next, round-robin, and that op;
        or the time until one may run."""
        wait: float | None = None
        for index, model_id in enumerate(self._model_rotation):
            queue = self._models[model_id]
            if queue.unsequenced:
                return index, queue.unsequenced[0], None
            if not queue.pending:
                continue
            head = queue.pending[0]
            waited = now - head.enqueued_at
            if head.seq_id == queue.next_seq or waited >= self._gap_timeout:
                return index, head, None
            remaining = self._gap_timeout - waited
            wait = remaining if wait is None else min(wait, remaining)
        return -1, None, wait

    def _next_training_op(self, now: float) -> tuple[_TrainingOp[AnswerT] | None, float | None]:
        """Take the next runnable training op (round-robin over models), or the time until one may run."""
        index, op, wait = self._runnable_training_op(now)
        if op is None:
            return None, wait
        model_id = self._model_rotation[index]
        queue = self._models[model_id]
        if op.seq_id < 0:
            queue.unsequenced.pop(0)
        else:
            if op.seq_id != queue.next_seq:
                log.warning(
                    "model %s: seq %d never arrived, running seq %d", model_id, queue.next_seq, op.seq_id
                )
            heapq.heappop(queue.pending)
            queue.next_seq = op.seq_id + 1
        # Rotate so the next pick starts after this model.
        self._model_rotation = self._model_rotation[index + 1 :] + self._model_rotation[: index + 1]
        return op, None

    def _loop(self) -> None:
        if self._torch_threads is not None:
            torch.set_num_threads(self._torch_threads)
            # A thread takes torch's process-wide count on its first parallel op unless it has one:
            # this pins the count set above, whatever the process-wide one becomes.
            torch.get_num_threads()
        while True:
            with self._cond:
                turn = self._wait_for_turn()
            if turn is None:
                return
            started, forwards = time.perf_counter(), self._forward_passes()
            if isinstance(turn, _RunningBatch):
                self._step_batch(turn)
                participant = turn.group.lane
            else:
                self._run_training_op(turn)
                participant = _TRAINING
            passes = self._forward_passes() - forwards
            self._fair_share.charge(participant, time.perf_counter() - started, passes)

    def _forward_passes(self) -> int:
        """Sampling's forward passes so far: a decode step and a prefill chunk run together are one."""
        stats = self.stats
        return stats.decode_steps + stats.prefill_chunks - stats.prefill_chunks_in_decode_steps

    def _wait_for_turn(self) -> _RunningBatch[JobT, AnswerT] | _TrainingOp[AnswerT] | None:
        """The next turn (with the lock held): a lane's running batch or a training op, chosen by the
        fair share among those ready; None once stopping and no batch is left to finish."""
        while True:
            if self._stopping:  # batches running finish (nothing pauses them now), nothing new starts
                return next(iter(self._running.values()), None)
            now = time.monotonic()
            gathering = self._start_gathered_groups(now)
            _, op, gap_wait = self._runnable_training_op(now)
            ready = [*self._running, *([_TRAINING] if op is not None else [])]
            if ready:
                chosen = self._fair_share.next_turn(ready)
                if chosen is not _TRAINING:
                    return self._running[chosen]
                op, _ = self._next_training_op(now)
                return op
            waits = [wait for wait in (gathering, gap_wait) if wait is not None]
            self._cond.wait(timeout=min(waits) if waits else None)

    def _start_gathered_groups(self, now: float) -> float | None:
        """Start the oldest waiting group of each lane without a running batch (with the lock held);
        the time until a group too young to start is old enough."""
        wait: float | None = None
        for group_key, group in list(self._samples.items()):
            if group.lane in self._running:
                continue
            # Concurrent clients' requests arrive a few ms apart: a young group waits that long so they
            # run as one batch instead of one request and then all the others.
            young = SAMPLE_GATHER_SECONDS - (now - group.created)
            if young > 0:
                wait = young if wait is None else min(wait, young)
                continue
            del self._samples[group_key]
            self._running[group.lane] = _RunningBatch(group_key, group)
        return wait

    def _run_training_op(self, op: _TrainingOp[AnswerT]) -> None:
        seq = f"seq={op.seq_id}" if op.seq_id >= 0 else "unsequenced"
        if op.future.abandoned:
            self.stats.abandoned_training_ops += 1
            log.info("%s %s dropped: its caller stopped waiting", op.name, seq)
            op.future.set_result(FailedResult(ABANDONED, "user"))
            return
        started = time.perf_counter()
        outcome: Outcome[AnswerT]
        try:
            outcome = op.work()
        except BaseException as exc:
            outcome = self._classify_error(exc)
        elapsed_ms = (time.perf_counter() - started) * 1000
        self.stats.training_ops += 1
        if self._running:
            self.stats.training_ops_between_decode_steps += 1
        status = (
            "ok" if not isinstance(outcome, FailedResult) else f"{outcome.category} error: {outcome.message}"
        )
        log.info("%s %s %.1f ms %s", op.name, seq, elapsed_ms, status)
        op.future.set_result(outcome)

    def _step_batch(self, batch: _RunningBatch[JobT, AnswerT]) -> None:
        """One turn of a lane's running batch: it decodes until another participant is ready."""
        lane = batch.group.lane
        if self._last_lane is not None and self._last_lane != lane and self._last_lane in self._running:
            self.stats.sample_turns_to_other_models += 1
        self._last_lane = lane
        if batch.session is None:
            requests = batch.group.requests
            waiting = [r for r in requests if not r.future.abandoned]
            self._drop_abandoned_samples([r for r in requests if r.future.abandoned])
            batch.session = _SampleBatch(self, batch.group_key, lane, waiting)
            if not waiting:
                self._finish_batch(batch)
                return
        session = batch.session
        try:
            if batch.steps is None:
                batch.steps = batch.group.run_batch(session)
            next(batch.steps)
            return
        except StopIteration:
            pass
        except BaseException as exc:
            session.fail_unanswered(self._classify_error(exc))
        self.stats.sample_batches += 1
        log.info(
            "sample %s: %d request(s) in one batch (%d joined it later), %.1f ms, %d failed",
            batch.group.description,
            session.taken,
            session.joined_later,
            (time.perf_counter() - batch.started) * 1000,
            session.failures,
        )
        self._finish_batch(batch)

    def _finish_batch(self, batch: _RunningBatch[JobT, AnswerT]) -> None:
        # A batch that failed mid-decode never said its rows left.
        self.stats.set_decoding_rows(str(batch.group.lane), 0)
        with self._cond:
            del self._running[batch.group.lane]

    def _drop_abandoned_samples(self, requests: list[_PendingSample[JobT, AnswerT]]) -> None:
        if requests:
            self.stats.abandoned_sample_requests += len(requests)
            log.info("sample: %d request(s) dropped, their callers stopped waiting", len(requests))
        for request in requests:
            request.future.set_result(FailedResult(ABANDONED, "user"))

    # ---- between two decode steps of a sample batch (compute thread) ----

    def other_work_waiting(self, lane: Hashable) -> bool:
        """Whether another lane's batch or a training op is ready: `lane`'s batch then pauses."""
        with self._cond:
            if self._stopping:
                return False
            if any(other != lane for other in self._running) or any(
                group.lane != lane for group in self._samples.values()
            ):
                return True
            return self._runnable_training_op(time.monotonic())[1] is not None

    def take_joining_samples(
        self, lane: Hashable, group_key: Hashable
    ) -> list[_PendingSample[JobT, AnswerT]]:
        """Requests for a running batch's weights that arrived while it ran, unless requests for other
        weights of its lane have waited longer (they go first: the running batch then takes no one new)."""
        with self._cond:
            if self._stopping:
                return []
            first = next((key for key, group in self._samples.items() if group.lane == lane), None)
            if first != group_key:
                return []
            return self._samples.pop(group_key).requests


class _SampleBatch(Generic[JobT, AnswerT]):
    """A running sample batch's view of the worker (a RequestFeed of jobs and outcomes): its requests
    as they arrive, their answers, which of them were abandoned, and whether other work is ready."""

    def __init__(
        self,
        worker: ComputeWorker[JobT, AnswerT],
        group_key: Hashable,
        lane: Hashable,
        first: list[_PendingSample[JobT, AnswerT]],
    ) -> None:
        self._worker = worker
        self._group_key = group_key
        self._lane = lane
        self._arrived = first
        self._unanswered: dict[int, _PendingSample[JobT, AnswerT]] = {}
        self._keys = itertools.count()
        self.taken = self.joined_later = self.failures = 0

    @property
    def stats(self) -> DecodeStats:
        return self._worker.stats

    def joining(self) -> list[tuple[int, JobT]]:
        arrived = self._arrived or self._worker.take_joining_samples(self._lane, self._group_key)
        self._arrived = []
        waiting = [r for r in arrived if not r.future.abandoned]
        self._worker._drop_abandoned_samples([r for r in arrived if r.future.abandoned])
        if self.taken:
            self.joined_later += len(waiting)
            self._worker.stats.sample_requests_joined_later += len(waiting)
        self.taken += len(waiting)
        stats = self._worker.stats
        stats.sample_requests += len(waiting)
        taken = []
        for request in waiting:
            key = next(self._keys)
            self._unanswered[key] = request
            taken.append((key, request.job))
        stats.largest_sample_batch = max(stats.largest_sample_batch, len(self._unanswered))
        return taken

    def deliver(self, key: int, outcome: Outcome[AnswerT]) -> None:
        request = self._unanswered.pop(key, None)
        if request is None:
            return
        if request.future.abandoned:
            self._worker._drop_abandoned_samples([request])
            return
        self.failures += isinstance(outcome, FailedResult)
        request.future.set_result(outcome)

    def abandoned(self) -> list[int]:
        keys = [key for key, request in self._unanswered.items() if request.future.abandoned]
        self._worker._drop_abandoned_samples([self._unanswered.pop(key) for key in keys])
        return keys

    def other_work_waiting(self) -> bool:
        return self._worker.other_work_waiting(self._lane)

    def decoding(self, rows: int) -> None:
        self._worker.stats.set_decoding_rows(str(self._lane), rows)

    def fail_unanswered(self, outcome: FailedResult) -> None:
        """The batch failed: every request it took or was given and has not answered gets `outcome`."""
        failed = [*self._unanswered.values(), *self._arrived]
        self._unanswered.clear()
        self._arrived = []
        self.failures += len(failed)
        for request in failed:
            request.future.set_result(outcome)


Result = TypeVar("Result")


def in_passing_thread(work: Callable[[], Result]) -> Result:
    """`work()` on a thread of its own that ends with it: torch's parallel ops there (building a built-in
    model) leave no OpenMP team behind to count against the compute thread's (see the module docstring)."""
    outcome: list[Result] = []
    failure: list[BaseException] = []

    def run() -> None:
        try:
            outcome.append(work())
        except BaseException as error:  # re-raised on the calling thread
            failure.append(error)

    thread = threading.Thread(target=run, name="engine-prepare")
    thread.start()
    thread.join()
    if failure:
        raise failure[0]
    return outcome[0]
