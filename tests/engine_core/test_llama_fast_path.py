"""The Llama family on the engine's fast path: how architecture.describe reads a model (and which models
it declines, so transformers runs them), a rotary variant, and the real SmolLM2-135M-Instruct: its
sampler logits, learner logprobs and LoRA gradients equal transformers + PEFT's, and its greedy tokens
through the engine's sampler are transformers' for 64 tokens."""

from __future__ import annotations

from pathlib import Path
from typing import Any

import pytest
from decoder_parity import (
    assert_decoder_logits_equal_transformers,
    assert_greedy_sampling_equals_transformers,
    assert_training_forward_equals_transformers,
    build_tiny_llama,
    decoder_of,
    perturb_adapter,
    run_forward,
)
from smollm2_support import SMOLLM2, smollm2_model_dir
from transformers import LlamaConfig, LlamaForCausalLM, MistralConfig, MistralForCausalLM

from tinkerrpc_server.engine.compute.architecture import Architecture, describe
from tinkerrpc_server.engine.compute.decoder import FusedDecoder, FusedTrainingForward
from tinkerrpc_server.engine.compute.fused_weights import fuse_base_weights
from tinkerrpc_server.engine.runtime import BaseModelRuntime, LoraSpec

pytestmark = pytest.mark.process

TINY_LLAMA: dict[str, Any] = {
    "vocab_size": 128,
    "hidden_size": 64,
    "intermediate_size": 128,
    "num_hidden_layers": 2,
    "num_attention_heads": 4,
    "num_key_value_heads": 2,
    "tie_word_embeddings": True,
    "rope_parameters": {"rope_type": "default", "rope_theta": 1e5},
}


def test_a_llama_is_described_from_its_config_and_modules() -> None:
    model = LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, rms_norm_eps=1e-5))
    assert describe(model) == Architecture(
        num_heads=4,
        num_kv_heads=2,
        head_dim=16,
        qk_norm=False,
        tied_embeddings=True,
        rope_type="default",
        rope_theta=1e5,
        activation="silu",
        norm_eps=1e-5,
    )


@pytest.mark.parametrize(
    "model",
    [
        pytest.param(lambda: MistralForCausalLM(MistralConfig(**TINY_LLAMA)), id="another family"),
        pytest.param(lambda: LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, attention_bias=True)), id="biases"),
        pytest.param(lambda: LlamaForCausalLM(LlamaConfig(**TINY_LLAMA, mlp_bias=True)), id="mlp biases"),
        pytest.param(
            lambda: LlamaForCausalLM(
                LlamaConfig(
                    **{
                        **TINY_LLAMA,
                        "rope_parameters": {"rope_type": "dynamic", "rope_theta": 1e5, "factor": 2.0},
                    }
                )
            ),
            id="a length-dependent rotary",
        ),
    ],
)
def test_what_the_fast_path_does_not_cover_is_left_to_transformers(model: Any) -> None:
    built = model()
    weights_before = {name: param.data_ptr() for name, param in built.named_parameters()}
    assert describe(built) is None
    assert fuse_base_weights(built) is None
    assert {name: param.data_ptr() for name, param in built.named_parameters()} == weights_before


def test_a_llama3_scaled_rotary_equals_transformers(
    tiny_model_path: Path, tmp_path_factory: pytest.TempPathFactory
) -> None:
    rope = {
        "rope_type": "llama3",
        "rope_theta": 1e4,
        "factor": 8.0,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8,
    }
    path = build_tiny_llama(tmp_path_factory.mktemp("llama3-rope"), tiny_model_path, rope)
    runtime = BaseModelRuntime(path, device="cpu")
    assert runtime._decoder_weights is not None
    assert runtime._decoder_weights.architecture.rope_type == "llama3"
    runtime.create_adapter("policy", LoraSpec(rank=8, seed=1))
    perturb_adapter(runtime, "policy", std=0.1, seed=1)
    sampler_dir = tmp_path_factory.mktemp("llama3-sampler") / "policy"
    runtime.save_state("policy", sampler_dir, include_optimizer=False)
    assert_decoder_logits_equal_transformers(runtime, runtime._sampler_adapter(sampler_dir))


@pytest.fixture(scope="module")
def smollm2(tmp_path_factory: pytest.TempPathFactory) -> BaseModelRuntime:
    return BaseModelRuntime(smollm2_model_dir(tmp_path_factory) / SMOLLM2, device="cpu")


@pytest.fixture(scope="module")
def smollm2_sampler_dir(smollm2: BaseModelRuntime, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """An adapter on every projection and the unembedding, small enough to keep the model's text sane
    but large enough to change its logits (B = 0 at creation would hide it)."""
    smollm2.create_adapter("policy", LoraSpec(rank=8, seed=3))
    perturb_adapter(smollm2, "policy", std=0.02, seed=3)
    directory = tmp_path_factory.mktemp("smollm2-sampler") / "policy"
    smollm2.save_state("policy", directory, include_optimizer=False)
    return directory


def test_smollm2_runs_on_the_fast_path(smollm2: BaseModelRuntime, smollm2_sampler_dir: Path) -> None:
    weights = smollm2._decoder_weights
    assert weights is not None
    architecture = weights.architecture
    assert (architecture.num_heads, architecture.num_kv_heads, architecture.head_dim) == (9, 3, 64)
    assert architecture.tied_embeddings and not architecture.qk_norm
    assert architecture.rope_theta == 1e5
    with smollm2._sampling_model(smollm2_sampler_dir)() as model:
        assert isinstance(model, FusedDecoder)
    assert FusedTrainingForward.build(weights, smollm2._adapters["policy"].peft_name) is not None


def test_smollm2_sampler_logits_equal_transformers(
    smollm2: BaseModelRuntime, smollm2_sampler_dir: Path
) -> None:
    peft_name = smollm2._sampler_adapter(smollm2_sampler_dir)
    assert_decoder_logits_equal_transformers(smollm2, peft_name)
    adapted = run_forward(decoder_of(smollm2, peft_name), steps=0)
    plain = run_forward(decoder_of(smollm2, None), steps=0)
    assert (adapted[1][:, -1] - plain[1][:, -1]).abs().max() > 0.1  # the adapter matters


def test_smollm2_learner_logprobs_and_lora_gradients_equal_transformers(
    smollm2: BaseModelRuntime, smollm2_sampler_dir: Path
) -> None:
    assert_training_forward_equals_transformers(smollm2, "policy")


def test_smollm2_greedy_tokens_equal_transformers(
    smollm2: BaseModelRuntime, smollm2_sampler_dir: Path
) -> None:
    prompt = smollm2.tokenizer.encode(
        "<|im_start|>user\nWhat is 7 + 5? Answer with a number.<|im_end|>\n<|im_start|>assistant\n"
    )
    assert_greedy_sampling_equals_transformers(smollm2, smollm2_sampler_dir, prompt, steps=64)
