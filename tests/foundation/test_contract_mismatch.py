"""The sampler/learner mismatch bounds are contract constants: in the limits table, around a ratio of 1,
and named by the proto field that counts past them."""

from __future__ import annotations

from pathlib import Path

import pytest

from tinkerrpc.contract import limits
from tinkerrpc.v1 import types_pb2

pytestmark = pytest.mark.unit

ROOT = Path(__file__).resolve().parents[2]


def test_the_ratio_bounds_are_constants_of_the_limits_table_around_one() -> None:
    rows = {limit.name: limit for limit in limits.LIMITS}
    for name in ("MISMATCH_RATIO_MIN", "MISMATCH_RATIO_MAX"):
        assert rows[name].kind == "constant" and rows[name].value == getattr(limits, name)
        assert "outside_fraction" in rows[name].bounds
    assert 0 < limits.MISMATCH_RATIO_MIN < 1 < limits.MISMATCH_RATIO_MAX


def test_the_proto_names_the_bounds_and_the_estimator() -> None:
    proto = (ROOT / "protos/tinkerrpc/v1/types.proto").read_text()
    message = proto[proto.index("message SamplerMismatch") :]
    message = message[: message.index("\n}\n")]
    assert "MISMATCH_RATIO_MIN" in message and "MISMATCH_RATIO_MAX" in message and "k3" in message
    assert [f.name for f in types_pb2.SamplerMismatch.DESCRIPTOR.fields] == [
        "kl",
        "mean_ratio",
        "max_ratio",
        "outside_fraction",
        "tokens",
        "capped_fraction",
        "ratio_cap",
    ]
