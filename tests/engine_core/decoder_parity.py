"""What the engine's fused forward (engine/compute/decoder.py) must equal, per model family: checks that
compare it with transformers + PEFT on one BaseModelRuntime, shared by the tiny models' tests
(test_decoder.py) and the real model's (test_llama_fast_path.py)."""

from __future__ import annotations

import copy
from pathlib import Path
from typing import Any

import numpy as np
import torch
from transformers import AutoTokenizer, LlamaConfig, LlamaForCausalLM

from tinkerrpc_server.engine.compute.decoder import FusedDecoder, FusedTrainingForward
from tinkerrpc_server.engine.compute.execution_plan import ExecutionPlan
from tinkerrpc_server.engine.compute.forward_call import ForwardCall, SamplingModel, TransformersSampler
from tinkerrpc_server.engine.compute.kv_cache import new_cache
from tinkerrpc_server.engine.compute.samples import SampleJob
from tinkerrpc_server.engine.runtime import BaseModelRuntime, DatumArrays

# float32 sums taken in another order (fused matmuls, the adapter merged into the weights, LoRA as a
# block-diagonal product) differ by an amount proportional to the values' magnitude: up to ~5e-6 of
# the compared tensor's largest |value| (logits and logprobs, on the tiny models and through
# SmolLM2's 30 layers alike), so each bound is a fraction of that largest |value|.
VALUES_TOLERANCE = 1e-5
GRADIENT_TOLERANCE = 1e-4
# Where a batch is ill-conditioned (the tiny models' large random adapters), float32 LoRA gradients stray
# ~1e-3 from the float64 truth on either side, and how far each strays depends on the CPU's kernels
# (seen on an AVX-only CPU): there ours must be as accurate as transformers' own float32, within this
# factor. A real error (a wrong rotary, scale or mask) is off by order one.
ACCURACY_FACTOR = 3.0
PROMPTS = [[5, 17, 300, 42, 8, 99, 7], [61, 2, 14]]


def assert_close_at_scale(actual: torch.Tensor, expected: torch.Tensor, tolerance: float) -> None:
    """|actual - expected| <= tolerance · max|expected| everywhere."""
    bound = tolerance * float(expected.abs().max()) + 1e-9
    torch.testing.assert_close(actual, expected, atol=bound, rtol=0)


def left_padded_prompts() -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """PROMPTS as one left-padded batch: token ids, attention mask, positions."""
    width = max(len(p) for p in PROMPTS)
    ids = torch.zeros((len(PROMPTS), width), dtype=torch.long)
    mask = torch.zeros_like(ids)
    for row, prompt in enumerate(PROMPTS):
        ids[row, width - len(prompt) :] = torch.tensor(prompt)
        mask[row, width - len(prompt) :] = 1
    return ids, mask, (mask.cumsum(-1) - 1).clamp(min=0)


def run_forward(model: SamplingModel | None, steps: int, first_chunk: int = 4) -> list[torch.Tensor]:
    """Prefill PROMPTS left-padded in two chunks (the first of `first_chunk` columns), then `steps` greedy
    decode steps; every call's logits."""
    assert model is not None
    ids, mask, positions = left_padded_prompts()
    width = ids.shape[1]
    cache = new_cache()
    seen = []
    with torch.inference_mode():
        for start, end in ((0, first_chunk), (first_chunk, width)):
            call = ForwardCall(ids[:, start:end], mask[:, :end], positions[:, start:end], cache)
            (logits,) = model.forward([call])
            seen.append(logits.float())
        last = positions[:, -1:]
        for _ in range(steps):
            token = seen[-1][:, -1].argmax(-1, keepdim=True)
            mask = torch.cat([mask, torch.ones_like(token)], dim=-1)
            last = last + 1
            (logits,) = model.forward([ForwardCall(token, mask, last, cache)])
            seen.append(logits.float())
    return seen


def decoder_of(
    runtime: BaseModelRuntime, peft_name: str | None, plan: ExecutionPlan | None = None
) -> FusedDecoder:
    """The sampler's decoder for `peft_name` (None: the bare base) with `plan`'s kernels (None: the
    runtime's)."""
    decoder = FusedDecoder.build(
        runtime._decoder_weights, peft_name, plan if plan is not None else runtime._plan
    )
    assert decoder is not None
    return decoder


def assert_decoder_logits_equal_transformers(
    runtime: BaseModelRuntime, peft_name: str | None, plan: ExecutionPlan | None = None, first_chunk: int = 4
) -> None:
    """The sampler's decoder for `peft_name` (None: the bare base), with `plan`'s kernels (None: the
    runtime's), against transformers + PEFT: a left-padded prefill in two chunks (the first of
    `first_chunk` columns) and 5 decode steps."""
    ours = run_forward(decoder_of(runtime, peft_name, plan), steps=5, first_chunk=first_chunk)
    with runtime._active(peft_name) as reference:
        theirs = run_forward(TransformersSampler(reference), steps=5, first_chunk=first_chunk)
    assert len(ours) == len(theirs) == 7
    for mine, expected in zip(ours, theirs, strict=True):
        # Left-padding positions of the prefill carry no meaning on either side: compare real ones.
        assert mine.shape == expected.shape
        assert torch.isfinite(mine).all()
    for row, prompt in enumerate(PROMPTS):
        pad = max(len(p) for p in PROMPTS) - len(prompt)
        prefill_ours = torch.cat([ours[0], ours[1]], dim=1)[row, pad:]
        prefill_theirs = torch.cat([theirs[0], theirs[1]], dim=1)[row, pad:]
        assert_close_at_scale(prefill_ours, prefill_theirs, VALUES_TOLERANCE)
        for mine, expected in zip(ours[2:], theirs[2:], strict=True):
            assert_close_at_scale(mine[row], expected[row], VALUES_TOLERANCE)


def assert_training_forward_equals_transformers(runtime: BaseModelRuntime, model_id: str) -> None:
    """The learner's own forward: the same target logprobs and LoRA gradients as transformers + PEFT on a
    right-padded batch of different lengths (what forward_backward runs)."""
    params = runtime.adapter_parameters(model_id)
    peft_name = runtime._adapters[model_id].peft_name
    forward = FusedTrainingForward.build(runtime._decoder_weights, peft_name)
    assert forward is not None
    rng = np.random.default_rng(0)
    sequences = [rng.integers(0, runtime.vocab_size, n) for n in (9, 23, 16)]
    data = [
        DatumArrays(s[:-1], {"target_tokens": s[1:], "weights": np.ones(len(s) - 1, np.float32)})
        for s in sequences
    ]
    _, prepared = runtime._validate_batch(data, "cross_entropy", None)
    outcomes = []
    for chosen in (None, forward):
        for param in params.values():
            param.grad = None
        with runtime._active(peft_name) as model, torch.enable_grad():
            logprobs = torch.cat(runtime._target_logprobs(model, chosen, prepared))
            # Weighted so every position's gradient counts differently.
            (logprobs * torch.linspace(0.5, 1.5, len(logprobs))).sum().backward()
        outcomes.append((logprobs.detach(), {name: _gradient(param) for name, param in params.items()}))
    for param in params.values():
        param.grad = None
    (reference, reference_grads), (ours, our_grads) = outcomes
    assert_close_at_scale(ours, reference, VALUES_TOLERANCE)
    assert all(grad.abs().max() > 0 for grad in reference_grads.values())
    exact: dict[str, torch.Tensor] | None = None
    for name, grad in reference_grads.items():
        bound = GRADIENT_TOLERANCE * float(grad.abs().max())
        if float((our_grads[name] - grad).abs().max()) <= bound:
            continue
        exact = exact if exact is not None else _float64_gradients(runtime, peft_name, sequences)
        truth = exact[name]
        their_error, our_error = (float((g.double() - truth).abs().max()) for g in (grad, our_grads[name]))
        assert our_error <= ACCURACY_FACTOR * their_error, (name, our_error, their_error)


def _float64_gradients(
    runtime: BaseModelRuntime, peft_name: str, sequences: list[np.ndarray]
) -> dict[str, torch.Tensor]:
    """The LoRA gradients of the same weighted target logprobs as above, by transformers + PEFT on a
    float64 copy of the model, one unpadded sequence at a time: the truth both float32 sides approximate."""
    assert runtime._peft is not None
    model = copy.deepcopy(runtime._peft).double()
    model.set_adapter(peft_name)
    prefix = f".{peft_name}."
    logprobs = []
    with torch.enable_grad():
        for sequence in sequences:
            tokens = torch.tensor(sequence)
            logits = model(input_ids=tokens[None, :-1]).logits[0]
            logprobs.append(logits.log_softmax(-1).gather(-1, tokens[1:, None])[:, 0])
        joined = torch.cat(logprobs)
        (joined * torch.linspace(0.5, 1.5, len(joined), dtype=torch.float64)).sum().backward()
    return {
        name.replace(prefix, "."): _gradient(param)
        for name, param in model.named_parameters()
        if prefix in name
    }


def _gradient(param: torch.Tensor) -> torch.Tensor:
    assert param.grad is not None
    return param.grad.clone()


def transformers_greedy_tokens(model: Any, prompt: list[int], steps: int) -> list[int]:
    """`steps` argmax tokens after `prompt`, one transformers call per token over its KV cache."""
    cache = new_cache()
    ids = torch.tensor([prompt])
    tokens: list[int] = []
    with torch.inference_mode():
        for _ in range(steps):
            out = model(input_ids=ids, past_key_values=cache, use_cache=True)
            cache = out.past_key_values
            tokens.append(int(out.logits[0, -1].argmax()))
            ids = torch.tensor([[tokens[-1]]])
    return tokens


def assert_greedy_sampling_equals_transformers(
    runtime: BaseModelRuntime, weights_dir: Path, prompt: list[int], steps: int
) -> None:
    """Temperature-0 sampling through the engine (its decoder) gives transformers + PEFT's argmax tokens."""
    (output,) = runtime.sample(weights_dir, [SampleJob(prompt, 1, steps, temperature=0.0, stop_token_ids=[])])
    with runtime._active(runtime._sampler_adapter(weights_dir)) as model:
        expected = transformers_greedy_tokens(model, prompt, steps)
    assert output.sequences[0].tokens == expected


def perturb_adapter(runtime: BaseModelRuntime, model_id: str, std: float, seed: int) -> None:
    """Give every LoRA factor Gaussian weights (B = 0 at creation would hide the adapter)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in runtime.adapter_parameters(model_id).values():
            param.copy_(torch.randn(param.shape, generator=generator) * std)


def build_tiny_llama(directory: Path, tokenizer_source: Path, rope_parameters: dict[str, Any]) -> Path:
    """A random-initialised LlamaForCausalLM (grouped heads, tied embeddings) in HF layout, with the
    tokenizer of `tokenizer_source`, at `directory`."""
    tokenizer = AutoTokenizer.from_pretrained(tokenizer_source)
    config = LlamaConfig(
        vocab_size=len(tokenizer),
        hidden_size=64,
        intermediate_size=192,
        num_hidden_layers=2,
        num_attention_heads=4,
        num_key_value_heads=2,
        max_position_embeddings=2048,
        initializer_range=0.1,  # logits of a few units, as a trained model has
        tie_word_embeddings=True,
        rope_parameters=rope_parameters,
        pad_token_id=tokenizer.pad_token_id,
        eos_token_id=tokenizer.eos_token_id,
        bos_token_id=None,
    )
    torch.manual_seed(11)
    LlamaForCausalLM(config).save_pretrained(directory)
    tokenizer.save_pretrained(directory)
    return directory
