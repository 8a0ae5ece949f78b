"""Write-ahead step records, and rebuilding a model's training state from them.

A Train step whose version gets no full-state checkpoint (--checkpoint-every K > 1) commits, in the same
transaction as its version, a record of exactly what it sent the backend: each datum's tokens and loss
inputs (numpy bytes), the loss name and config, and its optimizer steps (each minibatch's datums and Adam
params; one for a Train without minibatch_size). A model's training state
is therefore always its recovery point (the last committed state checkpoint) plus the recorded steps after
it. Whenever the training client has to be made anew (a restart, an engine restart, a failed or cancelled
step), it is loaded from the recovery point and those steps are replayed in order through the same
forward_backward + optim_step calls, so every acknowledged version keeps its number, its sampler weights
(saved by the step itself, before its commit), its metrics and its idempotency record, and training goes
on from the weights and optimizer state the step produced. On the embedded engine (CPU) a replay is
bitwise equal to the original step (tests/service/test_crash_replay.py compares every version trained
after a replay with an uninterrupted run); each replayed loss is compared with the recorded one and a
difference is logged. The records up to the recovery point are deleted as it advances (store.set_version),
so a model keeps fewer than K of them.
"""

from __future__ import annotations

import json
import logging
import math
from dataclasses import dataclass
from typing import Any

import numpy as np
import numpy.typing as npt
import tinker

from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.service.deadlines import bounded
from tinkerrpc_server.service.minibatches import Minibatch
from tinkerrpc_server.service.store import ModelRow, StepInputsRow, Store

log = logging.getLogger("tinkerrpc.service")

# Replayed and recorded loss differ by more than this (relative): the backend is not deterministic.
LOSS_TOLERANCE = 1e-5


@dataclass(frozen=True)
class StepRecord:
    """What one Train step sent the backend."""

    datums: list[tinker.types.Datum]
    loss: tinker.types.LossFnType
    loss_config: dict[str, float] | None
    steps: list[Minibatch]


# Token ids as int32 (every vocabulary fits); loss inputs keep their own dtype (float32 or int64).
_TOKEN_DTYPE = np.dtype(np.int32)


def encode(record: StepRecord) -> tuple[str, bytes]:
    """(header JSON, the arrays' bytes) for the step_inputs row: each datum's tokens, then its loss
    inputs, exactly the arrays the backend is sent. Not compressed: loss inputs are mostly noise to zlib,
    which costs more than it saves, and a model keeps fewer than K records."""
    layouts: list[dict[str, object]] = []
    arrays: list[bytes] = []
    for datum in record.datums:
        tokens = np.asarray(datum.model_input.to_ints(), dtype=_TOKEN_DTYPE)
        arrays.append(tokens.tobytes())
        inputs: list[list[object]] = []
        for name, tensor in datum.loss_fn_inputs.items():
            if tensor.sparse_crow_indices is not None:
                raise ValueError(f"loss input {name!r} is sparse: it cannot be recorded")
            values = tensor.to_numpy()
            inputs.append([name, tensor.dtype, tensor.shape, values.size])
            arrays.append(values.tobytes())
        layouts.append({"tokens": tokens.size, "inputs": inputs})
    header = {
        "loss": record.loss,
        "loss_config": record.loss_config,
        "minibatches": [[m.start, m.stop, m.adam.model_dump()] for m in record.steps],
        "datums": layouts,
    }
    return json.dumps(header), b"".join(arrays)


def decode(row: StepInputsRow) -> StepRecord:
    header = json.loads(row.header)
    offset = 0

    def take(count: int, dtype: npt.DTypeLike) -> npt.NDArray[Any]:
        nonlocal offset
        values = np.frombuffer(row.arrays, dtype=dtype, count=count, offset=offset)
        offset += values.nbytes
        return values

    datums = []
    for layout in header["datums"]:
        tokens = take(layout["tokens"], _TOKEN_DTYPE).tolist()
        loss_fn_inputs = {
            name: tinker.types.TensorData(data=take(size, dtype).copy(), dtype=dtype, shape=shape)
            for name, dtype, shape, size in layout["inputs"]
        }
        datums.append(
            tinker.types.Datum(
                model_input=tinker.types.ModelInput.from_ints(tokens), loss_fn_inputs=loss_fn_inputs
            )
        )
    loss: tinker.types.LossFnType = header["loss"]  # as the step passed it to forward_backward
    # Records written before minibatches hold one step's "adam".
    steps = header.get("minibatches") or [[0, len(datums), header["adam"]]]
    return StepRecord(
        datums=datums,
        loss=loss,
        loss_config=header["loss_config"],
        steps=[
            Minibatch(start, stop, tinker.types.AdamParams.model_validate(adam))
            for start, stop, adam in steps
        ],
    )


def replayable_version(store: Store, row: ModelRow) -> int:
    """The newest version the recovery point and the unbroken run of records after it rebuild."""
    version = row.recovery_version
    for recorded in store.step_input_versions(row.name, row.recovery_version):
        if recorded != version + 1:
            break
        version = recorded
    return min(version, row.policy_version)


async def replay(store: Store, row: ModelRow, client: tinker.TrainingClient) -> None:
    """Apply the recorded steps after the recovery point to `client`, loaded from it: the model's
    training state at its current version."""
    rows = store.step_inputs(row.name, row.recovery_version)
    recorded_losses = {
        m.policy_version: types_pb2.TrainMetrics.FromString(m.metrics).loss
        for m in store.metrics_rows(row.name, row.recovery_version + 1, row.policy_version, len(rows))
    }
    # All submitted at once, as a Train step submits its operations: the SDK orders them by sequence id.
    submitted = []
    for step in rows:
        record = decode(step)
        operations = [
            (
                client.forward_backward(record.datums[m.start : m.stop], record.loss, record.loss_config),
                client.optim_step(m.adam),
            )
            for m in record.steps
        ]
        submitted.append((step, operations))
    for step, operations in submitted:
        loss = 0.0
        for forward_backward, optim_step in operations:
            output = await bounded(forward_backward, "forward_backward (replay)")
            await bounded(optim_step, "optim_step (replay)")
            loss += float(output.metrics.get("loss:sum", math.nan))
        recorded = recorded_losses.get(step.policy_version, math.nan)
        if not math.isclose(loss, recorded, rel_tol=LOSS_TOLERANCE, abs_tol=LOSS_TOLERANCE):
            log.warning(
                "model %s: replayed version %d has loss %r, recorded %r: the backend is not deterministic",
                row.name,
                step.policy_version,
                loss,
                recorded,
            )
    if rows:
        log.info(
            "model %s: replayed versions %d..%d on top of its recovery point %d",
            row.name,
            rows[0].policy_version,
            rows[-1].policy_version,
            row.recovery_version,
        )
