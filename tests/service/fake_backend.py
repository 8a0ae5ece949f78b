"""An in-process stand-in for Tinker, for the fast service tests: exactly the part of the tinker SDK the
service calls (ServiceClient: create the LoRA training client, load one from a state, a sampling client
that scores (prompt logprobs only), RestClient: list and delete checkpoints, a training client's
forward_backward, optim_step, saves and unload request).

Its model is deterministic bookkeeping, not arithmetic: a training client's `weights` is a digest of its
starting point and of every step applied to it, in order (a forward_backward's datums, loss and config,
then the optim_step's Adam params). Two clients have equal weights exactly when they went through the
same steps from the same start, which is what a rebuilt training client (recovery point + replayed
step records) must match. Like the SDK, each operation is ordered when it is called, not when awaited.
The live-`serve` tests cover the real SDK and engine end to end."""

from __future__ import annotations

import asyncio
import hashlib
import itertools
import json
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Any, TypeVar, cast

import httpx
import tinker

from tinkerrpc_server.service.backend import Backend

Value = TypeVar("Value")

# Bytes the fake reports for each checkpoint (the listing's size_bytes).
STATE_BYTES = 3000
SAMPLER_BYTES = 1000
# The logprob the fake sampling client gives every scored token.
SCORED_LOGPROB = -2.0


def _digest(*parts: object) -> str:
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


def _resolved(value: Value) -> asyncio.Future[Value]:
    future: asyncio.Future[Value] = asyncio.get_running_loop().create_future()
    future.set_result(value)
    return future


def _failed(error: Exception) -> asyncio.Future[Any]:
    future: asyncio.Future[Any] = asyncio.get_running_loop().create_future()
    future.set_exception(error)
    return future


@dataclass(frozen=True)
class FakeCheckpoint:
    """One saved checkpoint as the rest API lists it (the fields the service reads), and its weights."""

    tinker_path: str
    checkpoint_id: str
    size_bytes: int
    weights: str


@dataclass(frozen=True)
class _Listing:
    checkpoints: list[FakeCheckpoint]


@dataclass(frozen=True)
class _Saved:
    path: str


@dataclass(frozen=True)
class _Output:
    metrics: dict[str, float]
    loss_fn_outputs: list[dict[str, tinker.types.TensorData]] = field(default_factory=list)
    loss_fn_output_type: str = "TensorData"


# The per-token logprob the fake returns when it reports no `loss:sum` (reports_loss_sum=False).
RETURNED_LOGPROB = -0.25


@dataclass
class FakeTinker:
    """The backend's state: every checkpoint by tinker path, the training clients it holds, and the
    operations told to fail once (`fail_next`: "forward_backward", "optim_step", "save_state",
    "create_training_client_from_state_with_optimizer", ...).

    Switches for a Tinker-compatible backend that is not Tinker: `reports_loss_sum=False` sends no
    `loss:sum` metric, only per-token logprobs in loss_fn_outputs; `lists_other_path_form=True` lists
    each checkpoint under another path than its save answered (tinker://<run>/listed/<kind>/<name>) and
    refuses to delete by the answered one. Like SkyRL tx, it has no external-weights export: its
    save_weights_external route answers 404."""

    checkpoints: dict[str, FakeCheckpoint] = field(default_factory=dict)
    live_clients: set[str] = field(default_factory=set)
    # Every training client made, in order: what tests compare rebuilt ones with.
    clients: list[FakeTrainingClient] = field(default_factory=list)
    fail_next: set[str] = field(default_factory=set)
    reports_loss_sum: bool = True
    lists_other_path_form: bool = False
    refused_deletes: list[str] = field(default_factory=list)
    _run_numbers: itertools.count[int] = field(default_factory=lambda: itertools.count(1))

    def backend(self) -> Backend:
        """A service Backend whose SDK clients are this fake (it plays both ServiceClient and RestClient)."""
        return Backend(
            service=cast(tinker.ServiceClient, self),
            rest=cast(tinker.RestClient, self),
            url="fake-tinker",
            engine=None,
            base_url="fake-tinker",
            api_key="fake-key",
        )

    def _new_client(self, weights: str) -> FakeTrainingClient:
        client = FakeTrainingClient(self, f"run-{next(self._run_numbers)}", weights)
        self.live_clients.add(client.model_id)
        self.clients.append(client)
        return client

    def failing(self, operation: str) -> bool:
        if operation in self.fail_next:
            self.fail_next.discard(operation)
            return True
        return False

    # ServiceClient

    def create_lora_training_client(
        self,
        base_model: str,
        rank: int = 32,
        seed: int | None = None,
        train_mlp: bool = True,
        train_attn: bool = True,
        train_unembed: bool = True,
        user_metadata: dict[str, str] | None = None,
    ) -> asyncio.Future[FakeTrainingClient]:
        start = _digest("init", base_model, rank, seed, train_mlp, train_attn, train_unembed)
        return _resolved(self._new_client(start))

    def create_training_client_from_state_with_optimizer(
        self, path: str
    ) -> asyncio.Future[FakeTrainingClient]:
        if self.failing("create_training_client_from_state_with_optimizer"):
            return _failed(LookupError(f"the backend refused to load {path}"))
        saved = self.checkpoints.get(path)
        if saved is None or "/weights/" not in path:
            return _failed(LookupError(f"no state checkpoint at {path}"))
        return _resolved(self._new_client(saved.weights))

    def create_sampling_client(
        self, model_path: str | None = None, base_model: str | None = None
    ) -> asyncio.Future[FakeSamplingClient]:
        return _resolved(FakeSamplingClient())

    # RestClient

    async def list_checkpoints(self, run_id: str) -> _Listing:
        return _Listing([c for path, c in self.checkpoints.items() if path.startswith(f"tinker://{run_id}/")])

    async def delete_checkpoint_from_tinker_path(self, path: str) -> None:
        if self.lists_other_path_form:
            answered = [key for key, c in self.checkpoints.items() if c.tinker_path == path]
            if not answered:
                self.refused_deletes.append(path)
                raise ValueError(f"Invalid tinker path {path}")
            path = answered[0]
        self.checkpoints.pop(path, None)


class FakeTrainingClient:
    def __init__(self, backend: FakeTinker, model_id: str, weights: str) -> None:
        self._backend = backend
        self.model_id = model_id
        self.weights = weights
        self._gradient: str | None = None
        # The last forward_backward's datums: (input tokens, loss inputs).
        self.last_batch: list[tuple[list[int], dict[str, Any]]] = []
        self.holder = _FakeHolder(backend)

    def forward_backward(
        self, datums: list[tinker.types.Datum], loss_fn: str, loss_fn_config: dict[str, float] | None = None
    ) -> asyncio.Future[_Output]:
        if self._backend.failing("forward_backward"):
            return _failed(RuntimeError("forward_backward failed"))
        batch = [
            (d.model_input.to_ints(), {k: v.to_numpy().tolist() for k, v in d.loss_fn_inputs.items()})
            for d in datums
        ]
        self.last_batch = batch
        self._gradient = _digest(self.weights, batch, loss_fn, loss_fn_config)
        if not self._backend.reports_loss_sum:
            outputs = [
                {
                    "logprobs": tinker.types.TensorData(
                        data=[RETURNED_LOGPROB] * d.model_input.length, dtype="float32"
                    )
                }
                for d in datums
            ]
            return _resolved(_Output({}, outputs))
        return _resolved(_Output({"loss:sum": int(self._gradient[:8], 16) / 2**32}))

    def optim_step(self, adam: tinker.types.AdamParams) -> asyncio.Future[_Output]:
        if self._backend.failing("optim_step") or self._gradient is None:
            return _failed(RuntimeError("optim_step failed"))
        self.weights = _digest(self.weights, self._gradient, adam.model_dump())
        self._gradient = None
        return _resolved(_Output({}))

    def _save(self, operation: str, folder: str, name: str, size: int) -> asyncio.Future[_Saved]:
        if self._backend.failing(operation):
            return _failed(RuntimeError(f"{operation} failed"))
        path = f"tinker://{self.model_id}/{folder}/{name}"
        listed = (
            f"tinker://{self.model_id}/listed/{folder}/{name}"
            if self._backend.lists_other_path_form
            else path
        )
        self._backend.checkpoints[path] = FakeCheckpoint(listed, f"{folder}/{name}", size, self.weights)
        return _resolved(_Saved(path))

    def save_state(self, name: str) -> asyncio.Future[_Saved]:
        return self._save("save_state", "weights", name, STATE_BYTES)

    def save_weights_for_sampler(self, name: str) -> asyncio.Future[_Saved]:
        return self._save("save_weights_for_sampler", "sampler_weights", name, SAMPLER_BYTES)

    def save_weights_external(self, name: str) -> asyncio.Future[_Saved]:
        request = httpx.Request("POST", "http://fake-tinker/api/v1/save_weights_external")
        response = httpx.Response(404, request=request, json={"detail": "Not Found"})
        return _failed(tinker.NotFoundError("Error code: 404 - Not Found", response=response, body=None))


@dataclass
class _Scored:
    prompt_logprobs: list[float | None]


class FakeSamplingClient:
    """Scores only: every token after the first gets SCORED_LOGPROB; `calls` counts the passes."""

    calls = 0

    async def sample(
        self,
        prompt: tinker.types.ModelInput,
        num_samples: int,
        sampling_params: tinker.types.SamplingParams,
        include_prompt_logprobs: bool = False,
    ) -> _Scored:
        assert include_prompt_logprobs and num_samples == 1, "the fake only scores"
        FakeSamplingClient.calls += 1
        return _Scored([None] + [SCORED_LOGPROB] * (len(prompt.to_ints()) - 1))


class _FakeHolder:
    """What retention.unload_training_client reaches through: the SDK's HTTP client for unload_model."""

    def __init__(self, backend: FakeTinker) -> None:
        self._backend = backend

    @contextmanager
    def aclient(self, _pool: object) -> Iterator[_FakeHolder]:
        yield self

    async def post(self, path: str, body: dict[str, Any], cast_to: object) -> None:
        assert path == "/api/v1/unload_model", path
        self._backend.live_clients.discard(str(body["model_id"]))

    def run_coroutine_threadsafe(self, coroutine: Any) -> Any:
        return coroutine
