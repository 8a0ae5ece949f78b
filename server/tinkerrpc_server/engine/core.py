"""The engine's shared state and its operations, used by every route family.

Routes reach the one `Engine` of an app through a FastAPI dependency; they read its state and change it
only through its methods. Runtime objects are only touched on the compute worker's thread: the methods
documented "compute thread" run inside work submitted to the worker.

Bounded by what clients are still using: a training client's adapter and optimizer state are freed when
it is unloaded (`unload_model`, which the service sends when it drops a training client: restore,
rollback, cancelled step, DeleteModel) or when the session that created it finishes: the client finishes
it, or stops sending the SDK's heartbeats (every 10 s) for the session timeout. An unnamed
`save_weights_for_sampler` snapshot is ephemeral: once a newer unnamed snapshot of the same training
client supersedes it (or the client is unloaded) it is deleted as soon as no sampling session and no
sample request in flight refers to it and the snapshot grace has passed since the last one did, so an
off-policy rollout still sampling from an older client finishes; at most UNNAMED_SNAPSHOTS_KEPT_PER_MODEL
stay on disk per training client (past it the oldest go, unused ones first), and an engine restart
deletes them all. Checkpoints saved with `ttl_seconds` are deleted by a sweep
every SWEEP_INTERVAL_SECONDS once it has passed (and are unknown from that moment on); the same sweep
finishes silent sessions and deletes the unnamed snapshots nothing uses any more.
"""

from __future__ import annotations

import contextlib
import logging
import secrets
import threading
import time
from collections import Counter, OrderedDict
from collections.abc import Callable
from dataclasses import dataclass, replace
from pathlib import Path

from tinker import types

from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.compute.feed import MappedFeed, RequestFeed
from tinkerrpc_server.engine.compute.samples import SampleJob, SampleOutput
from tinkerrpc_server.engine.config import EngineConfig
from tinkerrpc_server.engine.futures import (
    FailedResult,
    FutureTable,
    JsonResult,
    Outcome,
    ProtoResult,
    RequestFuture,
)
from tinkerrpc_server.engine.runtime import BaseModelRuntime, EngineUserError, LoraSpec
from tinkerrpc_server.engine.storage import (
    CheckpointKind,
    CheckpointRecord,
    InvalidNameError,
    RunRecord,
    Storage,
    UnknownPathError,
    directory_size,
    now_iso,
)
from tinkerrpc_server.engine.worker import ComputeWorker
from tinkerrpc_server.model_store import UnknownBaseModelError, listed_builtin_models, resolve_base_model

log = logging.getLogger("tinkerrpc.engine")

# How often expired checkpoints are deleted from disk (and silent sessions finished, at least this often).
SWEEP_INTERVAL_SECONDS = 30.0
# Finished session ids remembered so their heartbeats answer 410 (the SDK then stops its loop).
_FINISHED_SESSIONS_REMEMBERED = 4096
# Unnamed sampler snapshots kept per training client, its newest included: disk stays bounded however
# many sampling clients an async RL loop holds (each is one adapter's size).
UNNAMED_SNAPSHOTS_KEPT_PER_MODEL = 8
# Sequenced requests remembered per training client, so a resent one is recognised (see submit_training).
_SEQUENCED_REMEMBERED = 256

_USER_ERRORS = (
    EngineUserError,
    UnknownBaseModelError,
    UnknownPathError,
    InvalidNameError,
    protocol.BadRequest,
)


class NotFound(LookupError):
    """An id in a direct (non-future) request that the engine does not know: HTTP 404."""


@dataclass
class Sampler:
    sampler_id: str
    base_model: str
    model_path: str | None
    weights_dir: Path | None


@dataclass
class UnnamedSnapshot:
    model_id: str
    checkpoint_id: str
    tinker_path: str
    last_used: float  # time.monotonic() when a sampling session or request last let go of it
    current: bool = True  # its training client's newest, while that client is live


def classify_error(exc: BaseException) -> FailedResult:
    if isinstance(exc, _USER_ERRORS):
        return FailedResult(str(exc), "user")
    log.exception("engine operation failed", exc_info=exc)
    return FailedResult(f"internal engine error: {type(exc).__name__}: {exc}", "server")


class Engine:
    def __init__(self, config: EngineConfig) -> None:
        self.config = config
        self.snapshot_grace = config.snapshot_grace
        self.model_dir = config.model_dir
        self._device, self._dtype, self._policy = config.device, config.dtype, config.policy
        self.session_timeout = config.session_timeout
        self.storage = Storage(config.data_dir)
        self.futures = FutureTable()
        self.worker = ComputeWorker(classify_error, torch_threads=config.torch_threads)
        self.url_secret = secrets.token_bytes(32)  # signs external-weights file URLs
        self._resolve_lock = threading.Lock()
        self._runtimes: dict[Path, BaseModelRuntime] = {}
        self._live_models: dict[str, str] = {}  # model_id -> base model, adapters present in a runtime
        self._samplers: dict[str, Sampler] = {}
        self._snapshots_lock = threading.Lock()
        # model_id -> tinker path -> its unnamed sampler snapshots on disk, oldest first.
        self._unnamed_snapshots: dict[str, OrderedDict[str, UnnamedSnapshot]] = {}
        self._samples_in_flight: Counter[str] = Counter()  # model path -> sample requests not answered
        self._sequenced_lock = threading.Lock()
        # model_id -> seq_id -> (operation, request id) of its recent sequenced requests.
        self._sequenced: dict[str, OrderedDict[int, tuple[str, str]]] = {}
        self._sessions_lock = threading.Lock()
        self._session_last_seen: dict[str, float] = {}  # session id -> time.monotonic() of its last sign
        self._finished_sessions: OrderedDict[str, None] = OrderedDict()
        self._stopped = threading.Event()
        self._sweeper = threading.Thread(target=self._sweep_expired, name="engine-sweep", daemon=True)
        self._sweeper.start()

    def close(self) -> None:
        self._stopped.set()
        self.worker.stop()
        self.storage.close()

    def _sweep_expired(self) -> None:
        interval = min(SWEEP_INTERVAL_SECONDS, self.session_timeout / 4, self.snapshot_grace / 2)
        while not self._stopped.wait(interval):
            try:
                for record in self.storage.delete_expired(time.time()):
                    log.info("checkpoint %s expired and was deleted", record.tinker_path)
                for session_id in self._silent_sessions(time.monotonic()):
                    log.info("session %s sent nothing for %.0f s: finished", session_id, self.session_timeout)
                    self.finish_session(session_id)
                self.delete_unused_snapshots(time.monotonic())
            except Exception:
                log.exception("the engine's sweep failed")

    # ---- sessions ----

    def open_session(self) -> str:
        session_id = f"s{secrets.token_hex(6)}"
        self.session_alive(session_id)
        return session_id

    def session_alive(self, session_id: str) -> bool:
        """Record a sign of life of a session; False if it has finished. A session this engine never
        saw (it was made before a restart) is adopted."""
        with self._sessions_lock:
            if session_id in self._finished_sessions:
                return False
            self._session_last_seen[session_id] = time.monotonic()
            return True

    def require_open_session(self, session_id: str) -> None:
        """For requests that make something in a session: what a finished session makes would never
        be freed."""
        if not self.session_alive(session_id):
            raise protocol.BadRequest(f"session {session_id} has finished")

    def _silent_sessions(self, now: float) -> list[str]:
        with self._sessions_lock:
            return [s for s, seen in self._session_last_seen.items() if now - seen > self.session_timeout]

    def finish_session(self, session_id: str) -> None:
        """Unload the session's training clients (after the work they have queued) and forget its
        sampling sessions: nothing it made stays in memory."""
        with self._sessions_lock:
            self._session_last_seen.pop(session_id, None)
            self._finished_sessions[session_id] = None
            while len(self._finished_sessions) > _FINISHED_SESSIONS_REMEMBERED:
                self._finished_sessions.popitem(last=False)
        for model_id in self.session_models(session_id):
            self.queue_unload(model_id)
        self.forget_session_samplers(session_id)
        log.info("session %s finished", session_id)

    # ---- models ----

    def resolve_model_dir(self, base_model: str) -> Path:
        # The first use of the built-in model writes it to disk; serialize so two threads never race.
        with self._resolve_lock:
            return resolve_base_model(base_model, self.model_dir)

    def runtime(self, base_model: str) -> BaseModelRuntime:
        """The runtime of a base model, loaded on first use (compute thread)."""
        path = self.resolve_model_dir(base_model)
        runtime = self._runtimes.get(path)
        if runtime is None:
            started = time.perf_counter()
            runtime = self._runtimes[path] = BaseModelRuntime(path, self._device, self._dtype, self._policy)
            log.info(
                "loaded base model %s from %s in %.1f s", base_model, path, time.perf_counter() - started
            )
        return runtime

    def live_runtime(self, model_id: str) -> BaseModelRuntime:
        base_model = self._live_models.get(model_id)
        if base_model is None:
            raise EngineUserError(f"unknown model {model_id!r}")
        return self.runtime(base_model)

    def is_live(self, model_id: str) -> bool:
        return model_id in self._live_models

    def live_model_count(self) -> int:
        return len(self._live_models)

    def unload_model(self, model_id: str) -> None:
        """Free a training client's adapter and optimizer state; its checkpoints stay, but its unnamed
        sampler snapshot goes with it (compute thread)."""
        runtime = self.live_runtime(model_id)
        runtime.delete_adapter(model_id)
        del self._live_models[model_id]
        with self._sequenced_lock:
            self._sequenced.pop(model_id, None)
        self._supersede_unnamed_snapshots(model_id)
        log.info("model %s unloaded", model_id)

    def queue_unload(self, model_id: str) -> str:
        """Unload a training client after everything already queued for it (its last operations run)."""

        def work() -> Outcome:
            self.unload_model(model_id)
            return JsonResult(types.UnloadModelResponse(model_id=model_id, type="unload_model"))

        return self.submit_training(model_id, None, "unload_model", work)

    def session_models(self, session_id: str) -> list[str]:
        """The live training clients a session created."""
        prefix = f"{session_id}:train:"
        return [model_id for model_id in list(self._live_models) if model_id.startswith(prefix)]

    def forget_session_samplers(self, session_id: str) -> None:
        prefix = f"{session_id}:sample:"
        for sampler_id in [s for s in list(self._samplers) if s.startswith(prefix)]:
            sampler = self._samplers.pop(sampler_id, None)
            if sampler is not None and sampler.model_path is not None:
                self._snapshot_let_go(sampler.model_path)

    def supported_models(self) -> list[str]:
        """The built-in models listed before they are built, plus every `<org>/<name>` or `<name>` HF
        directory under --model-dir."""
        names = set(listed_builtin_models())
        if self.model_dir.is_dir():
            for config in [*self.model_dir.glob("*/config.json"), *self.model_dir.glob("*/*/config.json")]:
                names.add(str(config.parent.relative_to(self.model_dir)))
        return sorted(names)

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
    ) -> None:
        """Load a checkpoint into `model_id`, creating it unless it is live (compute thread)."""
        try:
            record, directory = self.storage.resolve(path)
        except UnknownPathError as exc:
            raise EngineUserError(str(exc)) from exc
        base_model = base_model or self.storage.get_run(record.model_id).base_model
        live_base = self._live_models.get(model_id)
        if live_base is not None and live_base != base_model:
            raise EngineUserError(f"{path} was trained on {base_model}, model {model_id} is on {live_base}")
        if with_optimizer and record.kind != "training":
            raise EngineUserError(
                f"{path} holds adapter weights only; optimizer state needs a save_state path"
            )
        spec = self.runtime(base_model).load_state(model_id, directory, include_optimizer=with_optimizer)
        self._record_live_run(model_id, base_model, spec, spec.seed, metadata)

    def _record_live_run(
        self, model_id: str, base_model: str, spec: LoraSpec, seed: int | None, metadata: dict[str, str]
    ) -> None:
        stamp = now_iso()
        self.storage.put_run(
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
        self._live_models[model_id] = base_model

    def submit_training(
        self, model_id: str, seq_id: int | None, name: str, work: Callable[[], Outcome]
    ) -> str:
        """Queue a training client's operation; a repeat of a recent one is answered by it (see
        `resent_request`)."""
        earlier = self.resent_request(model_id, seq_id, name)
        if earlier is not None:
            return earlier
        request_id, future = self.futures.create()
        self.storage.touch_run(model_id)
        if seq_id is not None:
            with self._sequenced_lock:
                recent = self._sequenced.setdefault(model_id, OrderedDict())
                recent[seq_id] = (name, request_id)
                while len(recent) > _SEQUENCED_REMEMBERED:
                    recent.popitem(last=False)
        self.worker.submit_training(model_id, seq_id, f"{name} {model_id}", work, future)
        return request_id

    def resent_request(self, model_id: str, seq_id: int | None, name: str) -> str | None:
        """The request id of a recent `name` operation with this seq_id, if any: the SDK resends a
        request whose answer it did not get (a timeout, a 5xx) with the same body, and never reuses a
        seq_id otherwise, so such a repeat is the same request and must not run twice."""
        if seq_id is None:
            return None
        with self._sequenced_lock:
            recent = self._sequenced.get(model_id)
            earlier = recent.get(seq_id) if recent is not None else None
        if earlier is None or earlier[0] != name:
            return None
        log.info("%s %s seq=%d sent again: answered by its first request", name, model_id, seq_id)
        return earlier[1]

    def reject_in_turn(self, model_id: str, seq_id: int, name: str, message: str) -> str:
        """A request id that fails with `message` when `seq_id` comes up in the model's queue, so the
        model's later requests do not wait for a seq_id that a rejected request used."""

        def reject() -> Outcome:
            raise EngineUserError(message)

        return self.submit_training(model_id, seq_id, name, reject)

    # ---- checkpoints ----

    def save_checkpoint(
        self,
        model_id: str,
        kind: CheckpointKind,
        name: str,
        overwrite: bool,
        metadata: dict[str, str],
        ttl_seconds: int | None,
        ephemeral: bool = False,
    ) -> CheckpointRecord:
        """Save a live model's adapter (and for "training", its optimizer) as a checkpoint, deleted
        `ttl_seconds` from now if set; an ephemeral one does not outlive this engine (compute thread)."""
        runtime = self.live_runtime(model_id)
        directory = self.storage.checkpoint_dir(model_id, kind, name)
        if ttl_seconds is not None and ttl_seconds < 1:
            raise EngineUserError(f"ttl_seconds must be at least 1, got {ttl_seconds}")
        expires_at = time.time() + ttl_seconds if ttl_seconds is not None else None
        record = CheckpointRecord(model_id, kind, name, now_iso(), 0, metadata, expires_at, ephemeral)
        if self.storage.has_checkpoint(record.tinker_path) or directory.exists():
            if not overwrite:
                raise EngineUserError(f"checkpoint {record.tinker_path} already exists")
            self.storage.delete_checkpoint(model_id, record.checkpoint_id)
        directory.parent.mkdir(parents=True, exist_ok=True)
        runtime.save_state(model_id, directory, include_optimizer=kind == "training")
        record.size_bytes = directory_size(directory)
        self.storage.add_checkpoint(record)
        return record

    def save_unnamed_snapshot(
        self, model_id: str, name: str, metadata: dict[str, str], ttl_seconds: int | None
    ) -> CheckpointRecord:
        """An ephemeral sampler snapshot: it supersedes the model's previous unnamed one, which stays
        while it is used (compute thread)."""
        record = self.save_checkpoint(model_id, "sampler", name, False, metadata, ttl_seconds, ephemeral=True)
        self._supersede_unnamed_snapshots(model_id)
        snapshot = UnnamedSnapshot(model_id, record.checkpoint_id, record.tinker_path, time.monotonic())
        with self._snapshots_lock:
            kept = self._unnamed_snapshots.setdefault(model_id, OrderedDict())
            kept[record.tinker_path] = snapshot
            doomed = self._snapshots_over_cap(kept)
        self._delete_snapshots(doomed, "past the cap of unnamed snapshots per training client")
        return record

    def _supersede_unnamed_snapshots(self, model_id: str) -> None:
        now = time.monotonic()
        with self._snapshots_lock:
            for snapshot in self._unnamed_snapshots.get(model_id, OrderedDict()).values():
                if snapshot.current:
                    snapshot.current, snapshot.last_used = False, now

    def _snapshot_users(self) -> Counter[str]:
        """Model path -> sampling sessions and sample requests in flight that refer to it (under
        _snapshots_lock)."""
        users = Counter(s.model_path for s in list(self._samplers.values()) if s.model_path is not None)
        users.update(self._samples_in_flight)
        return users

    def _snapshots_over_cap(self, kept: OrderedDict[str, UnnamedSnapshot]) -> list[UnnamedSnapshot]:
        """Removes and returns the snapshots past the cap: the oldest superseded ones, unused first
        (under _snapshots_lock)."""
        excess = len(kept) - UNNAMED_SNAPSHOTS_KEPT_PER_MODEL
        if excess <= 0:
            return []
        users = self._snapshot_users()
        superseded = [s for s in kept.values() if not s.current]
        doomed = sorted(superseded, key=lambda s: users[s.tinker_path] > 0)[:excess]
        for snapshot in doomed:
            del kept[snapshot.tinker_path]
        return doomed

    def delete_unused_snapshots(self, now: float) -> None:
        """Delete the superseded unnamed snapshots nothing has used for the snapshot grace."""
        doomed = []
        with self._snapshots_lock:
            users = self._snapshot_users()
            for model_id, kept in list(self._unnamed_snapshots.items()):
                for snapshot in list(kept.values()):
                    if snapshot.current:
                        continue
                    if users[snapshot.tinker_path]:
                        snapshot.last_used = now
                    elif now - snapshot.last_used >= self.snapshot_grace:
                        doomed.append(kept.pop(snapshot.tinker_path))
                if not kept:
                    del self._unnamed_snapshots[model_id]
        self._delete_snapshots(doomed, "superseded and unused")

    def _snapshot_let_go(self, model_path: str) -> None:
        """A sampling session or request of `model_path` ended: its grace starts now."""
        now = time.monotonic()
        with self._snapshots_lock:
            model_id = model_path.removeprefix("tinker://").split("/", 1)[0]
            kept = self._unnamed_snapshots.get(model_id)
            snapshot = kept.get(model_path) if kept is not None else None
            if snapshot is not None:
                snapshot.last_used = now

    def _delete_snapshots(self, doomed: list[UnnamedSnapshot], why: str) -> None:
        for snapshot in doomed:
            with contextlib.suppress(UnknownPathError):  # its owner may have deleted it already
                self.storage.delete_checkpoint(snapshot.model_id, snapshot.checkpoint_id)
            log.info("unnamed sampler snapshot %s deleted: %s", snapshot.tinker_path, why)

    # ---- sampling ----

    def new_sampler(self, sampler_id: str, base_model: str, model_path: str | None) -> Sampler:
        weights_dir = None
        if model_path is not None:
            _, weights_dir = self.storage.resolve(model_path)
        sampler = Sampler(sampler_id, base_model, model_path, weights_dir)
        self._samplers[sampler_id] = sampler
        return sampler

    def sampler(self, sampler_id: str) -> Sampler:
        sampler = self._samplers.get(sampler_id)
        if sampler is None:
            raise NotFound(f"unknown sampling session {sampler_id!r}")
        return sampler

    def sampler_for(
        self, sampling_session_id: str | None, model_path: str | None, base_model: str | None
    ) -> Sampler:
        """The sampling session a sample request names, or a one-off sampler for its weights."""
        if sampling_session_id is not None:
            return self.sampler(sampling_session_id)
        if model_path:
            record, weights_dir = self.storage.resolve(model_path)
            return Sampler("", self.storage.get_run(record.model_id).base_model, model_path, weights_dir)
        if base_model is None:
            raise protocol.BadRequest("base_model is required")
        return Sampler("", base_model, None, None)

    def run_sample_batch(self, sampler: Sampler, feed: RequestFeed[SampleJob, Outcome]) -> None:
        """Run the sample jobs `feed` brings for one sampler as one continuously batched decode
        (compute thread): each is answered as soon as it finishes, a bad one alone fails, and `feed`
        runs queued training between decode steps."""
        runtime = self.runtime(sampler.base_model)
        if sampler.weights_dir is not None and not sampler.weights_dir.is_dir():
            raise EngineUserError(f"the weights of {sampler.model_path} were deleted")

        def job_of(key: int, job: SampleJob) -> SampleJob:
            return fill_max_tokens(job, runtime)

        def outcome_of(key: int, result: SampleOutput | EngineUserError) -> Outcome:
            if isinstance(result, EngineUserError):
                return FailedResult(str(result), "user")
            return ProtoResult(protocol.encode_sample_output(result))

        runtime.serve_samples(sampler.weights_dir, MappedFeed(feed, job_of, outcome_of))

    def submit_sample(self, sampler: Sampler, job: SampleJob, future: RequestFuture) -> None:
        """Queue one sample job; jobs for the same weights run in one continuously batched decode."""

        def run_batch(feed: RequestFeed[SampleJob, Outcome]) -> None:
            self.run_sample_batch(sampler, feed)

        model_path = sampler.model_path
        if model_path is not None:
            # Counted until answered, so the snapshot it samples from stays while it runs.
            with self._snapshots_lock:
                self._samples_in_flight[model_path] += 1

            def answered(_: object) -> None:
                with self._snapshots_lock:
                    self._samples_in_flight[model_path] -= 1
                    if self._samples_in_flight[model_path] <= 0:
                        del self._samples_in_flight[model_path]
                self._snapshot_let_go(model_path)

            future.add_done_callback(answered)

        self.worker.submit_sample(
            (sampler.base_model, sampler.weights_dir),
            sampler.model_path or sampler.base_model,
            run_batch,
            job,
            future,
        )


def fill_max_tokens(job: SampleJob, runtime: BaseModelRuntime) -> SampleJob:
    """An unset max_tokens (-1) samples until the context is full (the runtime rejects a too-long prompt)."""
    if job.max_tokens >= 0:
        return job
    return replace(job, max_tokens=max(1, runtime.max_context_length - len(job.prompt_tokens)))
