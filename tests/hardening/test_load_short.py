"""A short run of bench/load.py against the shared hosted server: concurrent samplers and a trainer on one
model for a few seconds, with zero errors, training progress and ordered latency percentiles."""

from __future__ import annotations

import asyncio
import math

import pytest
from hardening_support import HostedServer

from bench.load import run_load

pytestmark = pytest.mark.process

SECONDS = 10.0
SAMPLERS = 3


def test_short_load_has_zero_errors_and_sane_percentiles(hosted_server: HostedServer) -> None:
    server = hosted_server.server
    result = asyncio.run(run_load(f"127.0.0.1:{server.port}", SECONDS, SAMPLERS, model="load-short"))
    print("\n" + result.markdown())
    assert result.errors == 0, result.markdown()
    sample, train = result.stats["Sample"], result.stats["Train"]
    # The trainer stepped while the samplers ran, and every step made one policy version.
    assert train.requests >= 1 and result.final_version == train.requests
    assert sample.requests > train.requests
    for stats in (sample, train):
        p50, p99 = stats.percentile(50), stats.percentile(99)
        assert 0 < p50 <= p99 < math.inf
        assert p99 <= max(stats.latencies) and p50 >= min(stats.latencies)
    assert result.as_dict()["rpcs"]["Sample"]["requests"] == sample.requests
