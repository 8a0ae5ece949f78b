"""An RL step's sampler/learner mismatch (TrainMetrics.sampler_mismatch), from the per-token logprobs the
backend returned in forward_backward's `loss_fn_outputs` and the sampler's logprobs in the datums' loss
inputs, over the sampled positions only (Batch.sampled_masks: prompts, tool results and template tokens
between merged turns carry a logprob of 0 there, which is no sampler's). The KL is the k3 estimator of
KL(sampler || learner), mean(exp(d) − 1 − d) with d = learner − sampler: the tokens were drawn from the
sampler, so it is unbiased, never negative, and of lower variance than the mean of −d."""

from __future__ import annotations

from collections.abc import Mapping, Sequence

import numpy as np
import numpy.typing as npt
import tinker

from tinkerrpc.contract.limits import MISMATCH_RATIO_MAX, MISMATCH_RATIO_MIN
from tinkerrpc.v1 import types_pb2

Floats = npt.NDArray[np.float64]


def mismatch_of(log_ratio: Floats, ratio_cap: float | None = None) -> types_pb2.SamplerMismatch:
    """The figures of the sampled tokens' log importance ratios d = learner − sampler (at least one), and
    with a truncated-importance-sampling cap the fraction of them past it."""
    # A ratio past float64 (d > 709) is reported as infinite: such a logprob is no sampler's.
    with np.errstate(over="ignore"):
        ratio = np.exp(log_ratio)
    return types_pb2.SamplerMismatch(
        kl=float(np.mean(ratio - 1.0 - log_ratio)),
        mean_ratio=float(np.mean(ratio)),
        max_ratio=float(np.max(ratio)),
        outside_fraction=float(np.mean((ratio < MISMATCH_RATIO_MIN) | (ratio > MISMATCH_RATIO_MAX))),
        tokens=len(log_ratio),
        capped_fraction=float(np.mean(ratio > ratio_cap)) if ratio_cap is not None else 0.0,
        ratio_cap=ratio_cap or 0.0,
    )


def sampler_mismatch(
    datums: Sequence[tinker.types.Datum],
    sampled_masks: Sequence[Sequence[bool]],
    loss_fn_outputs: Sequence[Mapping[str, tinker.types.TensorData]],
    ratio_cap: float | None = None,
) -> types_pb2.SamplerMismatch | None:
    """The step's mismatch over its sampled positions; None for a step without any (supervised) or when
    the backend returned no per-token logprobs (or not one array per datum, of the datum's length)."""
    if len(loss_fn_outputs) != len(datums) or len(sampled_masks) != len(datums):
        return None
    log_ratios = []
    for datum, mask, outputs in zip(datums, sampled_masks, loss_fn_outputs, strict=True):
        if not any(mask):
            continue
        returned = outputs.get("logprobs")
        if returned is None:
            return None
        learner = np.asarray(returned.to_numpy(), dtype=np.float64).reshape(-1)
        sampler = np.asarray(datum.loss_fn_inputs["logprobs"].to_numpy(), dtype=np.float64).reshape(-1)
        if len(learner) != len(mask) or len(sampler) != len(mask):
            return None
        log_ratios.append((learner - sampler)[np.asarray(mask, dtype=bool)])
    if not log_ratios:
        return None
    return mismatch_of(np.concatenate(log_ratios), ratio_cap)
