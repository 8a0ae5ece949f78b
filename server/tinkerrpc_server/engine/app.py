"""The embedded engine's HTTP service: Tinker's own API on loopback, so the unmodified `tinker` SDK works.

Routes live under /api/v1, one router per family in engine/routes/ (models, training, sampling,
weights); bodies are the SDK's own `tinker.types`. Operations (create_model, forward_backward,
optim_step, save/load weights, asample) answer `{request_id, model_id?}` at once and run on the single
compute worker; clients long-poll `retrieve_future` for the outcome. Everything else answers directly.
"""

from __future__ import annotations

import gc
import logging
import os
import socket
from collections.abc import AsyncIterator, Callable, Sequence
from contextlib import asynccontextmanager
from dataclasses import replace
from typing import Any

import torch
import uvicorn
from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse

from tinkerrpc_server.engine import protocol
from tinkerrpc_server.engine.auth import API_KEY_HEADER, ApiKeyMiddleware
from tinkerrpc_server.engine.compute.execution_plan import choose_execution_plan
from tinkerrpc_server.engine.config import EngineConfig
from tinkerrpc_server.engine.core import Engine, NotFound
from tinkerrpc_server.engine.request_log import RequestLog, RequestLogMiddleware
from tinkerrpc_server.engine.routes import (
    admin,
    auth_token,
    models,
    sampling,
    sessions,
    sharing,
    streaming,
    training,
    weights,
)
from tinkerrpc_server.engine.routes.common import future
from tinkerrpc_server.engine.signed_urls import Forbidden
from tinkerrpc_server.engine.storage import ConflictError, InvalidNameError, UnknownPathError
from tinkerrpc_server.engine.token_streams import StreamSlots
from tinkerrpc_server.engine.tokens import TokenIssuer
from tinkerrpc_server.engine.worker import in_passing_thread
from tinkerrpc_server.model_store import UnknownBaseModelError, prepare_builtin_models
from tinkerrpc_server.processes.http_serving import OWNER_ONLY, bound_port, serve_until_signalled

log = logging.getLogger("tinkerrpc.engine")

_STATUS_OF_ERROR: dict[type[Exception], int] = {
    NotFound: 404,
    Forbidden: 403,
    UnknownPathError: 404,
    # Not Tinker's 409: the SDK retries every 409 for 5 minutes (a lock timeout to it), so a repeated
    # publish or a taken copy slot would stall that long before failing. A 400 fails at once.
    ConflictError: 400,
    InvalidNameError: 400,
    protocol.BadRequest: 400,
    UnknownBaseModelError: 400,
}


def describe_invalid_body(errors: Sequence[Any]) -> str:
    """One line naming every invalid field of a request body, e.g. `adam_params.learning_rate: ...`."""
    parts = []
    for error in errors:
        where = ".".join(str(part) for part in error["loc"] if part != "body")
        parts.append(f"{where}: {error['msg']}" if where else str(error["msg"]))
    return "invalid request: " + "; ".join(parts)


def create_app(config: EngineConfig) -> FastAPI:
    """The engine's app; with `config.api_key`, every request but the health check and signed downloads
    needs it (engine.auth), without one the engine serves anyone who reaches its port."""
    engine = Engine(config)

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        yield
        engine.close()

    app = FastAPI(title="tinkerrpc embedded engine", lifespan=lifespan)
    app.state.engine = engine
    app.state.token_streams = StreamSlots()
    app.state.request_log = RequestLog()
    app.state.tokens = TokenIssuer()
    if config.api_key is not None:
        app.add_middleware(ApiKeyMiddleware, api_key=config.api_key, tokens=app.state.tokens)
    # Added last, so outermost: the requests refused for their key are logged too.
    app.add_middleware(RequestLogMiddleware, log=app.state.request_log, credential_header=API_KEY_HEADER)

    async def known_error(_: Request, exc: Exception) -> JSONResponse:
        status = next(code for error, code in _STATUS_OF_ERROR.items() if isinstance(exc, error))
        return JSONResponse({"detail": str(exc)}, status_code=status)

    for error in _STATUS_OF_ERROR:
        app.add_exception_handler(error, known_error)

    @app.exception_handler(RequestValidationError)
    async def invalid_body(request: Request, exc: RequestValidationError) -> JSONResponse:
        message = describe_invalid_body(exc.errors())
        body = exc.body
        if isinstance(body, dict):
            model_id, seq_id = body.get("model_id"), body.get("seq_id")
            if isinstance(model_id, str) and isinstance(seq_id, int) and engine.is_live(model_id):
                # A request of a model's numbered sequence fails in its turn, so the model's next
                # requests do not wait for a seq_id that never runs.
                name = request.url.path.rsplit("/", 1)[-1]
                request_id = engine.reject_in_turn(model_id, seq_id, name, message)
                return JSONResponse(future(request_id, model_id).model_dump(mode="json"))
        return JSONResponse({"detail": message}, status_code=400)

    # sharing before weights: its publish routes must match before weights' `{checkpoint_id:path}` ones.
    for family in (sharing, sessions, auth_token, admin, models, training, sampling, streaming, weights):
        app.include_router(family.router)
    return app


def prepare_engine_process(config: EngineConfig) -> EngineConfig:
    """The process's setup before serving, on its main thread: `config` with the torch threads the
    compute thread will use. Whatever runs torch's parallel ops here runs in a passing thread, so that
    the compute thread's OpenMP team stays the process's only one (see engine/worker.py)."""
    # The compute thread takes the threads this process has; this thread, which serves HTTP, keeps one.
    if config.torch_threads is None:
        config = replace(config, torch_threads=torch.get_num_threads())
    # Before serving: once the engine answers, clients can load the built-in models by name, and the
    # first sample does not wait for the CPU kernels to build. The plan chosen here is the one every
    # runtime of this process hands its decoders.
    in_passing_thread(lambda: prepare_builtin_models(config.model_dir))
    # Choosing the plan times the packed kernels with parallel ops.
    in_passing_thread(lambda: choose_execution_plan(config.kernels))
    torch.set_num_threads(1)
    torch.get_num_threads()  # pins it for this thread (see ComputeWorker._loop)
    return config


def serve_engine(sock: socket.socket, config: EngineConfig, on_serving: Callable[[], None]) -> None:
    """Serve the engine on the listening socket `sock` until SIGTERM/SIGINT, then return normally.
    `on_serving` runs once the app is built and the signals are handled (requests then get answers).
    Started by engine.main.engine_main, after its checks."""
    # Everything the engine writes (weights, optimizer state, its index) is its owner's alone.
    os.umask(0o077)
    config = prepare_engine_process(config)
    app = create_app(config)
    host = sock.getsockname()[0]
    log.info(
        "engine on http://%s:%d (data %s, models %s, %s)",
        f"[{host}]" if ":" in host else host,
        bound_port(sock),
        config.data_dir,
        config.model_dir,
        "X-API-Key required" if config.api_key is not None else "NO AUTHENTICATION",
    )
    # No access log: clients long-poll retrieve_future; the worker logs one line per operation.
    server = uvicorn.Config(app, access_log=False, log_level="warning", timeout_graceful_shutdown=3)
    # The imports (torch, transformers, peft) leave millions of long-lived objects: freezing them keeps
    # every garbage collection, and the final one at exit (3+ s otherwise), from walking them.
    gc.freeze()
    serve_until_signalled(server, sock, OWNER_ONLY, on_serving)
