"""The live run view: /runs lists the models; /runs/{model} draws a model's reward, loss, staleness and
throughput against policy version (a minibatched Train's minibatch losses inside its version), with the
versions that can still be sampled and its checkpoints, and follows the run live: its script opens
/runs/{model}/events, server-sent events the sidecar relays from WatchModel, and redraws without
reloading. Everything is served from the package (uPlot, MIT, vendored in static/), so offline machines
see it whole.

Access: with a sidecar API key, every /runs page and data route needs it, like /v1: as
`Authorization: Bearer <key>`, or in the `tinkerrpc_runs_key` cookie, which a browser gets by opening
/runs?key=<key> once (HttpOnly, SameSite=Strict, Path=/runs; the answer redirects to the address without
the key). Only the static files (public code) are served without it."""

from __future__ import annotations

import asyncio
import hmac
import html
import json
import math
import re
from collections.abc import AsyncIterator, Callable
from pathlib import Path
from typing import Any
from urllib.parse import quote

from fastapi import APIRouter, Request, Response
from fastapi.responses import FileResponse, HTMLResponse, JSONResponse, RedirectResponse, StreamingResponse

from tinkerrpc import AsyncClient, CheckpointInfo, ModelEvent, ModelInfo, NotFoundError, RPCError, RunStep
from tinkerrpc.contract.limits import MISMATCH_RATIO_MAX, MISMATCH_RATIO_MIN
from tinkerrpc_server.sidecar.errors import OpenAIError
from tinkerrpc_server.sidecar.streaming import SSE_MEDIA_TYPE, sse_frame

STATIC_DIR = Path(__file__).parent / "static"
STATIC_FILES = {
    "uPlot.iife.min.js": "text/javascript",
    "uPlot.min.css": "text/css",
    "uPlot.LICENSE": "text/plain",
    "run.js": "text/javascript",
    "runs.css": "text/css",
}
KEY_COOKIE = "tinkerrpc_runs_key"
HISTORY_PAGE_SIZE = 1000
# A comment line this often keeps an idle event stream open through proxies and shows a dead peer.
KEEPALIVE_SECONDS = 15.0
# The largest version WatchModel takes (its from_version is an int64).
MAX_VERSION = 2**63 - 1
# A version as the event stream's parameters spell it: ASCII digits, no sign, at most int64's 19.
_VERSION_TEXT = re.compile(r"[0-9]{1,19}")
_FLAGS = {"true": True, "1": True, "false": False, "0": False}
# How much of a refused value an error message repeats.
_SHOWN_CHARS = 40


def _finite(value: float) -> float | None:
    return value if math.isfinite(value) else None


def step_json(step: RunStep) -> dict[str, Any]:
    metrics = step.metrics
    mismatch = metrics.sampler_mismatch  # None for supervised steps: no point on the mismatch chart
    return {
        "v": step.policy_version,
        "reward": _finite(metrics.mean_reward),
        "std": _finite(metrics.std_reward),
        "loss": _finite(metrics.loss),
        # A minibatched supervised Train: each minibatch's loss in order (loss is their sum); else empty.
        "minibatch_losses": [_finite(loss) for loss in metrics.minibatch_losses],
        "lr": metrics.learning_rate,
        "tokens": metrics.total_tokens,
        "trained_tokens": metrics.trained_tokens,
        "tps": _finite(metrics.tokens_per_second),
        "seconds": _finite(metrics.step_seconds),
        "used": metrics.trajectories_used,
        "dropped_stale": metrics.dropped_stale,
        "dropped_zero_variance": metrics.dropped_zero_variance,
        "staleness": {str(k): n for k, n in sorted(metrics.staleness_histogram.items())},
        "kl": _finite(mismatch.kl) if mismatch else None,
        "ratio_outside": mismatch.outside_fraction if mismatch else None,
        "time": step.commit_time.isoformat() if step.commit_time else None,
        "checkpoints": [c.name for c in step.checkpoints],
    }


def checkpoint_json(checkpoint: CheckpointInfo) -> dict[str, Any]:
    return {
        "name": checkpoint.name,
        "kind": checkpoint.kind,
        "v": checkpoint.policy_version,
        "automatic": checkpoint.automatic,
        "time": checkpoint.create_time.isoformat() if checkpoint.create_time else None,
    }


def model_json(info: ModelInfo) -> dict[str, Any]:
    return {
        "name": info.name,
        "base_model": info.base_model,
        "renderer": info.renderer,
        "lora_rank": info.lora_rank,
        "policy_version": info.policy_version,
        "sampleable_versions": list(info.sampleable_versions),
    }


def event_json(event: ModelEvent) -> dict[str, Any]:
    return {
        "kind": event.kind,
        "policy_version": event.policy_version,
        "replayed": event.replayed,
        "step": step_json(event.step) if event.step is not None else None,
        "checkpoint": checkpoint_json(event.checkpoint) if event.checkpoint is not None else None,
    }


def _page(title: str, body: str) -> str:
    return (
        "<!doctype html>\n<html lang=en><head><meta charset=utf-8>"
        '<meta name=viewport content="width=device-width, initial-scale=1">'
        f"<title>{html.escape(title)}</title>"
        '<link rel=stylesheet href="/runs/static/uPlot.min.css">'
        '<link rel=stylesheet href="/runs/static/runs.css"></head>'
        f"<body>{body}</body></html>\n"
    )


def _shown(text: str) -> str:
    if len(text) <= _SHOWN_CHARS:
        return repr(text)
    return f"{text[:_SHOWN_CHARS]!r}... ({len(text)} characters)"


def _version(text: str, field: str, highest: int, meaning: str) -> int:
    """`text` as a version from 0 to `highest`; a 400 naming `field` otherwise."""
    value = int(text) if _VERSION_TEXT.fullmatch(text) else None
    if value is None or value > highest:
        raise OpenAIError(
            400,
            f"{field} must be {meaning}: a whole number from 0 to {highest}, not {_shown(text)}",
            param=field,
        )
    return value


def _flag(text: str, field: str) -> bool:
    """A query flag: true or false (1 or 0); a 400 naming `field` otherwise."""
    value = _FLAGS.get(text.lower())
    if value is None:
        raise OpenAIError(400, f"{field} must be true or false, not {_shown(text)}", param=field)
    return value


def resume_version(from_version: str | None, last_event_id: str | None) -> int | None:
    """Where an event stream starts: after the Last-Event-ID a reconnecting EventSource sends (an event's
    id is the model's version after it), else at from_version; None: live events only. Either one that
    is not a version WatchModel can take is a 400 naming it."""
    start = None
    if from_version is not None:
        start = _version(from_version, "from_version", MAX_VERSION, "a policy version")
    if last_event_id:
        last = _version(
            last_event_id.strip(), "Last-Event-ID", MAX_VERSION - 1, "the id of an event of this stream"
        )
        start = last + 1
    return start


def _unauthorized() -> HTMLResponse:
    body = (
        "<main><h1>tinkerrpc runs</h1><p>This sidecar needs its API key: open "
        "<code>/runs?key=&lt;key&gt;</code> once (it is kept in a cookie for /runs), or send "
        "<code>Authorization: Bearer &lt;key&gt;</code>.</p></main>"
    )
    return HTMLResponse(_page("API key needed", body), status_code=401)


def create_router(client: Callable[[], AsyncClient], api_key: str | None) -> APIRouter:
    """The /runs routes over the sidecar's client; `api_key` as the sidecar's (None: open)."""
    router = APIRouter()
    expected = api_key.encode() if api_key is not None else None

    def given_keys(request: Request) -> list[str]:
        header = request.headers.get("authorization", "")
        return [
            header.removeprefix("Bearer ") if header.startswith("Bearer ") else "",
            request.cookies.get(KEY_COOKIE, ""),
            request.query_params.get("key", ""),
        ]

    def authorized(request: Request) -> bool:
        # Constant-time comparisons; the key itself is never logged.
        return expected is None or any(
            hmac.compare_digest(key.encode(), expected) for key in given_keys(request) if key
        )

    def remember_key(request: Request) -> Response | None:
        """A page opened with ?key=: set the cookie and send the browser to the address without it."""
        if api_key is None or "key" not in request.query_params:
            return None
        response = RedirectResponse(request.url.path, status_code=303)
        response.set_cookie(KEY_COOKIE, api_key, httponly=True, samesite="strict", path="/runs")
        return response

    async def history(name: str) -> list[RunStep]:
        model = client().model(name)
        steps: list[RunStep] = []
        token: str | None = None
        while True:
            page = await model.history(page_size=HISTORY_PAGE_SIZE, page_token=token)
            steps.extend(page.steps)
            token = page.next_page_token
            if token is None:
                return steps

    @router.get("/runs/static/{file_name}")
    async def static(file_name: str) -> Response:
        media_type = STATIC_FILES.get(file_name)
        if media_type is None:
            return Response("not found", status_code=404, media_type="text/plain")
        # Revalidated on every load (a 304 while unchanged): a browser that cached the page's script from
        # an older tinkerrpc would otherwise run it against this one's state.
        return FileResponse(
            STATIC_DIR / file_name, media_type=media_type, headers={"Cache-Control": "no-cache"}
        )

    @router.get("/runs", response_model=None)
    async def runs(request: Request) -> Response:
        if not authorized(request):
            return _unauthorized()
        redirect = remember_key(request)
        if redirect is not None:
            return redirect
        try:
            models = await client().list_models()
        except RPCError as error:
            return HTMLResponse(
                _page("tinkerrpc runs", f"<main><p>{html.escape(str(error))}</p></main>"), 503
            )
        rows = "".join(
            f'<tr><td><a href="/runs/{quote(m.name)}">{html.escape(m.name)}</a></td>'
            f"<td>{html.escape(m.base_model)}</td><td>{m.policy_version}</td>"
            f"<td>{len(m.sampleable_versions)}</td></tr>"
            for m in models
        )
        body = (
            "<main><h1>tinkerrpc runs</h1><table id=models><thead><tr><th>model</th><th>base model</th>"
            f"<th>policy version</th><th>sampleable versions</th></tr></thead><tbody>{rows}</tbody></table>"
            f"{'' if models else '<p>No models yet.</p>'}</main>"
        )
        return HTMLResponse(_page("tinkerrpc runs", body))

    @router.get("/runs/{name}", response_model=None)
    async def run_page(request: Request, name: str) -> Response:
        if not authorized(request):
            return _unauthorized()
        redirect = remember_key(request)
        if redirect is not None:
            return redirect
        try:
            info = await client().get_model(name)
        except NotFoundError:
            return HTMLResponse(_page("not found", "<main><p>No such model.</p></main>"), 404)
        except RPCError as error:
            return HTMLResponse(_page(name, f"<main><p>{html.escape(str(error))}</p></main>"), 503)
        body = (
            f'<main id=run data-model="{html.escape(info.name)}" data-latest-version="" data-points="0" '
            'data-stream="connecting">'
            f'<p><a href="/runs">runs</a></p><h1>{html.escape(info.name)}</h1>'
            "<p id=summary></p><p id=status></p>"
            "<section class=charts><div id=chart-reward></div><div id=chart-loss></div>"
            "<div id=chart-staleness></div><div id=chart-throughput></div><div id=chart-mismatch></div>"
            "</section>"
            "<section><h2>Sampleable versions</h2><p id=sampleable></p></section>"
            "<section><h2>Checkpoints</h2><table id=checkpoints><thead><tr><th>name</th><th>kind</th>"
            "<th>version</th><th>made</th></tr></thead><tbody></tbody></table></section></main>"
            '<script src="/runs/static/uPlot.iife.min.js"></script><script src="/runs/static/run.js"></script>'
        )
        return HTMLResponse(_page(f"{info.name} - tinkerrpc run", body))

    def refuse_without_key(request: Request) -> None:
        if not authorized(request):
            raise OpenAIError(
                401,
                "the run view needs the sidecar's API key: `Authorization: Bearer <key>`, or open "
                "/runs?key=<key> once",
                code="invalid_api_key",
                error_type="authentication_error",
            )

    @router.get("/runs/{name}/state", response_model=None)
    async def run_state(request: Request, name: str, steps: str = "true") -> Response:
        """The model, its checkpoints and (unless steps=false) its whole history."""
        refuse_without_key(request)
        with_steps = _flag(steps, "steps")
        try:
            info = await client().get_model(name)
            checkpoints = await client().model(name).checkpoints()
            history_steps = await history(name) if with_steps else []
        except NotFoundError:
            raise OpenAIError(404, f"no model named {_shown(name)}", code="not_found") from None
        except RPCError as error:
            raise OpenAIError(503, str(error), error_type="service_unavailable", should_retry=True) from None
        return JSONResponse(
            {
                "model": model_json(info),
                "checkpoints": [checkpoint_json(c) for c in checkpoints],
                "steps": [step_json(s) for s in history_steps],
                # What a step's ratio_outside counts as outside: the view names the bounds.
                "mismatch_ratio_bounds": [MISMATCH_RATIO_MIN, MISMATCH_RATIO_MAX],
            }
        )

    @router.get("/runs/{name}/events", response_model=None)
    async def run_events(request: Request, name: str, from_version: str | None = None) -> Response:
        """Server-sent events from WatchModel, from `from_version` on (see resume_version)."""
        refuse_without_key(request)
        start = resume_version(from_version, request.headers.get("last-event-id"))
        return StreamingResponse(
            _relay(client(), name, start),
            media_type=SSE_MEDIA_TYPE,
            headers={"cache-control": "no-store"},
        )

    return router


async def _relay(client: AsyncClient, name: str, from_version: int | None) -> AsyncIterator[str]:
    yield ": watching\n\n"  # the browser sees the stream open at once
    try:
        async with client.model(name).watch(from_version=from_version) as events:

            async def next_event() -> ModelEvent | None:
                return await anext(events, None)

            pending = asyncio.ensure_future(next_event())
            try:
                while True:
                    done, _ = await asyncio.wait({pending}, timeout=KEEPALIVE_SECONDS)
                    if not done:
                        yield ": keepalive\n\n"
                        continue
                    event = pending.result()
                    if event is None:
                        return
                    yield sse_frame(json.dumps(event_json(event)), event.kind, event.policy_version)
                    pending = asyncio.ensure_future(next_event())
            finally:
                pending.cancel()
    except NotFoundError:
        yield sse_frame(json.dumps({"model": name}), "deleted")
    except RPCError as error:
        yield sse_frame(json.dumps({"error": str(error)}), "failed")
