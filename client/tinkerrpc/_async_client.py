"""The asyncio client (grpc.aio) and its model handle: the sync API, awaitable; requests are built by the same code."""

from __future__ import annotations

import asyncio
import time
from collections.abc import Sequence
from types import TracebackType
from typing import Any, TypeVar, cast

import grpc
from google.protobuf.message import Message as ProtoMessage
from grpc_health.v1 import health_pb2, health_pb2_grpc

from tinkerrpc import _convert as convert
from tinkerrpc import _requests as requests
from tinkerrpc._channel import (
    DEFAULT_CONNECT_TIMEOUT,
    DEFAULT_MAX_MESSAGE_BYTES,
    DEFAULT_TIMEOUT,
    HEALTH_SERVICE_NAMES,
    TlsOption,
    auth_metadata,
    channel_credentials,
    channel_options,
    check_serving,
    unreachable,
)
from tinkerrpc._retry import RetryPolicy, call_with_retry_async
from tinkerrpc._types import CheckpointInfo, CheckpointKind, ModelInfo, Sample, TrainOn, TrainResult
from tinkerrpc.v1 import trainer_service_pb2 as service_pb
from tinkerrpc.v1 import trainer_service_pb2_grpc as service_grpc

Req = TypeVar("Req", bound=ProtoMessage)
Resp = TypeVar("Resp", bound=ProtoMessage)


class AsyncClient:
    """An asyncio connection to a tinkerrpc server; the options are those of `Client`, with
    `interceptors` of type grpc.aio.UnaryUnaryClientInterceptor.

    The health check runs on `await client.connect()`, on `async with`, or else before the first call.
    """

    def __init__(
        self,
        target: str,
        token: str | None = None,
        tls: TlsOption = False,
        *,
        timeout: float | None = DEFAULT_TIMEOUT,
        retry: RetryPolicy | None = None,
        connect_timeout: float = DEFAULT_CONNECT_TIMEOUT,
        check_health: bool = True,
        max_message_bytes: int = DEFAULT_MAX_MESSAGE_BYTES,
        interceptors: Sequence[grpc.aio.UnaryUnaryClientInterceptor[Any, Any]] = (),
    ) -> None:
        self.target = target
        self.timeout = timeout
        self.retry = retry or RetryPolicy()
        self.connect_timeout = connect_timeout
        self._metadata = auth_metadata(token)
        credentials = channel_credentials(tls)
        options = channel_options(max_message_bytes)
        # grpc-stubs leaves aio's interceptor type as a placeholder that must be cast.
        aio_interceptors = cast("list[grpc.aio.ClientInterceptor]", list(interceptors))
        self.channel: grpc.aio.Channel = (
            grpc.aio.secure_channel(target, credentials, options, interceptors=aio_interceptors)
            if credentials is not None
            else grpc.aio.insecure_channel(target, options, interceptors=aio_interceptors)
        )
        # The stub's overloads type it as TrainerServiceAsyncStub (a stubs-only name) for an aio channel.
        self.stub = service_grpc.TrainerServiceStub(self.channel)
        self._healthy = not check_health
        self._health_lock = asyncio.Lock()

    async def connect(self) -> AsyncClient:
        """Check health once (UnavailableError unless SERVING within connect_timeout); returns self."""
        async with self._health_lock:
            if not self._healthy:
                await self.wait_until_serving(self.connect_timeout)
                self._healthy = True
        return self

    async def wait_until_serving(self, timeout: float = DEFAULT_CONNECT_TIMEOUT) -> None:
        """Wait for the connection and check gRPC health; UnavailableError unless SERVING within `timeout`."""
        health = health_pb2_grpc.HealthStub(self.channel)
        deadline = time.monotonic() + timeout
        last_error: grpc.RpcError | None = None
        for service in HEALTH_SERVICE_NAMES:
            try:
                response = await health.Check(
                    health_pb2.HealthCheckRequest(service=service),
                    timeout=max(deadline - time.monotonic(), 0.0),
                    metadata=self._metadata,
                    wait_for_ready=True,
                )
            except grpc.RpcError as error:
                last_error = error
                if error.code() == grpc.StatusCode.NOT_FOUND:
                    continue
                raise unreachable(self.target, timeout, error) from error
            check_serving(self.target, service, response)
            return
        assert last_error is not None
        raise unreachable(self.target, timeout, last_error) from last_error

    async def close(self) -> None:
        await self.channel.close(None)

    async def __aenter__(self) -> AsyncClient:
        try:
            return await self.connect()
        except BaseException:
            await self.close()
            raise

    async def __aexit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        await self.close()

    async def call(
        self,
        method: grpc.aio.UnaryUnaryMultiCallable[Req, Resp],
        request: Req,
        *,
        timeout: float | None = None,
        safe_to_repeat: bool,
    ) -> Resp:
        """One RPC with auth metadata, the deadline (per call, else the client default) and retries."""
        await self.connect()
        deadline = timeout if timeout is not None else self.timeout

        async def attempt() -> Resp:
            return await method(request, timeout=deadline, metadata=self._metadata)

        return await call_with_retry_async(self.retry, safe_to_repeat, attempt)

    async def create_model(
        self,
        name: str,
        base_model: str,
        *,
        lora_rank: int = 32,
        renderer: str | None = None,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        timeout: float | None = None,
    ) -> AsyncModel:
        """Create a model (a fresh LoRA run at policy version 0) and return its handle."""
        request = requests.create_model_request(
            name, base_model, lora_rank, renderer, seed, train_mlp, train_attn, train_unembed
        )
        # Not safe to repeat on a deadline: a second attempt could hit ALREADY_EXISTS for our own model.
        await self.call(self.stub.CreateModel, request, timeout=timeout, safe_to_repeat=False)
        return AsyncModel(self, name)

    def model(self, name: str) -> AsyncModel:
        """A handle on an existing model; no network call."""
        if not name:
            raise ValueError("model name must not be empty")
        return AsyncModel(self, name)

    async def get_model(self, name: str, *, timeout: float | None = None) -> ModelInfo:
        response = await self.call(
            self.stub.GetModel, service_pb.GetModelRequest(name=name), timeout=timeout, safe_to_repeat=True
        )
        return convert.model_info_from_proto(response.model)

    async def list_models(self, *, timeout: float | None = None) -> list[ModelInfo]:
        response = await self.call(
            self.stub.ListModels, service_pb.ListModelsRequest(), timeout=timeout, safe_to_repeat=True
        )
        return [convert.model_info_from_proto(m) for m in response.models]

    async def delete_model(self, name: str, *, timeout: float | None = None) -> None:
        await self.call(
            self.stub.DeleteModel,
            service_pb.DeleteModelRequest(name=name),
            timeout=timeout,
            safe_to_repeat=False,
        )


class AsyncModel:
    """A handle on one model of an AsyncClient; every method is one awaitable RPC."""

    def __init__(self, client: AsyncClient, name: str) -> None:
        self.client = client
        self.name = name

    def __repr__(self) -> str:
        return f"AsyncModel({self.name!r})"

    async def info(self, *, timeout: float | None = None) -> ModelInfo:
        return await self.client.get_model(self.name, timeout=timeout)

    async def sample(
        self,
        prompt: requests.Prompt,
        *,
        n: int = 1,
        max_tokens: int = 256,
        temperature: float = 1.0,
        top_p: float | None = None,
        top_k: int = 0,
        stop: Sequence[str] = (),
        stop_token_ids: Sequence[int] = (),
        seed: int | None = None,
        policy_version: int | None = None,
        tools: Sequence[requests.ToolLike] | None = None,
        top_logprobs: int = 0,
        include_prompt_logprobs: bool = False,
        return_token_texts: bool = False,
        ignore_default_stops: bool = False,
        timeout: float | None = None,
    ) -> list[Sample]:
        """Sample `n` completions of a chat prompt (messages), token ids or raw text."""
        request = requests.sample_request(
            self.name,
            prompt,
            n=n,
            max_tokens=max_tokens,
            temperature=temperature,
            top_p=top_p,
            top_k=top_k,
            stop=stop,
            stop_token_ids=stop_token_ids,
            seed=seed,
            policy_version=policy_version,
            tools=tools,
            top_logprobs=top_logprobs,
            include_prompt_logprobs=include_prompt_logprobs,
            return_token_texts=return_token_texts,
            ignore_default_stops=ignore_default_stops,
        )
        return convert.samples_from_proto(
            await self.client.call(self.client.stub.Sample, request, timeout=timeout, safe_to_repeat=True)
        )

    async def train(
        self,
        groups: Sequence[requests.GroupLike],
        *,
        loss: requests.LossName = "importance_sampling",
        learning_rate: float = 1e-4,
        max_staleness: int | None = None,
        strict_staleness: bool = False,
        normalize_std: bool = False,
        clip_low_threshold: float | None = None,
        clip_high_threshold: float | None = None,
        beta: float | None = None,
        adam_beta1: float | None = None,
        adam_beta2: float | None = None,
        adam_eps: float | None = None,
        weight_decay: float = 0.0,
        grad_clip_norm: float = 0.0,
        expected_policy_version: int | None = None,
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> TrainResult:
        """One RL optimizer step from trajectory groups; exactly once even when retried."""
        request = requests.train_request(
            self.name,
            groups,
            loss=loss,
            learning_rate=learning_rate,
            max_staleness=max_staleness,
            strict_staleness=strict_staleness,
            normalize_std=normalize_std,
            clip_low_threshold=clip_low_threshold,
            clip_high_threshold=clip_high_threshold,
            beta=beta,
            adam_beta1=adam_beta1,
            adam_beta2=adam_beta2,
            adam_eps=adam_eps,
            weight_decay=weight_decay,
            grad_clip_norm=grad_clip_norm,
            expected_policy_version=expected_policy_version,
            idempotency_key=idempotency_key,
        )
        return convert.train_result_from_proto(
            await self.client.call(self.client.stub.Train, request, timeout=timeout, safe_to_repeat=True)
        )

    async def train_supervised(
        self,
        conversations: Sequence[requests.ConversationLike],
        *,
        learning_rate: float = 1e-4,
        train_on: TrainOn = "all",
        adam_beta1: float | None = None,
        adam_beta2: float | None = None,
        adam_eps: float | None = None,
        weight_decay: float = 0.0,
        grad_clip_norm: float = 0.0,
        expected_policy_version: int | None = None,
        idempotency_key: str | None = None,
        timeout: float | None = None,
    ) -> TrainResult:
        """One supervised (cross-entropy) optimizer step on conversations; exactly once even when retried."""
        request = requests.supervised_train_request(
            self.name,
            conversations,
            learning_rate=learning_rate,
            train_on=train_on,
            adam_beta1=adam_beta1,
            adam_beta2=adam_beta2,
            adam_eps=adam_eps,
            weight_decay=weight_decay,
            grad_clip_norm=grad_clip_norm,
            expected_policy_version=expected_policy_version,
            idempotency_key=idempotency_key,
        )
        return convert.train_result_from_proto(
            await self.client.call(self.client.stub.Train, request, timeout=timeout, safe_to_repeat=True)
        )

    async def save_checkpoint(
        self, name: str | None = None, *, timeout: float | None = None
    ) -> CheckpointInfo:
        """Save the full training state; the server names it `step_<version>` when `name` is None."""
        request = service_pb.SaveCheckpointRequest(model=self.name, name=name or "")
        response = await self.client.call(
            self.client.stub.SaveCheckpoint, request, timeout=timeout, safe_to_repeat=False
        )
        return convert.checkpoint_from_proto(response.checkpoint)

    async def checkpoints(self, *, timeout: float | None = None) -> list[CheckpointInfo]:
        """Every checkpoint of the model (state and sampler), oldest first."""
        request = service_pb.ListCheckpointsRequest(model=self.name)
        response = await self.client.call(
            self.client.stub.ListCheckpoints, request, timeout=timeout, safe_to_repeat=True
        )
        return [convert.checkpoint_from_proto(c) for c in response.checkpoints]

    async def restore(self, checkpoint: str | CheckpointInfo, *, timeout: float | None = None) -> ModelInfo:
        """Move the model to a saved state checkpoint; returns the model at the checkpoint's version."""
        request = service_pb.RestoreCheckpointRequest(
            model=self.name, checkpoint=requests.checkpoint_name(checkpoint)
        )
        # Restoring twice to the same checkpoint ends in the same state, so a deadline retry is safe.
        response = await self.client.call(
            self.client.stub.RestoreCheckpoint, request, timeout=timeout, safe_to_repeat=True
        )
        return convert.model_info_from_proto(response.model)

    async def delete_checkpoint(
        self,
        checkpoint: str | CheckpointInfo,
        kind: CheckpointKind | None = None,
        *,
        timeout: float | None = None,
    ) -> None:
        """Delete a checkpoint; a bare name means a state checkpoint unless `kind="sampler"`."""
        request = requests.delete_checkpoint_request(self.name, checkpoint, kind)
        await self.client.call(
            self.client.stub.DeleteCheckpoint, request, timeout=timeout, safe_to_repeat=False
        )
