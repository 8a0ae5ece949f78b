"""The sampler cache past its size: new sampler weights of the cached adapters' layout are copied over the
least recently sampled adapter instead of loaded as a new one (compute/sampling.py), and sample exactly as
the same weights loaded afresh."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch
from safetensors.torch import load_file

from tinkerrpc_server.engine.compute.samples import SampleJob
from tinkerrpc_server.engine.runtime import SAMPLER_CACHE_SIZE, BaseModelRuntime, LoraSpec

pytestmark = pytest.mark.unit

PROMPT = [5, 17, 42, 9, 3, 11]


def greedy(runtime: BaseModelRuntime, weights: Path) -> tuple[list[int], list[float]]:
    job = SampleJob(PROMPT, num_samples=1, max_tokens=6, temperature=0.0, stop_token_ids=[], seed=0)
    sequence = runtime.sample(weights, [job])[0].sequences[0]
    return sequence.tokens, sequence.logprobs


def last_loaded(runtime: BaseModelRuntime) -> str:
    """The adapter of the sampler weights sampled last."""
    return runtime._sampler_adapters[next(reversed(runtime._sampler_adapters))]


def save_versions(runtime: BaseModelRuntime, directory: Path, count: int) -> list[Path]:
    """`count` sampler weights of one LoRA, each with weights of its own."""
    runtime.create_adapter("policy", LoraSpec(rank=4, seed=1))
    versions = []
    for index in range(count):
        generator = torch.Generator().manual_seed(100 + index)
        with torch.no_grad():
            for param in runtime.adapter_parameters("policy").values():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.3)
        versions.append(directory / f"v{index}")
        runtime.save_state("policy", versions[-1], include_optimizer=False)
    return versions


def test_versions_past_the_cache_reuse_an_adapter_and_sample_as_loaded_afresh(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    runtime = BaseModelRuntime(tiny_model_path, device="cpu")
    versions = save_versions(runtime, tmp_path, SAMPLER_CACHE_SIZE + 2)
    assert runtime._peft is not None
    adapters_before = len(runtime._peft.peft_config)
    outputs, names = {}, {}
    for version in versions:
        outputs[version] = greedy(runtime, version)
        names[version] = last_loaded(runtime)
    # The first SAMPLER_CACHE_SIZE versions were loaded as adapters; the two past it took the places of
    # the two least recently sampled.
    assert len(runtime._peft.peft_config) == adapters_before + SAMPLER_CACHE_SIZE
    assert [names[v] for v in versions[-2:]] == [names[v] for v in versions[:2]]
    reloaded = versions[0]  # left the cache; it comes back in the place of versions[2]
    outputs_again = greedy(runtime, reloaded)
    assert last_loaded(runtime) == names[versions[2]]
    assert len(runtime._peft.peft_config) == adapters_before + SAMPLER_CACHE_SIZE
    saved = load_file(reloaded / "adapter_model.safetensors")
    loaded = runtime._peft_parameters(last_loaded(runtime))
    assert sorted(loaded) == sorted(saved)
    assert all(torch.equal(param, saved[key]) for key, param in loaded.items())

    fresh = BaseModelRuntime(tiny_model_path, device="cpu")
    for version in (versions[-2], versions[-1], reloaded):
        tokens, logprobs = greedy(fresh, version)
        got_tokens, got_logprobs = outputs_again if version == reloaded else outputs[version]
        assert got_tokens == tokens
        assert got_logprobs == pytest.approx(logprobs, abs=1e-6)
    # Versions differ from one another: a stale decoder or adapter would show.
    assert len({tuple(tokens) for tokens, _ in outputs.values()}) > 1


def test_a_version_of_another_layout_is_loaded_as_an_adapter_of_its_own(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    runtime = BaseModelRuntime(tiny_model_path, device="cpu")
    versions = save_versions(runtime, tmp_path, SAMPLER_CACHE_SIZE)
    for version in versions:
        greedy(runtime, version)
    runtime.create_adapter("wider", LoraSpec(rank=8, seed=2, train_mlp=False))
    runtime.save_state("wider", tmp_path / "wider", include_optimizer=False)
    assert runtime._peft is not None
    adapters_before = len(runtime._peft.peft_config)
    tokens, logprobs = greedy(runtime, tmp_path / "wider")
    # The least recently sampled adapter (rank 4) went; the rank-8 one was loaded in its stead.
    assert len(runtime._peft.peft_config) == adapters_before
    fresh = BaseModelRuntime(tiny_model_path, device="cpu")
    assert greedy(fresh, tmp_path / "wider") == (tokens, pytest.approx(logprobs, abs=1e-6))


def test_a_decoder_kept_for_overwritten_weights_is_not_used_for_the_new_ones(
    tiny_model_path: Path, tmp_path: Path
) -> None:
    """The decoder of the weights sampled last is kept (its merged layers are built once); when their
    adapter, pushed to the cache's end by loads that sampled nothing, takes new weights, it goes."""
    runtime = BaseModelRuntime(tiny_model_path, device="cpu")
    versions = save_versions(runtime, tmp_path, SAMPLER_CACHE_SIZE + 1)
    newest = versions.pop()
    kept = versions[0]
    greedy(runtime, kept)
    for version in versions[1:]:
        runtime._sampler_adapter(version)
    assert runtime._last_decoder is not None and runtime._last_decoder[0] == names_of(runtime)[0]
    tokens, logprobs = greedy(runtime, newest)
    fresh = BaseModelRuntime(tiny_model_path, device="cpu")
    assert greedy(fresh, newest) == (tokens, pytest.approx(logprobs, abs=1e-6))
    assert greedy(fresh, kept) != (tokens, pytest.approx(logprobs, abs=1e-6))


def names_of(runtime: BaseModelRuntime) -> list[str]:
    """The cached sampler adapters, least recently sampled first."""
    return list(runtime._sampler_adapters.values())
