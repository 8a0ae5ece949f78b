"""A supervised Train with minibatch_size, in-process over the fake backend: it takes exactly the optimizer
steps of separate Trains on its minibatches (same datums, same Adam settings, in order), commits one
version with one sampler save, reports each minibatch's loss, and a restart rebuilds it from its
write-ahead record like any step."""

from __future__ import annotations

import json
from pathlib import Path

import pytest
import tinker
from fake_backend import FakeTinker
from in_process import InProcessService

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service import recovery
from tinkerrpc_server.service.minibatches import Minibatch
from tinkerrpc_server.service.recovery import StepRecord
from tinkerrpc_server.service.rendering import ChatCodecs
from tinkerrpc_server.service.store import StepInputsRow

pytestmark = pytest.mark.unit

TEXTS = ["one", "two", "three", "four", "five"]
RATES = [1e-3, 5e-4, 2e-4]


def _request(texts: list[str], learning_rate: float = 1e-3) -> pb.TrainRequest:
    request = pb.TrainRequest(model="m", adam=types_pb2.AdamParams(learning_rate=learning_rate, beta1=0.8))
    for text in texts:
        request.examples.add(
            messages=[
                types_pb2.Message(role=types_pb2.ROLE_USER, content=text),
                types_pb2.Message(role=types_pb2.ROLE_ASSISTANT, content=f"{text}, yes"),
            ]
        )
    return request


def _minibatched(size: int = 2, rates: list[float] | None = None) -> pb.TrainRequest:
    request = _request(TEXTS)
    request.minibatch_size = size
    request.minibatch_learning_rates.extend(rates or [])
    return request


async def _service(tmp_path: Path, codecs: ChatCodecs, db: str, every: int = 1) -> InProcessService:
    service = InProcessService.open(tmp_path / db, FakeTinker(), codecs, checkpoint_every=every)
    await service.create("m")
    return service


async def test_minibatches_step_as_separate_trains_and_commit_one_version(
    tmp_path: Path, codecs: ChatCodecs
) -> None:
    separate = await _service(tmp_path, codecs, "separate.sqlite3")
    losses = []
    for k, rate in enumerate(RATES):
        response = await separate.trainer.train(_request(TEXTS[2 * k : 2 * k + 2], rate))
        losses.append(response.metrics.loss)

    together = await _service(tmp_path, codecs, "together.sqlite3")
    response = await together.trainer.train(_minibatched(2, RATES))
    assert response.policy_version == 1
    assert (await together.training_client("m")).weights == (await separate.training_client("m")).weights
    assert list(response.metrics.minibatch_losses) == pytest.approx(losses)
    assert response.metrics.loss == pytest.approx(sum(losses))
    assert response.metrics.trajectories_used == len(TEXTS)
    samplers = [p for p in together.fake.checkpoints if "/sampler_weights/" in p]
    assert len(samplers) == 2, samplers  # version 0's and this Train's one save


async def test_minibatches_without_rates_take_adams_learning_rate(tmp_path: Path, codecs: ChatCodecs) -> None:
    separate = await _service(tmp_path, codecs, "separate.sqlite3")
    for k in range(0, len(TEXTS), 3):
        await separate.trainer.train(_request(TEXTS[k : k + 3]))
    together = await _service(tmp_path, codecs, "together.sqlite3")
    response = await together.trainer.train(_minibatched(3))
    assert len(response.metrics.minibatch_losses) == 2
    assert (await together.training_client("m")).weights == (await separate.training_client("m")).weights


async def test_one_minibatch_of_everything_is_a_plain_train(tmp_path: Path, codecs: ChatCodecs) -> None:
    plain = await _service(tmp_path, codecs, "plain.sqlite3")
    plain_response = await plain.trainer.train(_request(TEXTS))
    whole = await _service(tmp_path, codecs, "whole.sqlite3")
    response = await whole.trainer.train(_minibatched(len(TEXTS)))
    assert (await whole.training_client("m")).weights == (await plain.training_client("m")).weights
    assert list(response.metrics.minibatch_losses) == [pytest.approx(plain_response.metrics.loss)]
    assert not plain_response.metrics.minibatch_losses


async def test_a_restart_replays_a_minibatched_step_from_its_record(
    tmp_path: Path, codecs: ChatCodecs
) -> None:
    service = await _service(tmp_path, codecs, "db.sqlite3", every=3)
    await service.trainer.train(_minibatched(2, RATES))
    await service.trainer.train(_minibatched(1))
    assert service.store.step_input_versions("m", after=0) == [1, 2]
    trained = (await service.training_client("m")).weights
    await service.settled()
    service.close()

    restarted = InProcessService.open(tmp_path / "db.sqlite3", service.fake, codecs, checkpoint_every=3)
    await restarted.models.recover()
    rebuilt = await restarted.training_client("m")
    assert rebuilt.weights == trained


def test_a_record_written_before_minibatches_decodes_as_one_step() -> None:
    datum = tinker.types.Datum(
        model_input=tinker.types.ModelInput.from_ints([1, 2, 3]),
        loss_fn_inputs={"target_tokens": [2, 3, 4], "weights": [0.0, 1.0, 1.0]},
    )
    adam = tinker.types.AdamParams(learning_rate=3e-4)
    header, arrays = recovery.encode(
        StepRecord([datum, datum], "cross_entropy", None, [Minibatch(0, 2, adam)])
    )
    old = json.loads(header)
    old["adam"] = old.pop("minibatches")[0][2]
    row = StepInputsRow(policy_version=1, header=json.dumps(old), arrays=arrays)
    assert recovery.decode(row).steps == [Minibatch(0, 2, adam)]


async def test_without_loss_sum_each_minibatch_loss_comes_from_its_logprobs(
    tmp_path: Path, codecs: ChatCodecs
) -> None:
    service = InProcessService.open(tmp_path / "db.sqlite3", FakeTinker(reports_loss_sum=False), codecs)
    await service.create("m")
    separate = [(await service.trainer.train(_request(TEXTS[k : k + 2]))).metrics.loss for k in (0, 2, 4)]
    metrics = (await service.trainer.train(_minibatched(2))).metrics
    # cross_entropy with 0/1 weights: minus the returned logprob per trained token of each minibatch.
    assert list(metrics.minibatch_losses) == pytest.approx(separate)
    assert all(loss > 0 for loss in separate)
    assert metrics.loss == pytest.approx(sum(separate))
