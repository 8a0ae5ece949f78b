"""Two models on one engine share its compute thread: a small model's requests are answered while a
large model's long batch runs, instead of after it (engine/fair_share.py), through the real tinker SDK."""

from __future__ import annotations

import statistics
import time
from collections.abc import Iterator

import pytest
import tinker
from engine_proc import TINY, smollm2_engine
from smollm2_support import SMOLLM2
from tinker import types

from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.process

PROMPT = types.ModelInput.from_ints([5, 6, 7, 8])
SMALL = types.SamplingParams(max_tokens=16, seed=3, stop=[])
# 16 rows decoding until told to stop: on this machine about 16 steps/s, so it runs for well over a
# minute unless abandoned.
LONG = types.SamplingParams(max_tokens=2048, seed=1, stop=[])
TIMEOUT = 300.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    yield from smollm2_engine(tmp_path_factory, "fair-share")


def _latency(sampler: tinker.SamplingClient) -> float:
    started = time.perf_counter()
    response = sampler.sample(PROMPT, 1, SMALL).result(timeout=TIMEOUT)
    assert len(response.sequences[0].tokens) == 16
    return time.perf_counter() - started


def test_a_small_model_is_answered_while_a_large_model_s_long_batch_runs(engine: LocalEngine) -> None:
    with engine.service_client() as service:
        tiny = service.create_sampling_client(base_model=TINY).result()
        large = service.create_sampling_client(base_model=SMOLLM2).result()
        large.sample(PROMPT, 1, types.SamplingParams(max_tokens=2)).result(timeout=TIMEOUT)  # loaded
        alone = statistics.median(_latency(tiny) for _ in range(3))
        before = engine.stats()
        long_batch = large.sample(PROMPT, 16, LONG).future()
        deadline = time.monotonic() + TIMEOUT
        while engine.stats()["decode_steps"] - before["decode_steps"] < 3:  # the long batch decodes
            assert time.monotonic() < deadline, "the long batch never started decoding"
            time.sleep(0.05)
        during = [_latency(tiny) for _ in range(3)]
        still_running = not long_batch.done()
        # A finished request is answered within its last step, and the rows gauge drops at that step's
        # end: wait (bounded) for tiny-chat's rows to leave it.
        while TINY in (after := engine.stats())["decoding_rows"]:
            assert time.monotonic() < deadline, "tiny-chat's answered rows stayed in the gauge"
            time.sleep(0.01)
        assert long_batch.cancel()  # its caller gives up: the batch stops decoding
        while engine.stats()["decoding_rows"]:
            assert time.monotonic() < deadline, "the abandoned batch kept decoding"
            time.sleep(0.05)
    print(
        f"tiny-chat 16 tokens: {alone:.3f} s alone, {[round(d, 3) for d in during]} s during SmolLM2 16 rows"
    )
    assert still_running, "the small model's requests were answered only after the long batch"
    # Each waited about one SmolLM2 step (16 rows) per turn it gave up, not the batch's whole length.
    assert max(during) < alone + 5.0, (alone, during)
    assert after["sample_turns_to_other_models"] > before["sample_turns_to_other_models"]
    # The gauge is per base model: tiny-chat's batches ending left SmolLM2's 16 rows counted.
    assert after["decoding_rows"] == {SMOLLM2: 16}
