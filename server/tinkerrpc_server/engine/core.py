"""The engine's shared state and its operations, used by every route family.

Routes reach the one `Engine` of an app through a FastAPI dependency; they read its state and change it
only through its methods. Runtime objects are only touched on the compute worker's thread: the methods
documented "compute thread" run inside work submitted to the worker.

The engine composes rooms, each with its own state and lock: its sessions (sessions.py), the training
clients' recent numbered requests (sequenced.py), the sampler-snapshot ledger (snapshots.py) and the
runtime registry (runtimes.py), beside the on-disk index (storage.py), the request futures (futures.py)
and the compute worker (worker.py). Its checkpoint operations (saving, listing, deleting, expiry) are
those of its base class, in checkpoints.py.

Bounded by what clients are still using: a training client's adapter and optimizer state are freed when
it is unloaded (`unload_model`, which the service sends when it drops a training client: restore,
rollback, cancelled step, DeleteModel) or when the session that created it finishes: the client finishes
it, or stops sending the SDK's heartbeats (every 10 s) for the session timeout. Unnamed sampler
snapshots go as the ledger says (snapshots.py), and an engine restart deletes them all. Checkpoints
saved with `ttl_seconds` are deleted by a sweep every SWEEP_INTERVAL_SECONDS once it has passed (and are
unknown from that moment on); the same sweep finishes silent sessions and deletes the unnamed snapshots
nothing uses any more. Records of ended sessions and sampled sequences are capped by count (sessions.py,
sampled.py), and records of idle training runs by count and age (storage.py).
"""

from __future__ import annotations

import dataclasses
import logging
import secrets
import threading
import time
from collections.abc import Callable, Coroutine, Iterator
from dataclasses import replace
from pathlib import Path
from typing import Any

from tinker import types

from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.answers import Answer, answer_size
from tinkerrpc_server.engine.checkpoints import CheckpointOperations
from tinkerrpc_server.engine.compute.execution_plan import choose_execution_plan
from tinkerrpc_server.engine.compute.feed import MappedFeed, RequestFeed
from tinkerrpc_server.engine.compute.samples import SampleJob, SampleOutput
from tinkerrpc_server.engine.config import EngineConfig
from tinkerrpc_server.engine.futures import FailedResult, FutureTable, Outcome
from tinkerrpc_server.engine.records import Records
from tinkerrpc_server.engine.runtime import BaseModelRuntime, EngineUserError, LoraSpec
from tinkerrpc_server.engine.runtimes import RuntimeRegistry
from tinkerrpc_server.engine.sampled import SampledSequences
from tinkerrpc_server.engine.sequenced import SequencedRequests
from tinkerrpc_server.engine.sessions import (
    Sessions,
    sampling_session_prefix,
    session_of_sampler,
    training_client_prefix,
)
from tinkerrpc_server.engine.snapshots import Sampler, SamplerLedger
from tinkerrpc_server.engine.storage import (
    InvalidNameError,
    RunRecord,
    Storage,
    UnknownPathError,
    now_iso,
)
from tinkerrpc_server.engine.worker import ComputeWorker
from tinkerrpc_server.model_store import UnknownBaseModelError

log = logging.getLogger("tinkerrpc.engine")

# How often expired checkpoints are deleted from disk (and silent sessions finished, at least this often).
SWEEP_INTERVAL_SECONDS = 30.0

_USER_ERRORS = (
    EngineUserError,
    UnknownBaseModelError,
    UnknownPathError,
    InvalidNameError,
    protocol.BadRequest,
)


class NotFound(LookupError):
    """An id in a direct (non-future) request that the engine does not know: HTTP 404."""


def classify_error(exc: BaseException) -> FailedResult:
    if isinstance(exc, _USER_ERRORS):
        return FailedResult(str(exc), "user")
    log.exception("engine operation failed", exc_info=exc)
    return FailedResult(f"internal engine error: {type(exc).__name__}: {exc}", "server")


class Engine(CheckpointOperations):
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self._storage = Storage(config.data_dir)
        self._futures = FutureTable[Answer](answer_size)
        self._worker = ComputeWorker[SampleJob, Answer](classify_error, torch_threads=config.torch_threads)
        self.url_secret = secrets.token_bytes(32)  # signs external-weights file URLs
        self._sessions = Sessions(config.session_timeout, self._storage, self._keeps_session_record)
        self._sequenced = SequencedRequests()
        self._ledger = SamplerLedger(config.snapshot_grace)
        self.sampled = SampledSequences()  # what it sampled, by sequence id
        self.records = Records(self._storage, self._sessions, self._ledger)  # sessions, copies, usage
        self._runtimes = RuntimeRegistry(
            config.model_dir,
            config.device,
            config.dtype,
            config.policy,
            choose_execution_plan(config.kernels),
        )
        self._stopped = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_expired, name="engine-sweep", daemon=True)
        self._sweeper.start()

    def close(self) -> None:
        self._stopped.set()
        self._worker.stop()
        self._storage.close()

    def _sweep_expired(self) -> None:
        interval = min(
            SWEEP_INTERVAL_SECONDS, self.config.session_timeout / 4, self.config.snapshot_grace / 2
        )
        while not self._stopped.wait(interval):
            try:
                for record in self._storage.delete_expired(time.time()):
                    log.info("checkpoint %s expired and was deleted", record.tinker_path)
                for session_id in self._sessions.silent(time.monotonic()):
                    log.info(
                        "session %s sent nothing for %.0f s: finished", session_id, self._sessions.timeout
                    )
                    self.finish_session(session_id)
                self._delete_snapshots(self._ledger.unused(time.monotonic()), "superseded and unused")
            except Exception:
                log.exception("the engine's sweep failed")

    # ---- requests ----

    def failed_request(self, message: str) -> str:
        """A request id whose outcome is already a user error (a request rejected before queueing)."""
        return self._futures.failed(message)

    async def outcome(
        self, request_id: str, timeout: float, disconnected: Callable[[], Coroutine[Any, Any, None]]
    ) -> Outcome[Answer] | None:
        """A request's outcome, waiting up to `timeout` seconds (FutureTable.wait); NotFound for an id
        this engine does not hold."""
        try:
            return await self._futures.wait(request_id, timeout, disconnected)
        except KeyError as exc:
            raise NotFound(f"unknown request id {request_id!r}") from exc

    def abandon(self, request_id: str) -> None:
        """Nobody waits for `request_id` (its stream's client left): its rows stop at the next step."""
        future = self._futures.get(request_id)
        if future is not None:
            future.abandon()

    def stats(self) -> dict[str, int | dict[str, int]]:
        """The compute worker's scheduling counters (decoding_rows: by base model) and the live
        training clients."""
        return {**dataclasses.asdict(self._worker.stats), "live_models": self._runtimes.live_count()}

    # ---- sessions ----

    def session_alive(self, session_id: str) -> bool:
        """Record a sign of life of a session; False if it has finished (see Sessions.alive)."""
        return self._sessions.alive(session_id)

    def require_open_session(self, session_id: str) -> None:
        self._sessions.require_open(session_id)

    def _keeps_session_record(self, session_id: str) -> bool:
        """Whether an ended session's record stays past the cap (Sessions): a training client or sampling
        session of it is in memory, or one of its training runs holds a checkpoint."""
        clients = training_client_prefix(session_id)
        if self._runtimes.live_with_prefix(clients):
            return True
        if self._ledger.sampler_ids(sampling_session_prefix(session_id)):
            return True
        return any(self.checkpoints(run.model_id) for run in self.runs() if run.model_id.startswith(clients))

    def finish_session(self, session_id: str, finish: dict[str, Any] | None = None) -> None:
        """Unload the session's training clients (after the work they have queued) and forget its
        sampling sessions: nothing it made stays in memory. `finish`: its client's reason, if it said."""
        self._sessions.mark_finished(session_id, finish)
        for model_id in self._runtimes.live_with_prefix(training_client_prefix(session_id)):
            self.queue_unload(model_id)
        self._ledger.forget_samplers(sampling_session_prefix(session_id))
        log.info("session %s finished", session_id)

    # ---- models ----

    def resolve_model_dir(self, base_model: str) -> Path:
        return self._runtimes.resolve_model_dir(base_model)

    def runtime(self, base_model: str) -> BaseModelRuntime:
        """The runtime of a base model, loaded on first use (compute thread)."""
        return self._runtimes.runtime(base_model)

    def live_runtime(self, model_id: str) -> BaseModelRuntime:
        return self._runtimes.live_runtime(model_id)

    def is_live(self, model_id: str) -> bool:
        return self._runtimes.is_live(model_id)

    def unload_model(self, model_id: str) -> None:
        """Free a training client's adapter and optimizer state; its checkpoints stay, but its unnamed
        sampler snapshot goes with it (compute thread)."""
        self._runtimes.unload(model_id)
        self._sequenced.forget(model_id)
        self._ledger.supersede(model_id)
        log.info("model %s unloaded", model_id)

    def queue_unload(self, model_id: str) -> str:
        """Unload a training client after everything already queued for it (its last operations run)."""

        def work() -> Answer:
            self.unload_model(model_id)
            return types.UnloadModelResponse(model_id=model_id, type="unload_model")

        return self.submit_training(model_id, None, "unload_model", work)

    def supported_models(self) -> list[str]:
        return self._runtimes.supported_models()

    def create_model(
        self, model_id: str, base_model: str, spec: LoraSpec, seed: int | None, metadata: dict[str, str]
    ) -> None:
        """A new adapter on `base_model`; `seed` is the one the client asked for, if any (compute thread)."""
        self.runtime(base_model).create_adapter(model_id, spec)
        self._record_live_run(model_id, base_model, spec, seed, metadata)

    def load_weights(
        self,
        model_id: str,
        path: str,
        base_model: str | None,
        with_optimizer: bool,
        metadata: dict[str, str],
        optimizer: str | None = None,
    ) -> None:
        """Load a checkpoint into `model_id`, creating it unless it is live (compute thread); `optimizer`: the
        family its optimizer_config asks for, None if it gave none (runtime load_state)."""
        try:
            record, directory = self._storage.resolve(path)
        except UnknownPathError as exc:
            raise EngineUserError(str(exc)) from exc
        base_model = base_model or self._storage.get_run(record.model_id).base_model
        live_base = self._runtimes.live_base_model(model_id)
        if live_base is not None and live_base != base_model:
            raise EngineUserError(f"{path} was trained on {base_model}, model {model_id} is on {live_base}")
        if with_optimizer and record.kind != "training":
            raise EngineUserError(f"{path} holds adapter weights only, no optimizer state (save_state's)")
        spec = self.runtime(base_model).load_state(model_id, directory, with_optimizer, optimizer)
        self._record_live_run(model_id, base_model, spec, spec.seed, metadata)

    def _record_live_run(
        self, model_id: str, base_model: str, spec: LoraSpec, seed: int | None, metadata: dict[str, str]
    ) -> None:
        stamp = now_iso()
        self._storage.put_run(
            RunRecord(
                model_id,
                base_model,
                spec.rank,
                seed,
                spec.train_mlp,
                spec.train_attn,
                spec.train_unembed,
                stamp,
                stamp,
                metadata,
            )
        )
        self._runtimes.mark_live(model_id, base_model)
        # Here, on the compute thread, no run is between its record and its training client.
        self._storage.forget_idle_runs(self._runtimes.is_live)

    def submit_to_live_model(
        self, model_id: str, seq_id: int | None, name: str, work: Callable[[], Answer]
    ) -> str:
        """Queue `work` in the live model's seq_id order. A request for a model this engine does not
        hold fails as a future, like the work's own errors."""
        if not self.is_live(model_id):
            return self.failed_request(f"unknown model {model_id!r}")
        return self.submit_training(model_id, seq_id, name, work)

    def submit_training(
        self, model_id: str, seq_id: int | None, name: str, work: Callable[[], Answer]
    ) -> str:
        """Queue a training client's operation; a repeat of a recent one is answered by it (see
        `resent_request`)."""
        earlier = self.resent_request(model_id, seq_id, name)
        if earlier is not None:
            return earlier
        request_id, future = self._futures.create()
        self._storage.touch_run(model_id)
        if seq_id is not None:
            self._sequenced.remember(model_id, seq_id, name, request_id)
        self._worker.submit_training(model_id, seq_id, f"{name} {model_id}", work, future)
        return request_id

    def resent_request(self, model_id: str, seq_id: int | None, name: str) -> str | None:
        """The request id of a recent `name` operation with this seq_id, if any: the SDK resends a
        request whose answer it did not get (a timeout, a 5xx) with the same body, and never reuses a
        seq_id otherwise, so such a repeat is the same request and must not run twice."""
        return self._sequenced.earlier(model_id, seq_id, name)

    def reject_in_turn(self, model_id: str, seq_id: int, name: str, message: str) -> str:
        """A request id that fails with `message` when `seq_id` comes up in the model's queue, so the
        model's later requests do not wait for a seq_id that a rejected request used."""

        def reject() -> Answer:
            raise EngineUserError(message)

        return self.submit_training(model_id, seq_id, name, reject)

    # ---- sampling ----

    def open_sampling_session(self, sampler_id: str, model_path: str | None, base_model: str | None) -> None:
        """A sampling session over a checkpoint's weights or a base model (whose built-in model is then
        built, an unknown one refused)."""
        sampler = replace(self._sampler_of_weights(model_path, base_model), sampler_id=sampler_id)
        if sampler.model_path is None:
            self.resolve_model_dir(sampler.base_model)
        self._ledger.add_sampler(sampler)

    def sampler(self, sampler_id: str) -> Sampler:
        sampler = self._ledger.sampler(sampler_id)
        if sampler is None:
            raise NotFound(f"unknown sampling session {sampler_id!r}")
        return sampler

    def sampler_for(
        self, sampling_session_id: str | None, model_path: str | None, base_model: str | None
    ) -> Sampler:
        """The sampling session a sample request names, or a one-off sampler for its weights."""
        if sampling_session_id is not None:
            return self.sampler(sampling_session_id)
        return self._sampler_of_weights(model_path, base_model)

    def run_sample_batch(
        self, sampler: Sampler, feed: RequestFeed[SampleJob, Outcome[Answer]]
    ) -> Iterator[None]:
        """Run the sample jobs `feed` brings for one sampler as one continuously batched decode
        (compute thread), one stretch per `next()`: each is answered as soon as it finishes, a bad one
        alone fails, and decoding pauses between two steps while `feed` has other work waiting."""
        runtime = self.runtime(sampler.base_model)
        if sampler.weights_dir is not None and not sampler.weights_dir.is_dir():
            raise EngineUserError(f"the weights of {sampler.model_path} were deleted")

        def job_of(key: int, job: SampleJob) -> SampleJob:
            return job.with_max_tokens_filled(runtime.max_context_length)

        def outcome_of(key: int, result: SampleOutput | EngineUserError) -> Outcome[Answer]:
            if isinstance(result, EngineUserError):
                return FailedResult(str(result), "user")
            return result

        yield from runtime.serve_samples(sampler.weights_dir, MappedFeed(feed, job_of, outcome_of))

    def submit_sample(self, sampler: Sampler, job: SampleJob) -> str:
        """Queue one sample job, its request id; jobs for the same weights run in one continuously
        batched decode, which shares the compute thread with other base models' (worker.py)."""
        request_id, future = self._futures.create()
        session_id = session_of_sampler(sampler.sampler_id)
        future.add_done_callback(
            lambda done: self.sampled.record(session_id, request_id, sampler, job, done.result())
        )

        def run_batch(feed: RequestFeed[SampleJob, Outcome[Answer]]) -> Iterator[None]:
            return self.run_sample_batch(sampler, feed)

        model_path = sampler.model_path
        if model_path is not None:
            # Counted until answered, so the snapshot it samples from stays while it runs.
            self._ledger.sample_started(model_path)

            def answered(_: object) -> None:
                self._ledger.sample_answered(model_path)

            future.add_done_callback(answered)

        self._worker.submit_sample(
            sampler.base_model,
            (sampler.base_model, sampler.weights_dir),
            sampler.model_path or sampler.base_model,
            run_batch,
            job,
            future,
        )
        return request_id
