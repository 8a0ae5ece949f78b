"""The embedded engine's HTTP service: Tinker's own API on loopback, so the unmodified `tinker` SDK works.

Routes live under /api/v1. Operations (create_model, forward_backward, optim_step, save/load weights,
asample) answer `{request_id, model_id?}` at once and run on the single compute worker; clients
long-poll `retrieve_future` for the outcome. Everything else answers directly.

External weights (save_weights_external) are plain PEFT adapter directories; get_external_weights_urls
hands out one signed URL per file, served by this engine under /api/v1/external_weights_files/. The
signature is an HMAC with a secret drawn at engine start, so URLs die with the engine process.
"""

from __future__ import annotations

import gc
import hashlib
import hmac
import json
import logging
import math
import secrets
import threading
import time
from collections.abc import AsyncIterator, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from pathlib import Path
from typing import Any
from urllib.parse import quote

import uvicorn
from fastapi import FastAPI, Request
from fastapi.responses import FileResponse, JSONResponse, Response
from starlette.concurrency import run_in_threadpool

from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.futures import FailedResult, FutureTable, JsonResult, Outcome, ProtoResult
from tinkerrpc_server.engine.runtime import (
    BaseModelRuntime,
    EngineUserError,
    LoraSpec,
    SampleJob,
    SampleOutput,
)
from tinkerrpc_server.engine.storage import (
    CheckpointKind,
    CheckpointRecord,
    RunRecord,
    Storage,
    UnknownPathError,
    check_relative_path,
    directory_size,
    file_inside,
    now_iso,
    regular_files,
    validate_checkpoint_name,
)
from tinkerrpc_server.engine.worker import ComputeWorker
from tinkerrpc_server.local.uvicorn_serving import serve_until_signalled
from tinkerrpc_server.model_store import TINY_CHAT, UnknownBaseModelError, resolve_base_model

log = logging.getLogger("tinkerrpc.engine")

# retrieve_future holds a request this long before answering try_again (the SDK's own timeout is 45 s).
LONG_POLL_SECONDS = 25.0
_USER_ERRORS = (EngineUserError, UnknownBaseModelError, UnknownPathError, protocol.BadRequest)
# How long the signed URLs of get_external_weights_urls stay valid.
EXTERNAL_URL_TTL_SECONDS = 3600


class NotFound(LookupError):
    """An id in a direct (non-future) request that the engine does not know: HTTP 404."""


class Forbidden(PermissionError):
    """A signed URL whose signature is wrong or expired: HTTP 403."""


def sign_file(secret: bytes, model_id: str, name: str, file: str, expires: int) -> str:
    """HMAC-SHA256 (hex) of one external-weights file and the unix time its URL expires."""
    message = json.dumps([model_id, name, file, expires]).encode()
    return hmac.new(secret, message, hashlib.sha256).hexdigest()


def check_file_signature(
    secret: bytes, model_id: str, name: str, file: str, expires: str, signature: str, now: float
) -> None:
    """Forbidden unless `signature` signs exactly this file and `expires`, and `expires` is still ahead."""
    if not (expires.isascii() and expires.isdigit()) or not hmac.compare_digest(
        sign_file(secret, model_id, name, file, int(expires)).encode(), signature.encode()
    ):
        raise Forbidden("invalid signature")
    if int(expires) < now:
        raise Forbidden("this URL has expired; ask get_external_weights_urls for new ones")


@dataclass
class Sampler:
    sampler_id: str
    base_model: str
    model_path: str | None
    weights_dir: Path | None


def classify_error(exc: BaseException) -> FailedResult:
    if isinstance(exc, _USER_ERRORS):
        return FailedResult(str(exc), "user")
    log.exception("engine operation failed", exc_info=exc)
    return FailedResult(f"internal engine error: {type(exc).__name__}: {exc}", "server")


class Engine:
    """State shared by the routes. Runtime objects are only touched on the compute worker's thread."""

    def __init__(self, data_dir: Path, model_dir: Path) -> None:
        self.model_dir = model_dir
        self.storage = Storage(data_dir)
        self.futures = FutureTable()
        self.worker = ComputeWorker(classify_error)
        self._resolve_lock = threading.Lock()
        self._runtimes: dict[Path, BaseModelRuntime] = {}
        self._live_models: dict[str, str] = {}  # model_id -> base model, adapters present in a runtime
        self.samplers: dict[str, Sampler] = {}
        self.url_secret = secrets.token_bytes(32)  # signs external-weights file URLs

    # ---- helpers ----

    def resolve_model_dir(self, base_model: str) -> Path:
        # The first use of the built-in model writes it to disk; serialize so two threads never race.
        with self._resolve_lock:
            return resolve_base_model(base_model, self.model_dir)

    def runtime(self, base_model: str) -> BaseModelRuntime:
        """The runtime of a base model, loaded on first use (compute thread only)."""
        path = self.resolve_model_dir(base_model)
        runtime = self._runtimes.get(path)
        if runtime is None:
            started = time.perf_counter()
            runtime = self._runtimes[path] = BaseModelRuntime(path)
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

    def submit_training(
        self, model_id: str, seq_id: int | None, name: str, work: Callable[[], Outcome]
    ) -> str:
        request_id, future = self.futures.create()
        self.storage.touch_run(model_id)
        self.worker.submit_training(model_id, seq_id, f"{name} {model_id}", work, future)
        return request_id

    def save_checkpoint(
        self, model_id: str, kind: CheckpointKind, name: str, overwrite: bool, metadata: dict[str, str]
    ) -> CheckpointRecord:
        runtime = self.live_runtime(model_id)
        validate_name(name)
        directory = self.storage.checkpoint_dir(model_id, kind, name)
        record = CheckpointRecord(model_id, kind, name, now_iso(), 0, metadata)
        if self.storage.has_checkpoint(record.tinker_path) or directory.exists():
            if not overwrite:
                raise EngineUserError(f"checkpoint {record.tinker_path} already exists")
            self.storage.delete_checkpoint(model_id, record.checkpoint_id)
        directory.parent.mkdir(parents=True, exist_ok=True)
        runtime.save_state(model_id, directory, include_optimizer=kind == "training")
        record.size_bytes = directory_size(directory)
        self.storage.add_checkpoint(record)
        return record

    def new_sampler(self, sampler_id: str, base_model: str, model_path: str | None) -> Sampler:
        weights_dir = None
        if model_path is not None:
            _, weights_dir = self.storage.resolve(model_path)
        sampler = Sampler(sampler_id, base_model, model_path, weights_dir)
        self.samplers[sampler_id] = sampler
        return sampler

    def run_sample_batch(
        self, sampler: Sampler, requests: list[tuple[SampleJob, int | None]]
    ) -> list[Outcome]:
        """Run pending sample requests for one sampler as one runtime batch (compute thread)."""
        runtime = self.runtime(sampler.base_model)
        if sampler.weights_dir is not None and not sampler.weights_dir.is_dir():
            raise EngineUserError(f"the weights of {sampler.model_path} were deleted")
        jobs = [fill_max_tokens(job, runtime) for job, _ in requests]
        results: list[SampleOutput | EngineUserError] = []
        try:
            results.extend(runtime.sample(sampler.weights_dir, jobs))
        except EngineUserError:
            if len(jobs) == 1:
                raise
            # One bad request must not fail its batch-mates: retry each alone to isolate it.
            for job in jobs:
                try:
                    results.extend(runtime.sample(sampler.weights_dir, [job]))
                except EngineUserError as exc:
                    results.append(exc)
        outcomes: list[Outcome] = []
        for (_, last_n), result in zip(requests, results, strict=True):
            if isinstance(result, EngineUserError):
                outcomes.append(FailedResult(str(result), "user"))
                continue
            if last_n is not None and result.prompt_logprobs is not None:
                # Only the last N prompt positions were asked for; the SDK checks the rest are None.
                keep_from = len(result.prompt_logprobs) - last_n
                result.prompt_logprobs = [
                    None if j < keep_from else lp for j, lp in enumerate(result.prompt_logprobs)
                ]
            outcomes.append(ProtoResult(protocol.encode_sample_output(result)))
        return outcomes


def validate_name(name: str) -> None:
    try:
        validate_checkpoint_name(name)
    except ValueError as exc:
        raise EngineUserError(str(exc)) from exc


def fill_max_tokens(job: SampleJob, runtime: BaseModelRuntime) -> SampleJob:
    """An unset max_tokens (-1) samples until the context is full (the runtime rejects a too-long prompt)."""
    if job.max_tokens >= 0:
        return job
    return replace(job, max_tokens=max(1, runtime.max_context_length - len(job.prompt_tokens)))


def _run_record_json(run: RunRecord, checkpoints: list[CheckpointRecord]) -> dict[str, Any]:
    training = [c for c in checkpoints if c.kind == "training"]
    sampler = [c for c in checkpoints if c.kind == "sampler"]
    return {
        "training_run_id": run.model_id,
        "base_model": run.base_model,
        "model_owner": "local",
        "is_lora": True,
        "lora_rank": run.lora_rank,
        "last_request_time": run.last_request_time,
        "last_checkpoint": _checkpoint_json(training[-1]) if training else None,
        "last_sampler_checkpoint": _checkpoint_json(sampler[-1]) if sampler else None,
        "user_metadata": run.user_metadata or None,
    }


def _checkpoint_json(c: CheckpointRecord) -> dict[str, Any]:
    return {
        "checkpoint_id": c.checkpoint_id,
        "checkpoint_type": c.kind,
        "time": c.created_at,
        "tinker_path": c.tinker_path,
        "size_bytes": c.size_bytes,
        "public": False,
        "user_metadata": c.user_metadata or None,
    }


def _future_json(request_id: str, model_id: str | None = None) -> dict[str, Any]:
    return {"request_id": request_id, "model_id": model_id}


def _str_metadata(value: Any) -> dict[str, str]:
    return {str(k): str(v) for k, v in (value or {}).items()}


def _supported_models(model_dir: Path) -> list[str]:
    """The built-in model plus every `<org>/<name>` or `<name>` HF directory under --model-dir."""
    names = {TINY_CHAT}
    if model_dir.is_dir():
        for config in [*model_dir.glob("*/config.json"), *model_dir.glob("*/*/config.json")]:
            names.add(str(config.parent.relative_to(model_dir)))
    return sorted(names)


def create_app(data_dir: Path, model_dir: Path) -> FastAPI:
    engine = Engine(data_dir, model_dir)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        engine.worker.stop()

    app = FastAPI(title="tinkerrpc embedded engine", lifespan=lifespan)
    app.state.engine = engine

    @app.exception_handler(NotFound)
    async def not_found(_: Request, exc: NotFound) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(Forbidden)
    async def forbidden(_: Request, exc: Forbidden) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=403)

    @app.exception_handler(UnknownPathError)
    async def unknown_path(_: Request, exc: UnknownPathError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=404)

    @app.exception_handler(protocol.BadRequest)
    async def bad_request(_: Request, exc: protocol.BadRequest) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    @app.exception_handler(UnknownBaseModelError)
    async def unknown_base_model(_: Request, exc: UnknownBaseModelError) -> JSONResponse:
        return JSONResponse({"detail": str(exc)}, status_code=400)

    async def json_body(request: Request) -> dict[str, Any]:
        try:
            body = await request.json()
        except ValueError as exc:
            raise protocol.BadRequest(f"body is not JSON: {exc}") from exc
        if not isinstance(body, dict):
            raise protocol.BadRequest("body must be a JSON object")
        return body

    def required(body: dict[str, Any], key: str) -> Any:
        if body.get(key) is None:
            raise protocol.BadRequest(f"{key} is required")
        return body[key]

    # ---- session and service routes ----

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, str]:
        return {"status": "ok"}

    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        # Plain httpx transport; zstd-compressed forward_backward bodies (decoded in the route).
        return {"use_pyqwest_transport": False, "proto_compress_fwdbwd": True, "pjwt_auth_enabled": False}

    @app.post("/api/v1/client/dynamic_config")
    async def client_dynamic_config() -> dict[str, Any]:
        return {"refresh_interval_sec": 3600}

    @app.post("/api/v1/create_session")
    async def create_session() -> dict[str, Any]:
        session_id = f"s{secrets.token_hex(6)}"
        log.info("session %s created", session_id)
        return {"type": "create_session", "session_id": session_id}

    @app.post("/api/v1/session_heartbeat")
    async def session_heartbeat() -> dict[str, str]:
        return {"type": "session_heartbeat"}

    @app.post("/api/v1/sessions/{session_id}/finish")
    async def finish_session(session_id: str) -> dict[str, str]:
        log.info("session %s finished", session_id)
        return {}

    @app.post("/api/v1/telemetry")
    async def telemetry() -> dict[str, str]:
        return {"status": "accepted"}

    @app.get("/api/v1/get_server_capabilities")
    async def server_capabilities() -> dict[str, Any]:
        names = await run_in_threadpool(_supported_models, engine.model_dir)
        return {
            "supported_models": [
                {"model_name": name, "trainable": True, "sampleable": True} for name in names
            ]
        }

    @app.get("/api/v1/debug/stats")
    async def debug_stats() -> dict[str, int]:
        stats = engine.worker.stats
        return {
            "sample_requests": stats.sample_requests,
            "sample_batches": stats.sample_batches,
            "largest_sample_batch": stats.largest_sample_batch,
            "training_ops": stats.training_ops,
        }

    # ---- futures ----

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: Request) -> Response:
        request_id = str(required(await json_body(request), "request_id"))
        try:
            outcome = await engine.futures.wait(request_id, LONG_POLL_SECONDS)
        except KeyError as exc:
            raise NotFound(f"unknown request id {request_id!r}") from exc
        if outcome is None:
            return JSONResponse({"type": "try_again", "request_id": request_id, "queue_state": "active"})
        if isinstance(outcome, ProtoResult):
            return Response(outcome.payload, media_type=protocol.PROTOBUF_CONTENT_TYPE)
        if isinstance(outcome, FailedResult):
            return JSONResponse({"error": outcome.message, "category": outcome.category})
        return JSONResponse(outcome.payload)

    # ---- training ----

    @app.post("/api/v1/create_model")
    async def create_model(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        model_id = f"{required(body, 'session_id')}:train:{int(required(body, 'model_seq_id'))}"
        base_model = str(required(body, "base_model"))
        lora = body.get("lora_config") or {}
        rank = int(lora.get("rank", 32))
        seed = lora.get("seed")
        spec = LoraSpec(
            rank=rank,
            seed=secrets.randbelow(2**31) if seed is None else int(seed),
            train_mlp=bool(lora.get("train_mlp", True)),
            train_attn=bool(lora.get("train_attn", True)),
            train_unembed=bool(lora.get("train_unembed", True)),
        )
        metadata = _str_metadata(body.get("user_metadata"))
        if rank < 1:
            return _future_json(engine.futures.failed(f"LoRA rank must be >= 1, got {rank}"), model_id)
        if engine.is_live(model_id):
            return _future_json(engine.futures.failed(f"model {model_id} already exists"), model_id)

        def work() -> Outcome:
            runtime = engine.runtime(base_model)
            runtime.create_adapter(model_id, spec)
            stamp = now_iso()
            engine.storage.put_run(
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
            engine._live_models[model_id] = base_model
            return JsonResult({"model_id": model_id, "type": "create_model"})

        return _future_json(engine.submit_training(model_id, 0, "create_model", work), model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: Request) -> dict[str, Any]:
        model_id = str(required(await json_body(request), "model_id"))
        if not engine.is_live(model_id):
            raise NotFound(f"unknown model {model_id!r}")
        run = engine.storage.get_run(model_id)
        path = await run_in_threadpool(engine.resolve_model_dir, run.base_model)
        return {
            "type": "get_info",
            "model_id": model_id,
            "model_data": {"arch": "lora", "model_name": run.base_model, "tokenizer_id": str(path)},
            "is_lora": True,
            "lora_rank": run.lora_rank,
            "model_name": run.base_model,
        }

    def unknown_model_future(model_id: str) -> dict[str, Any]:
        return _future_json(engine.futures.failed(f"unknown model {model_id!r}"), model_id)

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        raw = protocol.decode_body(await request.body(), request.headers.get("content-encoding"))
        call = protocol.parse_forward_backward(raw)
        if not engine.is_live(call.model_id):
            return unknown_model_future(call.model_id)

        def work() -> Outcome:
            if not call.data:
                raise EngineUserError("forward_backward needs at least one datum (data is empty)")
            runtime = engine.live_runtime(call.model_id)
            result = runtime.forward_backward(
                call.model_id, call.data, call.loss_fn, call.loss_fn_config, backward=not call.forward_only
            )
            return ProtoResult(protocol.encode_forward_result(result))

        name = "forward" if call.forward_only else f"forward_backward[{call.loss_fn}]"
        return _future_json(engine.submit_training(call.model_id, call.seq_id, name, work), call.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        model_id = str(required(body, "model_id"))
        if not engine.is_live(model_id):
            return unknown_model_future(model_id)
        adam = body.get("adam_params")

        def work() -> Outcome:
            if not isinstance(adam, dict):
                raise EngineUserError("optim_step needs adam_params (the only optimizer this engine runs)")
            params = {
                "learning_rate": 1e-4,
                "beta1": 0.9,
                "beta2": 0.95,
                "eps": 1e-12,
                "weight_decay": 0.0,
                "grad_clip_norm": 0.0,
            }
            for key, value in adam.items():
                if key not in params:
                    continue
                # JSON has no NaN/inf: the SDK sends them as null.
                if not isinstance(value, int | float) or not math.isfinite(value):
                    raise EngineUserError(f"invalid adam_params: {key}={value!r} is not a finite number")
                params[key] = float(value)
            if params["learning_rate"] < 0:
                raise EngineUserError(
                    f"invalid adam_params: learning_rate {params['learning_rate']} is negative"
                )
            metrics = engine.live_runtime(model_id).optim_step(model_id, **params)
            return JsonResult({"metrics": metrics})

        return _future_json(
            engine.submit_training(model_id, body.get("seq_id"), "optim_step", work), model_id
        )

    @app.post("/api/v1/save_weights")
    async def save_weights(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        model_id = str(required(body, "model_id"))
        if not engine.is_live(model_id):
            return unknown_model_future(model_id)
        seq_id = body.get("seq_id")
        name = body.get("path") or f"state-{seq_id or secrets.token_hex(4)}"

        def work() -> Outcome:
            record = engine.save_checkpoint(
                model_id,
                "training",
                str(name),
                bool(body.get("overwrite")),
                _str_metadata(body.get("user_metadata")),
            )
            return JsonResult({"path": record.tinker_path, "type": "save_weights"})

        return _future_json(engine.submit_training(model_id, seq_id, "save_weights", work), model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        model_id = str(required(body, "model_id"))
        if not engine.is_live(model_id):
            return unknown_model_future(model_id)
        seq_id = body.get("seq_id")
        name = body.get("path")
        session_seq = body.get("sampling_session_seq_id")

        def work() -> Outcome:
            ckpt_name = str(name) if name else f"sampler-{seq_id}-{secrets.token_hex(3)}"
            record = engine.save_checkpoint(
                model_id, "sampler", ckpt_name, False, _str_metadata(body.get("user_metadata"))
            )
            result: dict[str, Any] = {"path": record.tinker_path, "type": "save_weights_for_sampler"}
            if not name:
                # The no-name variant hands back a sampling session over the weights just saved.
                session = model_id.split(":train:")[0]
                sampler = engine.new_sampler(
                    f"{session}:sample:{session_seq}:{secrets.token_hex(3)}",
                    engine.storage.get_run(model_id).base_model,
                    record.tinker_path,
                )
                result["sampling_session_id"] = sampler.sampler_id
            return JsonResult(result)

        return _future_json(
            engine.submit_training(model_id, seq_id, "save_weights_for_sampler", work), model_id
        )

    @app.post("/api/v1/save_weights_external")
    async def save_weights_external(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        model_id = str(required(body, "model_id"))
        if not engine.is_live(model_id):
            return unknown_model_future(model_id)
        seq_id = body.get("seq_id")
        name = str(required(body, "path"))
        recipients = body.get("age_encryption_recipients")
        # ttl_seconds is accepted and ignored: local exports stay until delete_checkpoint removes them.

        def work() -> Outcome:
            # Checked here, in seq order, so a rejected request still takes its turn in the model's queue.
            if recipients:
                raise EngineUserError(
                    "age_encryption_recipients: encrypting exported weights is not supported by the local "
                    "engine (its exports never leave this machine); export without recipients"
                )
            record = engine.save_checkpoint(model_id, "external", name, False, {})
            return JsonResult(
                {"path": record.tinker_path, "size_bytes": record.size_bytes, "type": "save_weights_external"}
            )

        return _future_json(engine.submit_training(model_id, seq_id, "save_weights_external", work), model_id)

    @app.post("/api/v1/load_weights")
    async def load_weights(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        path = str(required(body, "path"))
        with_optimizer = bool(body.get("optimizer"))
        creating = body.get("model_id") is None
        if creating:
            model_id = f"{required(body, 'session_id')}:train:{int(required(body, 'model_seq_id'))}"
            seq_id: int | None = 0
        else:
            model_id = str(body["model_id"])
            seq_id = body.get("seq_id")
            if not engine.is_live(model_id):
                return unknown_model_future(model_id)

        def work() -> Outcome:
            try:
                record, directory = engine.storage.resolve(path)
            except UnknownPathError as exc:
                raise EngineUserError(str(exc)) from exc
            source = engine.storage.get_run(record.model_id)
            base_model = str(body.get("base_model") or source.base_model)
            if not creating and engine._live_models[model_id] != base_model:
                raise EngineUserError(
                    f"{path} was trained on {base_model}, model {model_id} is on {engine._live_models[model_id]}"
                )
            if with_optimizer and record.kind != "training":
                raise EngineUserError(
                    f"{path} holds adapter weights only; optimizer state needs a save_state path"
                )
            spec = engine.runtime(base_model).load_state(
                model_id, directory, include_optimizer=with_optimizer
            )
            stamp = now_iso()
            engine.storage.put_run(
                RunRecord(
                    model_id,
                    base_model,
                    spec.rank,
                    spec.seed,
                    spec.train_mlp,
                    spec.train_attn,
                    spec.train_unembed,
                    stamp,
                    stamp,
                    _str_metadata(body.get("user_metadata")),
                )
            )
            engine._live_models[model_id] = base_model
            return JsonResult({"path": path, "model_id": model_id, "type": "load_weights"})

        return _future_json(engine.submit_training(model_id, seq_id, "load_weights", work), model_id)

    @app.post("/api/v1/weights_info")
    async def weights_info(request: Request) -> dict[str, Any]:
        record, _ = engine.storage.resolve(str(required(await json_body(request), "tinker_path")))
        run = engine.storage.get_run(record.model_id)
        return {
            "base_model": run.base_model,
            "is_lora": True,
            "lora_rank": run.lora_rank,
            "train_unembed": run.train_unembed,
            "train_mlp": run.train_mlp,
            "train_attn": run.train_attn,
        }

    # ---- sampling ----

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        sampler_id = f"{required(body, 'session_id')}:sample:{int(required(body, 'sampling_session_seq_id'))}"
        model_path = body.get("model_path")
        if model_path:
            record, _ = engine.storage.resolve(str(model_path))
            base_model = engine.storage.get_run(record.model_id).base_model
        else:
            base_model = str(required(body, "base_model"))
            await run_in_threadpool(engine.resolve_model_dir, base_model)
        engine.new_sampler(sampler_id, base_model, str(model_path) if model_path else None)
        log.info("sampling session %s on %s", sampler_id, model_path or base_model)
        return {"type": "create_sampling_session", "sampling_session_id": sampler_id}

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        sampler = engine.samplers.get(sampler_id)
        if sampler is None:
            raise NotFound(f"unknown sampler {sampler_id!r}")
        return {"sampler_id": sampler_id, "base_model": sampler.base_model, "model_path": sampler.model_path}

    @app.post("/api/v1/asample")
    async def asample(request: Request) -> dict[str, Any]:
        body = await json_body(request)
        num_samples = int(body.get("num_samples") or 1)
        request_id, future = engine.futures.create()
        response = {
            "request_id": request_id,
            "sample_sequence_ids": [f"{request_id}:{i}" for i in range(num_samples)],
        }
        try:
            sampler = sampler_for(body)
            job = protocol.sample_job(body)
            for unsupported in ("topk_sample_logprobs", "prompt_alt_tokens_k", "target_prompt_logprobs"):
                if body.get(unsupported):
                    raise protocol.BadRequest(f"{unsupported} is not supported by this engine")
            last_n = body.get("prompt_logprobs_last_n")
            if last_n is not None and not 1 <= int(last_n) < len(job.prompt_tokens):
                raise protocol.BadRequest(
                    f"prompt_logprobs_last_n must be in [1, {len(job.prompt_tokens) - 1}]"
                )
        except (protocol.BadRequest, NotFound, UnknownPathError) as exc:
            future.set_result(FailedResult(str(exc), "user"))
            return response

        def run_batch(payloads: list[Any]) -> list[Outcome]:
            return engine.run_sample_batch(sampler, payloads)

        engine.worker.submit_sample(
            (sampler.base_model, sampler.weights_dir),
            sampler.model_path or sampler.base_model,
            run_batch,
            (job, None if last_n is None else int(last_n)),
            future,
        )
        return response

    def sampler_for(body: dict[str, Any]) -> Sampler:
        sampler_id = body.get("sampling_session_id")
        if sampler_id is not None:
            sampler = engine.samplers.get(str(sampler_id))
            if sampler is None:
                raise NotFound(f"unknown sampling session {sampler_id!r}")
            return sampler
        model_path = body.get("model_path")
        if model_path:
            record, weights_dir = engine.storage.resolve(str(model_path))
            base_model = engine.storage.get_run(record.model_id).base_model
            return Sampler("", base_model, str(model_path), weights_dir)
        return Sampler("", str(required(body, "base_model")), None, None)

    # ---- REST: training runs and checkpoints ----

    @app.get("/api/v1/training_runs")
    async def list_training_runs(limit: int = 20, offset: int = 0) -> dict[str, Any]:
        runs = engine.storage.list_runs()
        page = runs[offset : offset + limit]
        return {
            "training_runs": [_run_record_json(r, engine.storage.list_checkpoints(r.model_id)) for r in page],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(runs)},
        }

    @app.get("/api/v1/training_runs/{model_id}")
    async def get_training_run(model_id: str) -> dict[str, Any]:
        run = engine.storage.get_run(model_id)
        return _run_record_json(run, engine.storage.list_checkpoints(model_id))

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(model_id: str) -> dict[str, Any]:
        engine.storage.get_run(model_id)
        return {"checkpoints": [_checkpoint_json(c) for c in engine.storage.list_checkpoints(model_id)]}

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str) -> dict[str, Any]:
        record = await run_in_threadpool(engine.storage.delete_checkpoint, model_id, checkpoint_id)
        log.info("deleted checkpoint %s", record.tinker_path)
        return {}

    # The SDK sends checkpoint_id ("external_weights/<name>") with its slash unencoded.
    @app.get("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}/external_weights_urls")
    async def external_weights_urls(model_id: str, checkpoint_id: str, request: Request) -> dict[str, Any]:
        tinker_path = f"tinker://{model_id}/{checkpoint_id}"
        record, directory = engine.storage.resolve(tinker_path)
        if record.kind != "external":
            raise UnknownPathError(f"{tinker_path} is not an external_weights checkpoint")
        files = await run_in_threadpool(regular_files, directory)
        expires = int(time.time()) + EXTERNAL_URL_TTL_SECONDS
        base = f"{str(request.base_url).rstrip('/')}/api/v1/external_weights_files"
        prefix = f"{base}/{quote(model_id, safe=':')}/{quote(record.name, safe='')}"
        urls = {
            file: f"{prefix}/{quote(file)}?expires={expires}&signature="
            + sign_file(engine.url_secret, model_id, record.name, file, expires)
            for file in files
        }
        return {"urls": urls, "expires": datetime.fromtimestamp(expires, timezone.utc).isoformat()}

    @app.get("/api/v1/external_weights_files/{model_id}/{name}/{file:path}")
    async def external_weights_file(
        model_id: str, name: str, file: str, expires: str = "", signature: str = ""
    ) -> FileResponse:
        check_relative_path(file)  # 404 for '..', absolute paths and the like, before anything else
        check_file_signature(engine.url_secret, model_id, name, file, expires, signature, time.time())
        _, directory = engine.storage.resolve(f"tinker://{model_id}/external_weights/{name}")
        path = await run_in_threadpool(file_inside, directory, file)
        return FileResponse(path, media_type="application/octet-stream")

    @app.get("/api/v1/checkpoints")
    async def list_all_checkpoints(limit: int = 100, offset: int = 0) -> dict[str, Any]:
        everything = [
            c for r in engine.storage.list_runs() for c in engine.storage.list_checkpoints(r.model_id)
        ]
        return {
            "checkpoints": [_checkpoint_json(c) for c in everything[offset : offset + limit]],
            "cursor": {"offset": offset, "limit": limit, "total_count": len(everything)},
        }

    return app


def run_engine(host: str, port: int, data_dir: Path, model_dir: Path) -> None:
    """Serve the engine until SIGTERM/SIGINT, then return normally."""
    app = create_app(data_dir, model_dir)
    log.info("engine on http://%s:%d (data %s, models %s)", host, port, data_dir, model_dir)
    # No access log: clients long-poll retrieve_future; the worker logs one line per operation.
    config = uvicorn.Config(
        app, host=host, port=port, access_log=False, log_level="warning", timeout_graceful_shutdown=3
    )
    # The imports (torch, transformers, peft) leave millions of long-lived objects: freezing them keeps
    # every garbage collection, and the final one at exit (3+ s otherwise), from walking them.
    gc.freeze()
    serve_until_signalled(config)
