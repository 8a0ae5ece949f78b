"""The service's loss fallback (service/step_loss.py, numpy) gives the value the engine's losses
(engine/losses.py, torch) give for the same logprobs and loss inputs, for every loss the engine offers."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from tinker import types

from tinkerrpc_server.engine.losses import LOSSES, resolve_config
from tinkerrpc_server.service.step_loss import LOSS_OF_DATUM, loss_from_logprobs

pytestmark = pytest.mark.unit

CONFIGS: dict[str, dict[str, float]] = {
    "ppo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "cispo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "gspo": {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1},
    "dro": {"beta": 0.3},
    "stable_reinforce": {"kl_coeff": 0.2},
}


def test_the_fallback_covers_every_engine_loss() -> None:
    assert set(LOSS_OF_DATUM) == set(LOSSES)


@pytest.mark.parametrize("loss_fn", sorted(LOSSES))
def test_the_fallback_equals_the_engines_loss(loss_fn: str) -> None:
    rng = np.random.default_rng(3)
    config = CONFIGS.get(loss_fn)
    datums, outputs, expected = [], [], 0.0
    for length in (5, 8):
        learner = -rng.uniform(0.1, 3.0, length)
        inputs = {
            "target_tokens": rng.integers(0, 100, length).astype(np.float64),
            "weights": rng.integers(0, 2, length).astype(np.float64),
            "logprobs": learner + rng.normal(0, 0.3, length),
            "advantages": rng.normal(0, 1, length),
            "sequence_ratio_mask": np.r_[0.0, np.ones(length - 1)],
        }
        used = {k: v for k, v in inputs.items() if k in ("target_tokens", *LOSSES[loss_fn].float_inputs)}
        tensors = {k: torch.tensor(v, dtype=torch.float64) for k, v in used.items()}
        lp = torch.tensor(learner, dtype=torch.float64)
        expected += float(LOSSES[loss_fn].fn(lp, tensors, resolve_config(loss_fn, config)))
        datums.append(
            types.Datum(
                model_input=types.ModelInput.from_ints(list(range(length))),
                loss_fn_inputs={
                    k: types.TensorData(data=v.tolist(), dtype="float32", shape=[length])
                    for k, v in used.items()
                },
            )
        )
        outputs.append({"logprobs": types.TensorData(data=learner.tolist(), dtype="float32", shape=[length])})
    assert loss_from_logprobs(loss_fn, config, datums, outputs) == pytest.approx(expected, rel=1e-4)


def test_without_returned_logprobs_the_loss_is_unknown() -> None:
    datum = types.Datum(
        model_input=types.ModelInput.from_ints([1, 2]),
        loss_fn_inputs={"weights": types.TensorData(data=[1.0, 1.0], dtype="float32", shape=[2])},
    )
    assert np.isnan(loss_from_logprobs("cross_entropy", None, [datum], []))
    assert np.isnan(loss_from_logprobs("cross_entropy", None, [datum], [{}]))
