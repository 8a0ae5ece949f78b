"""A new engine process on the same data dir serves everything the previous one saved."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
from engine_proc import TINY, start_engine
from tinker import types

pytestmark = pytest.mark.process

DATA = [
    types.Datum(
        model_input=types.ModelInput.from_ints([12, 40, 41, 7, 9]),
        loss_fn_inputs={
            "target_tokens": np.asarray([40, 41, 7, 9, 3]),
            "weights": np.ones(5, dtype=np.float32),
        },
    )
]
PROMPT = types.ModelInput.from_ints([12, 40, 41, 7, 9, 3])


def test_state_survives_an_engine_restart(tmp_path: Path, model_dir: Path) -> None:
    first = start_engine(tmp_path / "data", model_dir, tmp_path / "first.log")
    try:
        with first.service_client() as service:
            client = service.create_lora_training_client(TINY, rank=4, seed=9).result()
            client.forward_backward(DATA, "cross_entropy")
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            state = client.save_state("step-1").result().path
            sampler_path = client.save_weights_for_sampler("step-1").result().path
            client.forward_backward(DATA, "cross_entropy")
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            expected = client.forward(DATA, "cross_entropy").result().metrics["loss:sum"]
            scored = (
                service.create_sampling_client(model_path=sampler_path)
                .result()
                .compute_logprobs(PROMPT)
                .result()
            )
    finally:
        assert first.stop() == 0, first.log()[-3000:]

    second = start_engine(tmp_path / "data", model_dir, tmp_path / "second.log")
    try:
        with second.service_client() as service:
            rest = second.rest_client()
            assert client.model_id in {
                r.training_run_id for r in rest.list_training_runs().result().training_runs
            }
            listed = {c.tinker_path for c in rest.list_checkpoints(client.model_id).result().checkpoints}
            assert listed == {state, sampler_path}

            resumed = service.create_training_client_from_state_with_optimizer(state).result()
            resumed.forward_backward(DATA, "cross_entropy")
            resumed.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            assert resumed.forward(DATA, "cross_entropy").result().metrics["loss:sum"] == pytest.approx(
                expected, abs=1e-5
            )

            again = (
                service.create_sampling_client(model_path=sampler_path)
                .result()
                .compute_logprobs(PROMPT)
                .result()
            )
            np.testing.assert_allclose(np.asarray(again[1:]), np.asarray(scored[1:]), atol=1e-6)
    finally:
        assert second.stop() == 0, second.log()[-3000:]
