"""The engine's memory stays bounded over a long run, through the real tinker SDK on SmolLM2: sampling
from ever more sampler versions of one LoRA keeps at most SAMPLER_CACHE_SIZE of their adapters loaded
(the least recently sampled go, and come back from disk with the same tokens for a seed), and a training
step's activations do not stay resident once it is answered (engine/compute/heap.py)."""

from __future__ import annotations

from collections.abc import Iterator

import psutil
import pytest
import tinker
from engine_proc import smollm2_engine
from smollm2_support import SMOLLM2
from tinker import types

from tinkerrpc_server.engine.compute.heap import HEAP_SLACK_BYTES
from tinkerrpc_server.engine.runtime import SAMPLER_CACHE_SIZE
from tinkerrpc_server.local.stack import LocalEngine

pytestmark = pytest.mark.process

PROMPT = types.ModelInput.from_ints([1, 2, 3, 4, 5, 6, 7, 8])
SEEDED = types.SamplingParams(max_tokens=8, temperature=1.0, seed=11, stop=[])
# MANY - FEW > SAMPLER_CACHE_SIZE: the first versions leave the cache.
FEW, MANY = 5, 16
# One rank-16 SmolLM2 adapter as loaded for sampling (its safetensors file is 22.8 MB).
ADAPTER_BYTES = 23 * 2**20
# Allocator and Python noise between two RSS readings of an engine doing the same work.
NOISE_BYTES = 128 * 2**20
TIMEOUT = 300.0


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    yield from smollm2_engine(tmp_path_factory, "sampler-memory")


def _rss(engine: LocalEngine) -> int:
    return int(psutil.Process(engine.pid).memory_info().rss)


def _datum(length: int, offset: int) -> types.Datum:
    tokens = [100 + (offset + i) % 4000 for i in range(length + 1)]
    return types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={"target_tokens": tokens[1:], "weights": [1.0] * length},
    )


def _step(client: tinker.TrainingClient, datums: list[types.Datum]) -> None:
    client.forward_backward(datums, "cross_entropy").result(timeout=TIMEOUT)
    client.optim_step(types.AdamParams(learning_rate=1e-2)).result(timeout=TIMEOUT)


def _tokens(service: tinker.ServiceClient, path: str) -> list[int]:
    sampler = service.create_sampling_client(model_path=path).result()
    return list(sampler.sample(PROMPT, 1, SEEDED).result(timeout=TIMEOUT).sequences[0].tokens)


def test_a_training_step_s_activations_do_not_stay_resident(engine: LocalEngine) -> None:
    with engine.service_client() as service:
        client = service.create_lora_training_client(base_model=SMOLLM2, rank=16).result()
        _step(client, [_datum(16, 0)])
        before = _rss(engine)
        # 512 positions: ~1.3 GB of activations and saved logits at SmolLM2's 30 layers and 49,152 logits.
        _step(client, [_datum(64, 64 * i) for i in range(8)])
        assert _rss(engine) - before < HEAP_SLACK_BYTES + NOISE_BYTES


def test_sampling_many_versions_holds_a_bounded_set_of_adapters(engine: LocalEngine) -> None:
    with engine.service_client() as service:
        client = service.create_lora_training_client(base_model=SMOLLM2, rank=16).result()
        paths, tokens, rss = [], [], {}
        for version in range(1, MANY + 1):
            _step(client, [_datum(16, version)])
            paths.append(client.save_weights_for_sampler(f"v{version}").result(timeout=TIMEOUT).path)
            tokens.append(_tokens(service, paths[-1]))
            rss[version] = _rss(engine)
        assert len({tuple(t) for t in tokens}) > 1, "the versions sample differently"
        # From FEW to MANY versions at most SAMPLER_CACHE_SIZE - FEW more adapters stay loaded, and one
        # merged decoder; what malloc keeps free is within its slack.
        held = (SAMPLER_CACHE_SIZE - FEW) * ADAPTER_BYTES
        assert rss[MANY] - rss[FEW] < held + HEAP_SLACK_BYTES + NOISE_BYTES, rss
        # The first version left the cache long ago: it is loaded from disk again, the same weights.
        assert _tokens(service, paths[0]) == tokens[0]
