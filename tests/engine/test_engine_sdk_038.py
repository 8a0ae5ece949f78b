"""Tinker 0.38's newer options through the unmodified SDK against a real engine: the optimizer family
chosen at creation and the sampler's top-K logprobs of sampled tokens."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from engine_proc import TINY, seq_gaps
from tinker import types

from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.process

ADAM = types.AdamParams(learning_rate=1e-2)


def datum(tokens: list[int]) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "weights": np.ones(len(tokens) - 1, dtype=np.float32),
        },
    )


BATCH = [datum([11, 42, 17, 99, 23, 5])]
PROBE = [datum([31, 32, 33, 34, 35, 36, 37])]


def probe(client: tinker.TrainingClient) -> np.ndarray:
    out = client.forward(PROBE, "cross_entropy").result()
    return np.concatenate([o["logprobs"].to_numpy() for o in out.loss_fn_outputs])


def test_a_dimuon_model_is_refused_at_creation_and_nothing_runs_adam_in_its_place(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    rest = engine.rest_client()
    runs_before = len(rest.list_training_runs(limit=100).result().training_runs)
    with pytest.raises(tinker.BadRequestError) as refused:
        service.create_lora_training_client(TINY, rank=4, optimizer=types.DimuonOptimizerConfig()).result()
    assert "optimizer_config" in str(refused.value) and "'dimuon'" in str(refused.value)

    client = service.create_lora_training_client(TINY, rank=4, seed=3).result()
    client.forward_backward(BATCH, "cross_entropy").result()
    client.optim_step(ADAM).result()
    state = client.save_state("adam").result().path
    with pytest.raises(tinker.BadRequestError) as refused:
        service.create_training_client_from_state(state, optimizer=types.DimuonOptimizerConfig()).result()
    assert "optimizer_config" in str(refused.value)
    runs = rest.list_training_runs(limit=100).result().training_runs
    assert len(runs) == runs_before + 1, "a refused create must leave no run behind"

    # An AdamW model refuses a Dimuon step, which changes nothing and leaves the client usable.
    before = probe(client)
    client.forward_backward(BATCH, "cross_entropy").result()
    with pytest.raises(tinker.RequestFailedError) as failed:
        client.optim_step(types.DimuonParams(learning_rate=0.5)).result()
    assert "optim_params: type 'dimuon'" in str(failed.value)
    np.testing.assert_array_equal(probe(client), before)
    client.optim_step(ADAM).result()  # the gradients kept from before the refused step
    assert not np.allclose(probe(client), before)
    assert seq_gaps(engine, client.model_id) == []
