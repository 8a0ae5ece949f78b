"""A step's loss when the backend reports no `loss:sum` metric (Tinker and our engine do; other
Tinker-compatible engines may not): the same sum the engine computes for the loss in use
(engine/losses.py), here as plain numpy over the per-token logprobs the backend returned in
forward_backward's `loss_fn_outputs` and the datums' loss inputs. Summed over tokens and datums, never
averaged; values only (no gradient), so a detached factor is just its value. `[N, K]` soft targets need
no formula of their own: their logprobs and inputs are flattened alike (sparse inputs densified as the
SDK does), and the elementwise sum is the engine's. The formulas are written twice (torch there, numpy
here) because the service never imports the engine; tests/engine/test_step_loss_parity.py keeps them equal."""

from __future__ import annotations

import math
from collections.abc import Callable, Mapping, Sequence

import numpy as np
import numpy.typing as npt
import tinker

from tinkerrpc.contract.losses import LOSS_BY_NAME

Floats = npt.NDArray[np.float64]
LossOfDatum = Callable[[Floats, Mapping[str, Floats], Mapping[str, float]], float]


def _clipped_surrogate(ratio: Floats, advantages: Floats, config: Mapping[str, float]) -> float:
    clipped = np.clip(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    return float(-np.minimum(ratio * advantages, clipped * advantages).sum())


def _cross_entropy(lp: Floats, inputs: Mapping[str, Floats], config: Mapping[str, float]) -> float:
    return float(-(lp * inputs["weights"]).sum())


def _importance_sampling(lp: Floats, inputs: Mapping[str, Floats], config: Mapping[str, float]) -> float:
    return float(-(np.exp(lp - inputs["logprobs"]) * inputs["advantages"]).sum())


def _ppo(lp: Floats, inputs: Mapping[str, Floats], config: Mapping[str, float]) -> float:
    return _clipped_surrogate(np.exp(lp - inputs["logprobs"]), inputs["advantages"], config)


def _cispo(lp: Floats, inputs: Mapping[str, Floats], config: Mapping[str, float]) -> float:
    ratio = np.exp(lp - inputs["logprobs"])
    weight = np.clip(ratio, config["clip_low_threshold"], config["clip_high_threshold"])
    return float(-(weight * lp * inputs["advantages"]).sum())


def _dro(lp: Floats, inputs: Mapping[str, Floats], config: Mapping[str, float]) -> float:
    drift = lp - inputs["logprobs"]
    return float(-(lp * inputs["advantages"] - 0.5 * config["beta"] * drift**2).sum())


def _gspo(lp: Floats, inputs: Mapping[str, Floats], config: Mapping[str, float]) -> float:
    in_ratio = inputs["sequence_ratio_mask"] != 0
    sequence_log_ratio = float((lp - inputs["logprobs"])[in_ratio].mean())
    ratio = np.full_like(lp, math.exp(sequence_log_ratio))
    return _clipped_surrogate(ratio, inputs["advantages"], config)


def _stable_reinforce(lp: Floats, inputs: Mapping[str, Floats], config: Mapping[str, float]) -> float:
    log_ratio = lp - inputs["logprobs"]
    ratio = np.exp(log_ratio)
    kl = ratio - 1 - log_ratio
    return float(-(ratio * lp * inputs["advantages"] - config["kl_coeff"] * kl).sum())


# Keyed by the contract's loss names (tinkerrpc.contract.losses).
LOSS_OF_DATUM: dict[str, LossOfDatum] = {
    "cross_entropy": _cross_entropy,
    "importance_sampling": _importance_sampling,
    "ppo": _ppo,
    "cispo": _cispo,
    "dro": _dro,
    "gspo": _gspo,
    "stable_reinforce": _stable_reinforce,
}


def loss_from_logprobs(
    loss_fn: str,
    config: Mapping[str, float] | None,
    datums: Sequence[tinker.types.Datum],
    loss_fn_outputs: Sequence[Mapping[str, tinker.types.TensorData]],
) -> float:
    """The summed loss of `datums` from the backend's per-datum `logprobs` outputs; NaN when the
    backend returned none (or not one per datum, or of the wrong length): nothing to compute it from."""
    loss_of_datum = LOSS_OF_DATUM.get(loss_fn)
    if loss_of_datum is None or len(loss_fn_outputs) != len(datums):
        return math.nan
    resolved = {**LOSS_BY_NAME[loss_fn].defaults(), **(config or {})}
    total = 0.0
    for datum, outputs in zip(datums, loss_fn_outputs, strict=True):
        returned = outputs.get("logprobs")
        if returned is None:
            return math.nan
        lp = np.asarray(returned.to_numpy(), dtype=np.float64).reshape(-1)
        inputs = {
            k: np.asarray(v.to_numpy(), dtype=np.float64).reshape(-1) for k, v in datum.loss_fn_inputs.items()
        }
        if any(len(values) != len(lp) for key, values in inputs.items() if key != "target_tokens"):
            return math.nan
        total += loss_of_datum(lp, inputs, resolved)
    return total
