"""A Tinker-compatible HTTP backend that is not our engine: the least of Tinker's API that the unmodified
tinker SDK and `tinkerrpc serve --tinker-url` need, with trivial compute, as an executable form of the
contract in docs/tinker_parity.md ("What `serve --tinker-url` needs from a backend").

Served: GET healthz; POST create_session (the SDK opens a session whenever a ServiceClient is made, so it
cannot be left out); create_model and get_info (the SDK reads a new training client's info);
forward_backward (protobuf in, protobuf out: per-token `logprobs` in loss_fn_outputs, no metrics, so no
`loss:sum`); optim_step; save_weights and save_weights_for_sampler (named only); create_sampling_session
and GET samplers/{id} (the SDK asks for the base model of a sampler made from a path); asample (with
sample_sequence_ids); retrieve_future; the run's checkpoint listing (no size_bytes) and deletion.

Left out, so answered 404: save_weights_external and external_weights_urls, load_weights, unload_model,
every other session route (session_heartbeat, sessions/{id}/finish: the SDK only logs their failures),
client/config and client/dynamic_config (the SDK falls back to its defaults), telemetry, capabilities.

The compute: every logprob is LOGPROB, every sampled token is SAMPLED_TOKEN (until max_tokens), and a
model's "weights" are the number of optim_steps applied to it. Every future is complete when made.
Requests without the key (X-API-Key) get 401."""

from __future__ import annotations

import itertools
import math
import threading
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from datetime import datetime, timezone
from typing import Any

import numpy as np
import uvicorn
from fastapi import FastAPI, HTTPException, Request
from fastapi.responses import JSONResponse, Response
from pydantic import BaseModel
from starlette.middleware.base import BaseHTTPMiddleware, RequestResponseEndpoint
from tinker import types
from tinker.proto import tinker_public_pb2 as pb

API_KEY = "tml-fake-tinker-key"
# What the fake's forward pass gives every token, and its sampler every sampled and prompt token.
LOGPROB = -0.5
SAMPLED_TOKEN = 100
PROTOBUF = "application/x-protobuf"


@dataclass
class FakeTinkerState:
    """What the backend holds; tests read it to see what reached the backend."""

    models: dict[str, str] = field(default_factory=dict)  # model id -> base model
    optim_steps: dict[str, int] = field(default_factory=dict)
    checkpoints: dict[str, dict[str, types.Checkpoint]] = field(default_factory=dict)  # run -> id -> row
    samplers: dict[str, tuple[str, str | None]] = field(default_factory=dict)  # id -> base, path
    # A future's answer: JSON for most, protobuf bytes for forward_backward and asample.
    futures: dict[str, dict[str, Any] | bytes] = field(default_factory=dict)
    forward_backward_losses: list[str] = field(default_factory=list)
    routes_missed: list[str] = field(default_factory=list)
    _numbers: Iterator[int] = field(default_factory=lambda: itertools.count(1))

    def done(self, answer: dict[str, Any] | bytes, model_id: str | None = None) -> dict[str, Any]:
        request_id = f"req-{next(self._numbers)}"
        self.futures[request_id] = answer
        return types.UntypedAPIFuture(request_id=request_id, model_id=model_id).model_dump(mode="json")


def _json(value: BaseModel) -> dict[str, Any]:
    return value.model_dump(mode="json", exclude_none=True)


def _failed(message: str) -> dict[str, Any]:
    return _json(types.RequestFailedResponse(error=message, category=types.RequestErrorCategory.User))


def _tokens(model_input: Any) -> int:
    return sum(len(chunk.encoded_text.tokens) // 4 for chunk in model_input)  # int32 tokens


def build_app(state: FakeTinkerState) -> FastAPI:
    app = FastAPI()

    async def check_key(request: Request, call_next: RequestResponseEndpoint) -> Response:
        if request.headers.get("x-api-key") != API_KEY:
            return JSONResponse({"detail": "invalid API key"}, status_code=401)
        response = await call_next(request)
        if response.status_code == 404 and request.url.path not in state.routes_missed:
            state.routes_missed.append(request.url.path)
        return response

    app.add_middleware(BaseHTTPMiddleware, dispatch=check_key)

    @app.get("/api/v1/healthz")
    async def healthz() -> dict[str, Any]:
        return _json(types.HealthResponse(status="ok"))

    @app.post("/api/v1/client/config")
    async def client_config() -> dict[str, Any]:
        # The SDK will not start without it. Plain httpx and uncompressed forward_backward bodies.
        return _json(types.ClientConfigResponse(use_pyqwest_transport=False, proto_compress_fwdbwd=False))

    @app.post("/api/v1/create_session")
    async def create_session() -> dict[str, Any]:
        return _json(types.CreateSessionResponse(session_id=f"session-{uuid.uuid4().hex[:8]}"))

    @app.post("/api/v1/create_model")
    async def create_model(request: types.CreateModelRequest) -> dict[str, Any]:
        model_id = f"run-{len(state.models) + 1}"
        state.models[model_id] = request.base_model
        state.optim_steps[model_id] = 0
        state.checkpoints[model_id] = {}
        return state.done(_json(types.CreateModelResponse(model_id=model_id)), model_id)

    @app.post("/api/v1/get_info")
    async def get_info(request: types.GetInfoRequest) -> dict[str, Any]:
        base = state.models[request.model_id]
        data = types.ModelData(arch="lora", model_name=base, tokenizer_id=base)
        return _json(
            types.GetInfoResponse(model_id=request.model_id, model_data=data, is_lora=True, model_name=base)
        )

    @app.post("/api/v1/forward_backward")
    async def forward_backward(request: Request) -> dict[str, Any]:
        call = pb.ForwardBackwardRequest()
        call.ParseFromString(await request.body())
        state.forward_backward_losses.append(call.loss_fn)
        # One ArrayRecord, its `logprobs` field every datum's array back to back (offsets in bytes).
        arrays = [np.full(_tokens(d.model_input), LOGPROB, dtype=np.float32) for d in call.data]
        record = pb.ArrayRecord(type_tag="ArrayRecord", num_datums=len(arrays))
        logprobs = record.fields["logprobs"]
        logprobs.data = b"".join(a.tobytes() for a in arrays)
        logprobs.offsets = np.cumsum([0] + [a.nbytes for a in arrays], dtype=np.int64).tobytes()
        logprobs.dtype = pb.DTYPE_FLOAT32
        output = pb.ForwardBackwardOutput(loss_fn_output_type="ArrayRecord", loss_fn_outputs=[record])
        return state.done(output.SerializeToString(), call.model_id)

    @app.post("/api/v1/optim_step")
    async def optim_step(request: types.OptimStepRequest) -> dict[str, Any]:
        state.optim_steps[request.model_id] += 1
        return state.done(_json(types.OptimStepResponse(metrics={})), request.model_id)

    def save(model_id: str, kind: types.CheckpointType, folder: str, name: str | None) -> dict[str, Any]:
        if not name:
            return _failed("this backend saves named checkpoints only")
        checkpoint_id = f"{folder}/{name}"
        path = f"tinker://{model_id}/{checkpoint_id}"
        state.checkpoints[model_id][checkpoint_id] = types.Checkpoint(
            checkpoint_id=checkpoint_id,
            checkpoint_type=kind,
            time=datetime.now(timezone.utc),
            tinker_path=path,
        )
        return {"path": path}

    @app.post("/api/v1/save_weights")
    async def save_weights(request: types.SaveWeightsRequest) -> dict[str, Any]:
        saved = save(request.model_id, "training", "weights", request.path)
        return state.done({**saved, "type": "save_weights"}, request.model_id)

    @app.post("/api/v1/save_weights_for_sampler")
    async def save_weights_for_sampler(request: types.SaveWeightsForSamplerRequest) -> dict[str, Any]:
        saved = save(request.model_id, "sampler", "sampler_weights", request.path)
        return state.done({**saved, "type": "save_weights_for_sampler"}, request.model_id)

    @app.get("/api/v1/training_runs/{model_id}/checkpoints")
    async def list_checkpoints(model_id: str) -> dict[str, Any]:
        listed = list(state.checkpoints.get(model_id, {}).values())
        return _json(types.CheckpointsListResponse(checkpoints=listed))

    @app.delete("/api/v1/training_runs/{model_id}/checkpoints/{checkpoint_id:path}")
    async def delete_checkpoint(model_id: str, checkpoint_id: str) -> dict[str, Any]:
        if state.checkpoints.get(model_id, {}).pop(checkpoint_id, None) is None:
            raise HTTPException(404, "no such checkpoint")
        return {}

    @app.post("/api/v1/create_sampling_session")
    async def create_sampling_session(request: types.CreateSamplingSessionRequest) -> dict[str, Any]:
        path = request.model_path or None
        if path is not None:
            run, _, checkpoint_id = path.removeprefix("tinker://").partition("/")
            if checkpoint_id not in state.checkpoints.get(run, {}):
                raise HTTPException(404, f"no checkpoint {path}")
            base = state.models[run]
        else:
            base = request.base_model or ""
        sampler_id = f"sampler-{len(state.samplers) + 1}"
        state.samplers[sampler_id] = (base, path)
        return _json(types.CreateSamplingSessionResponse(sampling_session_id=sampler_id))

    @app.get("/api/v1/samplers/{sampler_id}")
    async def get_sampler(sampler_id: str) -> dict[str, Any]:
        base, path = state.samplers[sampler_id]
        return _json(types.GetSamplerResponse(sampler_id=sampler_id, base_model=base, model_path=path))

    @app.post("/api/v1/asample")
    async def asample(request: types.SampleRequest) -> dict[str, Any]:
        length = request.sampling_params.max_tokens or 1
        response = pb.SampleResponse()
        for _ in range(request.num_samples):
            response.sequences.add(
                stop_reason=pb.STOP_REASON_LENGTH,
                tokens=np.full(length, SAMPLED_TOKEN, dtype=np.int32).tobytes(),
                logprobs=np.full(length, LOGPROB, dtype=np.float32).tobytes(),
            )
        if request.prompt_logprobs:
            prompt = [math.nan] + [LOGPROB] * (request.prompt.length - 1)  # the first token has none
            response.prompt_logprobs = np.asarray(prompt, dtype=np.float32).tobytes()
        answer = state.done(response.SerializeToString())
        answer["sample_sequence_ids"] = [f"{answer['request_id']}:{i}" for i in range(request.num_samples)]
        return answer

    @app.post("/api/v1/retrieve_future")
    async def retrieve_future(request: types.FutureRetrieveRequest) -> Response:
        answer = state.futures[request.request_id]
        if isinstance(answer, bytes):
            return Response(answer, media_type=PROTOBUF)
        return JSONResponse(answer)

    return app


@contextmanager
def running_fake_tinker() -> Iterator[tuple[str, FakeTinkerState]]:
    """The fake on 127.0.0.1 (a free port), served from a thread of this process: its URL and state."""
    state = FakeTinkerState()
    config = uvicorn.Config(build_app(state), host="127.0.0.1", port=0, log_level="warning")
    server = uvicorn.Server(config)
    thread = threading.Thread(target=server.run, name="fake-tinker", daemon=True)
    thread.start()
    try:
        while not server.started:
            if not thread.is_alive():
                raise RuntimeError("the fake Tinker did not start")
            threading.Event().wait(0.02)
        port = server.servers[0].sockets[0].getsockname()[1]
        yield f"http://127.0.0.1:{port}", state
    finally:
        server.should_exit = True
        thread.join(timeout=10)
