"""A minimal in-memory TrainerService on a real grpc.aio server on 127.0.0.1, with fault injection.

This is a test double, not the product's service: the behaviour under test here is the CLIENT's
(retries, deadlines, idempotency keys, error decoding, auth metadata, health checks), and faults
such as "the step applied but the response was lost" must be injected deterministically. It runs
in its own thread and event loop so blocking and asyncio clients can both talk to it.
"""

from __future__ import annotations

import asyncio
import threading
from collections import defaultdict, deque
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import grpc
from google.protobuf.message import Message as ProtoMessage
from google.rpc import error_details_pb2, status_pb2
from grpc_health.v1 import health, health_pb2, health_pb2_grpc

import tinkerrpc
from tinkerrpc.v1 import trainer_service_pb2 as service_pb
from tinkerrpc.v1 import trainer_service_pb2_grpc as service_grpc
from tinkerrpc.v1 import types_pb2 as pb

# Fault actions, consumed one per call of the method they are injected for.
UNAVAILABLE_BEFORE = "unavailable_before"  # refuse without doing anything
UNAVAILABLE_AFTER = "unavailable_after"  # do the work, then lose the response


@dataclass
class Delay:
    """Sleep this long before handling (to run past the client's deadline)."""

    seconds: float


@dataclass
class RecordedCall:
    method: str
    metadata: dict[str, str]
    request: Any


class Abort(Exception):
    def __init__(self, code: grpc.StatusCode, message: str, *details: ProtoMessage) -> None:
        super().__init__(message)
        self.code = code
        self.message = message
        self.details = details


def status_trailer(
    code: grpc.StatusCode, message: str, details: tuple[ProtoMessage, ...]
) -> tuple[str, bytes]:
    """A google.rpc.Status in the grpc-status-details-bin trailer, as a real server attaches it."""
    status = status_pb2.Status(code=code.value[0], message=message)
    for detail in details:
        status.details.add().Pack(detail)
    return ("grpc-status-details-bin", status.SerializeToString())


class FakeTrainer(service_grpc.TrainerServiceServicer):
    def __init__(self, required_token: str | None = None) -> None:
        self.required_token = required_token
        self.calls: list[RecordedCall] = []
        self.faults: dict[str, deque[Any]] = defaultdict(deque)
        self.models: dict[str, pb.ModelInfo] = {}
        self.checkpoints: dict[str, list[pb.CheckpointInfo]] = defaultdict(list)
        self.train_responses: dict[str, service_pb.TrainResponse] = {}
        self.steps_applied = 0

    def inject(self, method: str, *actions: Any) -> None:
        self.faults[method].extend(actions)

    def calls_to(self, method: str) -> list[RecordedCall]:
        return [c for c in self.calls if c.method == method]

    async def _handle(
        self, method: str, request: Any, context: grpc.aio.ServicerContext, body: Callable[[Any], Any]
    ) -> Any:
        metadata = {m.key: m.value for m in context.invocation_metadata() or ()}
        self.calls.append(RecordedCall(method, metadata, request))
        if (
            self.required_token is not None
            and metadata.get("authorization") != f"Bearer {self.required_token}"
        ):
            await context.abort(grpc.StatusCode.UNAUTHENTICATED, "missing or wrong bearer token")
        fault = self.faults[method].popleft() if self.faults[method] else None
        if fault == UNAVAILABLE_BEFORE:
            await context.abort(grpc.StatusCode.UNAVAILABLE, "injected: backend restarting")
        if isinstance(fault, Delay):
            await asyncio.sleep(fault.seconds)
        try:
            response = body(request)
        except Abort as error:
            await context.abort(
                error.code,
                error.message,
                trailing_metadata=(status_trailer(error.code, error.message, error.details),),
            )
        if fault == UNAVAILABLE_AFTER:
            await context.abort(
                grpc.StatusCode.UNAVAILABLE, "injected: response lost after the work was done"
            )
        return response

    def _model(self, name: str) -> pb.ModelInfo:
        if name not in self.models:
            raise Abort(
                grpc.StatusCode.NOT_FOUND,
                f"model {name!r} not found",
                error_details_pb2.ResourceInfo(resource_type="model", resource_name=name),
            )
        return self.models[name]

    # --- bodies -------------------------------------------------------------------------------

    def _create(self, request: service_pb.CreateModelRequest) -> service_pb.CreateModelResponse:
        if request.name in self.models:
            raise Abort(grpc.StatusCode.ALREADY_EXISTS, f"model {request.name!r} exists")
        info = pb.ModelInfo(
            name=request.name,
            base_model=request.base_model,
            lora=request.lora,
            renderer=request.renderer or "role_colon",
            seed=request.seed,
            sampleable_versions=[0],
        )
        self.models[request.name] = info
        return service_pb.CreateModelResponse(model=info)

    def _train(self, request: service_pb.TrainRequest) -> service_pb.TrainResponse:
        if request.idempotency_key in self.train_responses:
            replay = service_pb.TrainResponse()
            replay.CopyFrom(self.train_responses[request.idempotency_key])
            replay.replayed = True
            return replay
        info = self._model(request.model)
        current = info.policy_version
        if request.HasField("max_staleness") and request.strict_staleness:
            for g, group in enumerate(request.groups):
                for t, traj in enumerate(group.trajectories):
                    sampled = min(turn.policy_version for turn in traj.turns)
                    if current - sampled > request.max_staleness:
                        raise Abort(
                            grpc.StatusCode.FAILED_PRECONDITION,
                            f"groups[{g}].trajectories[{t}] is {current - sampled} versions stale",
                            error_details_pb2.ErrorInfo(
                                reason="STALE_POLICY_VERSION",
                                domain="tinkerrpc",
                                metadata={"current_version": str(current), "sampled_version": str(sampled)},
                            ),
                        )
        info.policy_version += 1
        info.sampleable_versions.append(info.policy_version)
        self.steps_applied += 1
        rewards = [t.reward for g in request.groups for t in g.trajectories]
        response = service_pb.TrainResponse(
            policy_version=info.policy_version,
            metrics=pb.TrainMetrics(
                mean_reward=sum(rewards) / len(rewards) if rewards else 0.0,
                trajectories_used=len(rewards) or len(request.examples),
            ),
            sampler_checkpoint=pb.CheckpointInfo(
                model=info.name,
                name=f"step_{info.policy_version:06d}",
                policy_version=info.policy_version,
                kind=pb.CHECKPOINT_KIND_SAMPLER,
                automatic=True,
            ),
        )
        self.checkpoints[info.name].append(response.sampler_checkpoint)
        if request.idempotency_key:
            self.train_responses[request.idempotency_key] = response
        return response

    def _sample(self, request: service_pb.SampleRequest) -> service_pb.SampleResponse:
        info = self._model(request.model)
        if request.params.max_tokens > 1000:
            raise Abort(
                grpc.StatusCode.INVALID_ARGUMENT,
                "max_tokens too large",
                error_details_pb2.BadRequest(
                    field_violations=[
                        error_details_pb2.BadRequest.FieldViolation(
                            field="params.max_tokens", description="must be <= 1000"
                        )
                    ]
                ),
            )
        kind = request.WhichOneof("prompt")
        if kind == "tokens":
            prompt_ids = list(request.tokens.token_ids)
        elif kind == "text":
            prompt_ids = [ord(c) % 256 for c in request.text]
        else:
            prompt_ids = [len(m.content) for m in request.chat.messages]
        version = request.policy_version if request.HasField("policy_version") else info.policy_version
        sequences = [
            pb.SampledSequence(
                token_ids=[100 + i, 200 + i],
                logprobs=[-0.5, -0.25],
                text=f"answer {i}",
                message=pb.Message(role=pb.ROLE_ASSISTANT, content=f"answer {i}") if kind == "chat" else None,
                stop_reason=pb.STOP_REASON_STOP,
                policy_version=version,
            )
            for i in range(request.params.n)
        ]
        return service_pb.SampleResponse(
            sequences=sequences, prompt_token_ids=prompt_ids, policy_version=version, model=info.name
        )

    def _save(self, request: service_pb.SaveCheckpointRequest) -> service_pb.SaveCheckpointResponse:
        info = self._model(request.model)
        checkpoint = pb.CheckpointInfo(
            model=info.name,
            name=request.name or f"step_{info.policy_version:06d}",
            policy_version=info.policy_version,
            kind=pb.CHECKPOINT_KIND_STATE,
        )
        checkpoint.create_time.GetCurrentTime()
        self.checkpoints[info.name].append(checkpoint)
        return service_pb.SaveCheckpointResponse(checkpoint=checkpoint)

    def _find_checkpoint(self, model: str, name: str, kind: int) -> pb.CheckpointInfo:
        for checkpoint in self.checkpoints[model]:
            if checkpoint.name == name and checkpoint.kind == kind:
                return checkpoint
        raise Abort(grpc.StatusCode.NOT_FOUND, f"checkpoint {name!r} not found")

    def _restore(self, request: service_pb.RestoreCheckpointRequest) -> service_pb.RestoreCheckpointResponse:
        info = self._model(request.model)
        checkpoint = self._find_checkpoint(info.name, request.checkpoint, pb.CHECKPOINT_KIND_STATE)
        info.policy_version = checkpoint.policy_version
        return service_pb.RestoreCheckpointResponse(model=info)

    def _delete_checkpoint(
        self, request: service_pb.DeleteCheckpointRequest
    ) -> service_pb.DeleteCheckpointResponse:
        self._model(request.model)
        kind = request.kind or pb.CHECKPOINT_KIND_STATE
        self.checkpoints[request.model].remove(self._find_checkpoint(request.model, request.checkpoint, kind))
        return service_pb.DeleteCheckpointResponse()

    def _delete_model(self, request: service_pb.DeleteModelRequest) -> service_pb.DeleteModelResponse:
        self._model(request.name)
        del self.models[request.name]
        return service_pb.DeleteModelResponse()

    # --- RPCs ---------------------------------------------------------------------------------

    async def CreateModel(self, request: Any, context: Any) -> Any:
        return await self._handle("CreateModel", request, context, self._create)

    async def GetModel(self, request: Any, context: Any) -> Any:
        return await self._handle(
            "GetModel", request, context, lambda r: service_pb.GetModelResponse(model=self._model(r.name))
        )

    async def ListModels(self, request: Any, context: Any) -> Any:
        return await self._handle(
            "ListModels",
            request,
            context,
            lambda r: service_pb.ListModelsResponse(models=self.models.values()),
        )

    async def DeleteModel(self, request: Any, context: Any) -> Any:
        return await self._handle("DeleteModel", request, context, self._delete_model)

    async def Train(self, request: Any, context: Any) -> Any:
        return await self._handle("Train", request, context, self._train)

    async def SaveCheckpoint(self, request: Any, context: Any) -> Any:
        return await self._handle("SaveCheckpoint", request, context, self._save)

    async def ListCheckpoints(self, request: Any, context: Any) -> Any:
        return await self._handle(
            "ListCheckpoints",
            request,
            context,
            lambda r: service_pb.ListCheckpointsResponse(
                checkpoints=self.checkpoints[self._model(r.model).name]
            ),
        )

    async def RestoreCheckpoint(self, request: Any, context: Any) -> Any:
        return await self._handle("RestoreCheckpoint", request, context, self._restore)

    async def DeleteCheckpoint(self, request: Any, context: Any) -> Any:
        return await self._handle("DeleteCheckpoint", request, context, self._delete_checkpoint)

    async def Sample(self, request: Any, context: Any) -> Any:
        return await self._handle("Sample", request, context, self._sample)


class FakeServer:
    """A grpc.aio server with FakeTrainer and gRPC health, running in a background thread."""

    def __init__(
        self,
        required_token: str | None = None,
        server_credentials: grpc.ServerCredentials | None = None,
        serving: bool = True,
    ) -> None:
        self.trainer = FakeTrainer(required_token)
        self._credentials = server_credentials
        self._serving = serving
        self._loop = asyncio.new_event_loop()
        self._thread = threading.Thread(target=self._loop.run_forever, daemon=True)
        self._server: grpc.aio.Server | None = None
        self.port = 0

    @property
    def target(self) -> str:
        return f"127.0.0.1:{self.port}"

    async def _start(self) -> None:
        self._server = grpc.aio.server()
        service_grpc.add_TrainerServiceServicer_to_server(self.trainer, self._server)
        health_servicer = health.aio.HealthServicer()
        status = (
            health_pb2.HealthCheckResponse.SERVING
            if self._serving
            else health_pb2.HealthCheckResponse.NOT_SERVING
        )
        await health_servicer.set("", status)
        health_pb2_grpc.add_HealthServicer_to_server(health_servicer, self._server)
        if self._credentials is None:
            self.port = self._server.add_insecure_port("127.0.0.1:0")
        else:
            self.port = self._server.add_secure_port("127.0.0.1:0", self._credentials)
        await self._server.start()

    def start(self) -> FakeServer:
        self._thread.start()
        asyncio.run_coroutine_threadsafe(self._start(), self._loop).result(timeout=10)
        return self

    def stop(self) -> None:
        if self._server is not None:
            asyncio.run_coroutine_threadsafe(self._server.stop(None), self._loop).result(timeout=10)
        self._loop.call_soon_threadsafe(self._loop.stop)
        self._thread.join(timeout=10)


# Backoffs short enough that retry tests stay fast; the decisions under test are the same.
FAST_RETRY = tinkerrpc.RetryPolicy(max_attempts=4, initial_backoff=0.01, max_backoff=0.05)
