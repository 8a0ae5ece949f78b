"""Service configuration, session heartbeats, futures, and training models: creating them and reading
their runs (sessions themselves: routes/sessions.py).

Bodies the engine does not read (telemetry, client config) are not parsed.
"""

from __future__ import annotations

import logging
import secrets
from datetime import datetime

from fastapi import APIRouter, Request
from fastapi.responses import JSONResponse, Response
from starlette.concurrency import run_in_threadpool
from tinker import types
from tinker.types.try_again_response import TryAgainResponse

from tinkerrpc.contract.limits import DEFAULT_LORA_RANK
from tinkerrpc_server.engine.answers import Answer
from tinkerrpc_server.engine.compute.optimizer_families import ADAMW
from tinkerrpc_server.engine.core import NotFound
from tinkerrpc_server.engine.optimizers import optimizer_family
from tinkerrpc_server.engine.routes.common import (
    EngineDep,
    future,
    outcome_response,
    page_bounds,
    sdk_checkpoint,
    str_metadata,
)
from tinkerrpc_server.engine.runtime import LoraSpec
from tinkerrpc_server.engine.sessions import session_of
from tinkerrpc_server.engine.storage import CheckpointRecord, RunRecord, check_id
from tinkerrpc_server.engine.tokens import LOCAL_USER_URN

log = logging.getLogger("tinkerrpc.engine")
router = APIRouter(prefix="/api/v1")

# retrieve_future holds a request this long before answering try_again (the SDK's own timeout is 45 s).
LONG_POLL_SECONDS = 25.0

# ---- session and service ----


@router.get("/healthz")
async def healthz() -> types.HealthResponse:
    return types.HealthResponse(status="ok")


@router.post("/client/config")
async def client_config(engine: EngineDep) -> types.ClientConfigResponse:
    # The SDK's reqwest-based transport (pyqwest): httpx's pool polls every idle connection on each
    # request, which at dozens of concurrent samples cost the SDK's caller more CPU than the engine's
    # decoding; zstd-compressed forward_backward bodies (decoded by the training route); with a key, the
    # SDK's JWT exchange (routes/auth_token.py), which whoami needs.
    return types.ClientConfigResponse(
        use_pyqwest_transport=True,
        proto_compress_fwdbwd=True,
        pjwt_auth_enabled=engine.config.api_key is not None,
    )


@router.post("/client/dynamic_config")
async def client_dynamic_config() -> types.ClientDynamicConfigResponse:
    return types.ClientDynamicConfigResponse(refresh_interval_sec=3600)


@router.post("/session_heartbeat", response_model=None)
async def session_heartbeat(
    request: types.SessionHeartbeatRequest, engine: EngineDep
) -> types.SessionHeartbeatResponse | JSONResponse:
    """Keeps the session alive; 410 once it has finished (the SDK stops heartbeating on 410)."""
    check_id("session_id", request.session_id)
    if not engine.session_alive(request.session_id):
        return JSONResponse({"detail": f"session {request.session_id} has finished"}, status_code=410)
    return types.SessionHeartbeatResponse()


@router.post("/telemetry")
async def telemetry() -> types.TelemetryResponse:
    return types.TelemetryResponse(status="accepted")


@router.get("/get_server_capabilities")
async def server_capabilities(engine: EngineDep) -> types.GetServerCapabilitiesResponse:
    names = await run_in_threadpool(engine.supported_models)
    return types.GetServerCapabilitiesResponse(
        supported_models=[
            types.SupportedModel(model_name=name, trainable=True, sampleable=True) for name in names
        ]
    )


@router.get("/debug/stats")
async def debug_stats(engine: EngineDep) -> dict[str, int | dict[str, int]]:
    return engine.stats()


# ---- futures ----


@router.post("/retrieve_future")
async def retrieve_future(
    request: types.FutureRetrieveRequest, engine: EngineDep, http_request: Request
) -> Response:
    request_id = request.request_id

    async def disconnected() -> None:
        # The body is read: the next ASGI message is the disconnect (or the end of this response).
        while (await http_request.receive())["type"] != "http.disconnect":
            pass

    outcome = await engine.outcome(request_id, LONG_POLL_SECONDS, disconnected)
    if outcome is None:
        pending = TryAgainResponse(request_id=request_id, queue_state="active")
        return JSONResponse(pending.model_dump(mode="json"))
    return outcome_response(outcome)


# ---- training models ----


@router.post("/create_model")
async def create_model(request: types.CreateModelRequest, engine: EngineDep) -> types.UntypedAPIFuture:
    check_id("session_id", request.session_id)
    engine.require_open_session(request.session_id)
    optimizer = optimizer_family(request.optimizer_config) or ADAMW
    model_id = check_id("model_id", f"{request.session_id}:train:{request.model_seq_id}")
    base_model = request.base_model
    lora = request.lora_config or types.LoraConfig(rank=DEFAULT_LORA_RANK)
    spec = LoraSpec(
        rank=lora.rank,
        seed=secrets.randbelow(2**31) if lora.seed is None else lora.seed,
        train_mlp=lora.train_mlp,
        train_attn=lora.train_attn,
        train_unembed=lora.train_unembed,
        optimizer=optimizer,
    )
    metadata = str_metadata(request.user_metadata)
    resent = engine.resent_request(model_id, 0, "create_model")
    if resent is not None:
        return future(resent, model_id)
    if engine.is_live(model_id):
        return future(engine.failed_request(f"model {model_id} already exists"), model_id)

    def work() -> Answer:
        engine.create_model(model_id, base_model, spec, lora.seed, metadata)
        return types.CreateModelResponse(model_id=model_id)

    return future(engine.submit_training(model_id, 0, "create_model", work), model_id)


@router.post("/unload_model")
async def unload_model(request: types.UnloadModelRequest, engine: EngineDep) -> types.UntypedAPIFuture:
    """Free a training client's adapter and optimizer state (the service sends it when it drops one)."""
    model_id = request.model_id
    if not engine.is_live(model_id):
        return future(engine.failed_request(f"unknown model {model_id!r}"), model_id)
    return future(engine.queue_unload(model_id), model_id)


@router.post("/get_info")
async def get_info(request: types.GetInfoRequest, engine: EngineDep) -> types.GetInfoResponse:
    model_id = request.model_id
    if not engine.is_live(model_id):
        raise NotFound(f"unknown model {model_id!r}")
    run = engine.run(model_id)
    path = await run_in_threadpool(engine.resolve_model_dir, run.base_model)
    return types.GetInfoResponse(
        type="get_info",
        model_id=model_id,
        model_data=types.ModelData(arch="lora", model_name=run.base_model, tokenizer_id=str(path)),
        is_lora=True,
        lora_rank=run.lora_rank,
        model_name=run.base_model,
    )


# ---- training runs ----


def _training_run(run: RunRecord, checkpoints: list[CheckpointRecord]) -> types.TrainingRun:
    training = [c for c in checkpoints if c.kind == "training"]
    sampler = [c for c in checkpoints if c.kind == "sampler"]
    return types.TrainingRun(
        training_run_id=run.model_id,
        base_model=run.base_model,
        model_owner=LOCAL_USER_URN,
        is_lora=True,
        lora_rank=run.lora_rank,
        last_request_time=datetime.fromisoformat(run.last_request_time),
        last_checkpoint=sdk_checkpoint(training[-1]) if training else None,
        last_sampler_checkpoint=sdk_checkpoint(sampler[-1]) if sampler else None,
        user_metadata=run.user_metadata or None,
    )


@router.get("/training_runs")
async def list_training_runs(
    engine: EngineDep, limit: int = 20, offset: int = 0, project_id: str | None = None
) -> types.TrainingRunsResponse:
    """Newest first; with `project_id`, the runs of the sessions in that project (a copy's included)."""
    selected = page_bounds(limit, offset)
    runs = engine.runs()
    if project_id is not None:
        in_project = engine.records.sessions_in_project(check_id("project_id", project_id))
        runs = [run for run in runs if session_of(run.model_id) in in_project]
    return types.TrainingRunsResponse(
        training_runs=[_training_run(r, engine.checkpoints(r.model_id)) for r in runs[selected]],
        cursor=types.Cursor(offset=offset, limit=limit, total_count=len(runs)),
    )


@router.get("/training_runs/{model_id}")
async def get_training_run(model_id: str, engine: EngineDep) -> types.TrainingRun:
    return _training_run(engine.run(model_id), engine.checkpoints(model_id))
