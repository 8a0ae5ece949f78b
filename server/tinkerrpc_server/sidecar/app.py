"""The OpenAI-compatible HTTP sidecar: FastAPI in front of the tinkerrpc gRPC server.

The app itself holds what every route shares: the API key check, request metrics, the error handlers,
GET /health and GET /metrics, and the one Sample call the endpoint routers (models, chat, completions,
responses, generate, runs) are given. It reaches the server only through the SDK's `tinkerrpc.AsyncClient`;
every gRPC failure is translated to HTTP in `errors.from_rpc_error`.
"""

from __future__ import annotations

import asyncio
import hmac
import logging
import socket
import time
from collections.abc import AsyncIterator, Awaitable, Callable
from contextlib import asynccontextmanager
from dataclasses import dataclass

import grpc
import uvicorn
from fastapi import FastAPI, Request, Response
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, PlainTextResponse
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.requests import ClientDisconnect
from starlette.routing import BaseRoute, Match

from tinkerrpc import AsyncClient, ModelInfo, RetryPolicy, RPCError, Sample, SampleChunk, SamplingOptions
from tinkerrpc_server.processes.http_serving import (
    SHARED,
    bound_port,
    serve_until_signalled,
    serve_until_stopped,
)
from tinkerrpc_server.sidecar import chat, completions, generate, models, responses
from tinkerrpc_server.sidecar.coalescing import SampleCoalescer
from tinkerrpc_server.sidecar.errors import OpenAIError, from_rpc_error, param_from_loc
from tinkerrpc_server.sidecar.metrics import SidecarMetrics
from tinkerrpc_server.sidecar.runs import routes as run_view
from tinkerrpc_server.sidecar.sample_output import usage_of
from tinkerrpc_server.sidecar.sample_streams import OpenedStream
from tinkerrpc_server.sidecar.sampling_args import Prompt

log = logging.getLogger("tinkerrpc.sidecar")

# Named in the 404 of any other path, so a client built for another API sees what is served here.
ENDPOINTS = (
    "GET /v1/models",
    "GET /v1/models/{model}",
    "POST /v1/chat/completions",
    "POST /v1/completions",
    "POST /v1/responses",
    "POST /inference/v1/generate",
    "GET /health",
    "GET /metrics",
    "GET /runs",
    "GET /runs/{model}",
)

# Paths that need the API key (the run view checks its own, cookie included); /health and /metrics do not.
KEYED_PATHS = ("/v1/", "/inference/")

# The status of a request whose client left before it was read (nginx's); no one receives it.
CLIENT_CLOSED_REQUEST = 499

# An HTTP caller is waiting: give up on an unreachable server after a short backoff and answer 503
# (with x-should-retry) instead of holding the request for the SDK's default minute.
SIDECAR_RETRY = RetryPolicy(max_attempts=3, initial_backoff=0.1, max_backoff=0.5, total_timeout=2.0)
HEALTH_TIMEOUT_SECONDS = 2.0


@dataclass(frozen=True)
class GrpcUpstream:
    """How the sidecar reaches the tinkerrpc gRPC server: its address, the bearer token it forwards, and
    for a TLS server the PEM roots that verify its certificate and, when the certificate does not name
    the target's host, the name it carries."""

    target: str
    token: str | None = None
    tls_roots: bytes | None = None
    tls_server_name: str | None = None

    def client(self) -> AsyncClient:
        tls = grpc.ssl_channel_credentials(self.tls_roots) if self.tls_roots is not None else False
        # No health check at start: the sidecar comes up (and answers 503) while the server is down.
        return AsyncClient(
            self.target,
            self.token,
            tls,
            tls_server_name=self.tls_server_name,
            check_health=False,
            retry=SIDECAR_RETRY,
        )

    def describe(self) -> str:
        return f"{self.target} ({'TLS' if self.tls_roots is not None else 'plaintext'})"


def _validation_error(error: RequestValidationError) -> OpenAIError:
    first = error.errors()[0] if error.errors() else {}
    loc = tuple(first.get("loc", ()))
    param = param_from_loc(loc)
    if first.get("type") == "extra_forbidden":
        return OpenAIError(400, f"Unrecognized request argument supplied: {param}", param=param)
    if first.get("type") == "json_invalid":
        return OpenAIError(400, "The request body is not valid JSON", param=None)
    detail = str(first.get("msg", "invalid request"))
    return OpenAIError(400, f"Invalid value for {param}: {detail}" if param else detail, param=param)


def _route_label(routes: list[BaseRoute], request: Request) -> str:
    """The matched route's template (bounded label values); requests refused before routing are matched
    here, against every route of the app and of its endpoint routers."""
    route = request.scope.get("route") or next(
        (r for r in routes if r.matches(request.scope)[0] == Match.FULL), None
    )
    return str(getattr(route, "path", "unmatched"))


def create_app(upstream: GrpcUpstream, api_key: str | None) -> FastAPI:
    """The sidecar app; it connects to the gRPC server `upstream` when it starts serving."""
    if api_key is not None and not api_key:
        raise ValueError("api_key must be None (no auth) or a non-empty string")
    metrics = SidecarMetrics()
    clients: list[AsyncClient] = []
    # Filled once the routers are made below; the middleware reads it per request.
    labelled_routes: list[BaseRoute] = []

    @asynccontextmanager
    async def lifespan(_: FastAPI) -> AsyncIterator[None]:
        # grpc.aio channels bind to the running loop, so the client is made here, not at import.
        client = upstream.client()
        clients.append(client)
        try:
            yield
        finally:
            clients.clear()
            await client.close()

    app = FastAPI(
        title="tinkerrpc OpenAI-compatible sidecar", lifespan=lifespan, docs_url=None, redoc_url=None
    )
    expected_auth = f"Bearer {api_key}".encode() if api_key is not None else None

    def client() -> AsyncClient:
        if not clients:
            raise OpenAIError(
                503, "the sidecar is not started", error_type="service_unavailable", should_retry=True
            )
        return clients[0]

    @app.middleware("http")
    async def authenticate_and_measure(
        request: Request, call_next: Callable[[Request], Awaitable[Response]]
    ) -> Response:
        started = time.perf_counter()
        if expected_auth is not None and request.url.path.startswith(KEYED_PATHS):
            given = request.headers.get("authorization", "").encode()
            # Constant-time comparison; the key itself is never logged.
            if not hmac.compare_digest(given, expected_auth):
                response: Response = OpenAIError(
                    401,
                    "Incorrect or missing API key: send `Authorization: Bearer <key>`",
                    code="invalid_api_key",
                    error_type="authentication_error",
                ).to_response()
            else:
                response = await call_next(request)
        else:
            response = await call_next(request)
        route_path = _route_label(labelled_routes, request)
        metrics.requests.labels(route_path, str(response.status_code)).inc()
        metrics.latency.labels(route_path).observe(time.perf_counter() - started)
        if response.status_code >= 400:
            metrics.errors.labels(str(response.status_code)).inc()
        return response

    @app.exception_handler(OpenAIError)
    async def openai_error(_: Request, error: OpenAIError) -> JSONResponse:
        return error.to_response()

    @app.exception_handler(RequestValidationError)
    async def validation_error(_: Request, error: RequestValidationError) -> JSONResponse:
        return _validation_error(error).to_response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        if error.status_code == 404:
            message = (
                f"{request.method} {request.url.path} is not served by the tinkerrpc sidecar; "
                f"it serves {', '.join(ENDPOINTS)}"
            )
            return OpenAIError(404, message, code="not_found").to_response()
        return OpenAIError(error.status_code, str(error.detail)).to_response()

    @app.exception_handler(ClientDisconnect)
    async def client_gone(request: Request, _: ClientDisconnect) -> Response:
        # An ordinary event (a timeout, a cancelled agent step): nobody reads the answer, and it is no
        # server error. 499 is nginx's "client closed request", so the metrics show it apart.
        log.info("client disconnected before the request was read: %s %s", request.method, request.url.path)
        return Response(status_code=CLIENT_CLOSED_REQUEST)

    @app.exception_handler(Exception)
    async def unexpected_error(_: Request, error: Exception) -> JSONResponse:
        log.exception("unexpected sidecar error")
        return OpenAIError(
            500, f"internal error: {type(error).__name__}", error_type="server_error"
        ).to_response()

    async def upstream_sample(name: str, prompt: Prompt, args: SamplingOptions) -> list[Sample]:
        return await client().model(name).sample(prompt, options=args)

    coalescer = SampleCoalescer(upstream_sample, metrics.coalesced_requests.inc)

    async def sample(route: str, ref: models.ModelRef, prompt: Prompt, args: SamplingOptions) -> list[Sample]:
        try:
            samples = await coalescer.sample(ref.name, prompt, args)
        except RPCError as error:
            raise from_rpc_error(error, ref.requested) from error
        except ValueError as error:
            # The SDK refuses some requests before any network call.
            raise OpenAIError(400, str(error)) from error
        usage = usage_of(samples)
        metrics.generated_tokens.labels(route).inc(usage.completion_tokens)
        metrics.prompt_tokens.labels(route).inc(usage.prompt_tokens)
        return samples

    async def stream(route: str, ref: models.ModelRef, prompt: Prompt, args: SamplingOptions) -> OpenedStream:
        events = client().model(ref.name).sample_stream(prompt, args)
        try:
            head = await anext(events)
        except RPCError as error:
            await events.close()
            raise from_rpc_error(error, ref.requested) from error
        except ValueError as error:
            await events.close()
            raise OpenAIError(400, str(error)) from error

        async def counted() -> AsyncIterator[SampleChunk]:
            async for chunk in events:
                if chunk.samples is not None:
                    usage = usage_of(chunk.samples)
                    metrics.generated_tokens.labels(route).inc(usage.completion_tokens)
                    metrics.prompt_tokens.labels(route).inc(usage.prompt_tokens)
                yield chunk

        return OpenedStream(head, counted(), events.close)

    async def fetch_models() -> list[ModelInfo]:
        try:
            return await client().list_models()
        except RPCError as error:
            raise from_rpc_error(error, "") from error

    @app.get("/health")
    async def health() -> JSONResponse:
        try:
            await client().wait_until_serving(HEALTH_TIMEOUT_SECONDS)
            # Health checking needs no token: an authenticated call shows the server takes ours.
            await client().list_models(timeout=HEALTH_TIMEOUT_SECONDS)
        except RPCError as error:
            return JSONResponse(
                {"status": "unavailable", "reason": error.code.name, "detail": str(error)}, status_code=503
            )
        except OpenAIError as error:
            return JSONResponse({"status": "unavailable", "detail": error.message}, status_code=503)
        return JSONResponse({"status": "ok"})

    @app.get("/metrics")
    async def prometheus_metrics() -> PlainTextResponse:
        return PlainTextResponse(metrics.render(), media_type=SidecarMetrics.CONTENT_TYPE)

    routers = (
        models.create_router(fetch_models),
        chat.create_router(sample, stream),
        completions.create_router(sample, stream),
        responses.create_router(sample, stream),
        generate.create_router(sample, stream),
        run_view.create_router(client, api_key),
    )
    # An included router is matched as a whole, without a template; its own routes carry theirs.
    labelled_routes.extend(app.router.routes)
    for router in routers:
        app.include_router(router)
        labelled_routes.extend(router.routes)
    return app


def _uvicorn_config(app: FastAPI) -> uvicorn.Config:
    return uvicorn.Config(app, log_level="warning", access_log=False, lifespan="on")


def _log_start(upstream: GrpcUpstream, sock: socket.socket, api_key: str | None) -> None:
    host = sock.getsockname()[0]
    log.info(
        "OpenAI sidecar on http://%s:%d/v1 (%s) for gRPC %s",
        f"[{host}]" if ":" in host else host,
        bound_port(sock),
        "API key required" if api_key is not None else "no API key",
        upstream.describe(),
    )


def run_sidecar(
    upstream: GrpcUpstream,
    sock: socket.socket,
    api_key: str | None,
    on_serving: Callable[[], None] | None = None,
) -> None:
    """Serve the sidecar on the listening socket `sock` until SIGTERM/SIGINT, then return after a
    graceful shutdown; `on_serving` runs once requests get answers."""
    app = create_app(upstream, api_key)
    _log_start(upstream, sock, api_key)
    serve_until_signalled(_uvicorn_config(app), sock, SHARED, on_serving)


async def serve_sidecar(
    upstream: GrpcUpstream, sock: socket.socket, api_key: str | None, stop: asyncio.Event
) -> None:
    """Serve the sidecar on `sock` on the running loop until `stop` is set (for `tinkerrpc serve
    --sidecar-port`)."""
    app = create_app(upstream, api_key)
    _log_start(upstream, sock, api_key)
    await serve_until_stopped(_uvicorn_config(app), sock, SHARED, stop)
