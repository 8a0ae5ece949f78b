"""The sampler/learner mismatch computed independently of service/mismatch.py, one token at a time, for
the unit and the process tests of it."""

from __future__ import annotations

import math

from tinkerrpc.contract.limits import MISMATCH_RATIO_MAX, MISMATCH_RATIO_MIN
from tinkerrpc.v1 import types_pb2


def reference_mismatch(learner: list[float], sampler: list[float]) -> dict[str, float]:
    """KL(sampler || learner) by k3 and the importance ratios, one token at a time."""
    ratios = [math.exp(lp - q) for lp, q in zip(learner, sampler, strict=True)]
    k3 = [r - 1 - math.log(r) for r in ratios]
    return {
        "kl": sum(k3) / len(k3),
        "mean_ratio": sum(ratios) / len(ratios),
        "max_ratio": max(ratios),
        "outside_fraction": sum(not MISMATCH_RATIO_MIN <= r <= MISMATCH_RATIO_MAX for r in ratios)
        / len(ratios),
    }


def reported_mismatch(mismatch: types_pb2.SamplerMismatch) -> dict[str, float]:
    return {
        "kl": mismatch.kl,
        "mean_ratio": mismatch.mean_ratio,
        "max_ratio": mismatch.max_ratio,
        "outside_fraction": mismatch.outside_fraction,
    }
