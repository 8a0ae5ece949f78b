"""The chunked target-logprob unembedding equals log_softmax(model(...).logits).gather(target), value and
gradients, with and without a LoRA on lm_head, over several chunks, with logits kept or recomputed."""

from __future__ import annotations

import pytest
import torch
from peft import LoraConfig, get_peft_model
from transformers import Qwen3Config, Qwen3ForCausalLM

from tinkerrpc_server.engine.compute import unembedding

pytestmark = pytest.mark.unit

VOCAB = 300


def _model(lora_targets: list[str] | None) -> torch.nn.Module:
    config = Qwen3Config(
        vocab_size=VOCAB,
        hidden_size=32,
        num_hidden_layers=1,
        num_attention_heads=2,
        num_key_value_heads=1,
        head_dim=16,
        intermediate_size=64,
        tie_word_embeddings=True,
    )
    torch.manual_seed(0)
    model: torch.nn.Module = Qwen3ForCausalLM(config).eval()
    for param in model.parameters():
        param.requires_grad_(False)
    if lora_targets is None:
        model.get_output_embeddings().weight.requires_grad_(True)  # a trained unembedding, no LoRA
        return model
    model = get_peft_model(model, LoraConfig(r=4, lora_alpha=32, target_modules=lora_targets))
    with torch.no_grad():  # B = 0 at init would hide the LoRA term
        for name, param in model.named_parameters():
            if "lora_B" in name:
                param.normal_(std=0.1)
    return model


def _batch() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    generator = torch.Generator().manual_seed(1)
    lengths = [9, 4, 7]
    tokens = torch.randint(0, VOCAB, (len(lengths), max(lengths)), generator=generator)
    mask = torch.zeros_like(tokens)
    for row, n in enumerate(lengths):
        mask[row, :n] = 1
    targets = torch.randint(0, VOCAB, (sum(lengths),), generator=generator)
    return tokens, mask, targets


def _value_and_grads(
    model: torch.nn.Module, logprobs: torch.Tensor, weights: torch.Tensor
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    (logprobs * weights).sum().backward()
    grads = {}
    for name, param in model.named_parameters():
        if param.grad is not None:
            grads[name] = param.grad.clone()
            param.grad = None
    return logprobs.detach(), grads


@pytest.mark.parametrize("lora_targets", [["lm_head", "q_proj"], ["q_proj"], None])
@pytest.mark.parametrize("keep_logits", [True, False])
def test_chunked_target_logprobs_equal_the_plain_computation(
    lora_targets: list[str] | None, keep_logits: bool, monkeypatch: pytest.MonkeyPatch
) -> None:
    model = _model(lora_targets)
    tokens, mask, targets = _batch()
    weights = torch.linspace(-1.0, 2.0, len(targets))
    logits = model(input_ids=tokens, attention_mask=mask, use_cache=False).logits
    plain = (
        torch.log_softmax(logits[mask.bool()].float(), dim=-1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    )
    expected, expected_grads = _value_and_grads(model, plain, weights)

    monkeypatch.setattr(unembedding, "CHUNK_LOGITS_BYTES", 4 * VOCAB * 3)  # 3 positions a chunk
    if not keep_logits:
        monkeypatch.setattr(unembedding, "SAVED_LOGITS_BYTES", 4 * VOCAB)  # recomputed in backward
    causal_lm = model.get_base_model() if lora_targets else model
    assert unembedding._plain_unembedding(causal_lm) is not None  # the chunked path, not the fallback
    chunked = unembedding.target_logprobs(model, tokens, mask, targets)
    got, got_grads = _value_and_grads(model, chunked, weights)

    torch.testing.assert_close(got, expected, atol=1e-5, rtol=1e-5)
    assert sorted(got_grads) == sorted(expected_grads) and expected_grads
    for name, grad in expected_grads.items():
        torch.testing.assert_close(got_grads[name], grad, atol=1e-5, rtol=1e-4, msg=name)
    with torch.no_grad():
        torch.testing.assert_close(unembedding.target_logprobs(model, tokens, mask, targets), expected)
