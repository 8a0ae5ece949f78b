"""Training semantics of BaseModelRuntime against independent plain-torch references."""

from __future__ import annotations

import itertools
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import torch
from engine_core_ref import hand_lora, load_plain_model, lora_leaves, reference_logprobs, reference_loss
from peft import PeftModel, get_peft_model_state_dict
from safetensors.torch import load_file

from tinkerrpc_server.engine.runtime import (
    LORA_ALPHA,
    BaseModelRuntime,
    DatumArrays,
    EngineUserError,
    LoraSpec,
    bucket_by_length,
)

pytestmark = pytest.mark.unit

ADAM = {
    "learning_rate": 1e-2,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}
_ids = itertools.count()


@pytest.fixture(scope="module")
def plain_model(tiny_model_path: Path) -> torch.nn.Module:
    return load_plain_model(tiny_model_path)


def new_adapter(runtime: BaseModelRuntime, seed: int = 7, rank: int = 4, **flags: bool) -> str:
    model_id = f"model-{next(_ids)}"
    runtime.create_adapter(model_id, LoraSpec(rank=rank, seed=seed, **flags))
    return model_id


def randomize(runtime: BaseModelRuntime, model_id: str, seed: int) -> None:
    """Give lora_B non-zero values so every factor gets a gradient (a fresh B is all zeros)."""
    generator = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for param in runtime.adapter_parameters(model_id).values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)


def grads(runtime: BaseModelRuntime, model_id: str) -> dict[str, torch.Tensor]:
    return {
        name: (p.grad.clone() if p.grad is not None else torch.zeros_like(p))
        for name, p in runtime.adapter_parameters(model_id).items()
    }


def weights(runtime: BaseModelRuntime, model_id: str) -> dict[str, torch.Tensor]:
    return {name: p.detach().clone() for name, p in runtime.adapter_parameters(model_id).items()}


def assert_tensors_close(
    actual: dict[str, torch.Tensor], expected: dict[str, torch.Tensor], atol: float = 1e-5, rtol: float = 1e-4
) -> None:
    assert actual.keys() == expected.keys()
    for name in actual:
        torch.testing.assert_close(actual[name], expected[name], atol=atol, rtol=rtol, msg=name)


def sft_datum(rng: np.random.Generator, vocab: int, length: int) -> DatumArrays:
    tokens = rng.integers(0, vocab, length + 1)
    weights_ = (rng.random(length) < 0.7).astype(np.float32)
    return DatumArrays(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights_})


def rl_datum(runtime: BaseModelRuntime, model_id: str, rng: np.random.Generator, length: int) -> DatumArrays:
    """A datum whose sampler logprobs put the ratio r = exp(lp - q) below, inside and above the clip range."""
    tokens = rng.integers(0, runtime.vocab_size, length + 1)
    probe = DatumArrays(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.zeros(length, np.float32)})
    lp = runtime.forward_backward(model_id, [probe], "cross_entropy", None, backward=False).logprobs[0]
    log_ratios = np.resize(np.log([0.5, 1.0, 1.5, 0.9, 1.3, 0.7]), length)
    advantages = np.resize([1.0, -1.0, -0.5, 2.0], length).astype(np.float32)
    return DatumArrays(
        tokens[:-1],
        {
            "target_tokens": tokens[1:],
            "logprobs": (lp - log_ratios).astype(np.float32),
            "advantages": advantages,
        },
    )


LOSS_CASES = [
    ("cross_entropy", None),
    ("importance_sampling", None),
    ("ppo", None),
    ("ppo", {"clip_low_threshold": 0.6, "clip_high_threshold": 1.4}),
    ("cispo", None),
    ("dro", {"beta": 0.5}),
]


@pytest.mark.parametrize(("loss_fn", "config"), LOSS_CASES)
def test_loss_value_and_gradients_match_plain_torch(
    runtime: BaseModelRuntime, plain_model: torch.nn.Module, loss_fn: str, config: dict[str, float] | None
) -> None:
    rank = 4
    model_id = new_adapter(runtime, rank=rank)
    randomize(runtime, model_id, seed=1)
    rng = np.random.default_rng(3)
    if loss_fn == "cross_entropy":
        data = [sft_datum(rng, runtime.vocab_size, n) for n in (6, 11)]
    else:
        data = [rl_datum(runtime, model_id, rng, n) for n in (6, 11)]

    result = runtime.forward_backward(model_id, data, loss_fn, config, backward=True)

    leaves = lora_leaves(runtime, model_id)
    with hand_lora(plain_model, leaves, scaling=LORA_ALPHA / rank):
        ref_lps = [reference_logprobs(plain_model, d) for d in data]
        ref_loss = sum(
            reference_loss(loss_fn, lp, d, config or {}) for lp, d in zip(ref_lps, data, strict=True)
        )
    ref_loss.backward()
    assert result.metrics["loss:sum"] == pytest.approx(ref_loss.item(), rel=1e-4, abs=1e-4)
    for got, want in zip(result.logprobs, ref_lps, strict=True):
        np.testing.assert_allclose(got, want.detach().numpy(), atol=1e-5)
    assert_tensors_close(grads(runtime, model_id), {k: v.grad for k, v in leaves.items()})
    runtime.delete_adapter(model_id)


def test_ppo_clips_on_both_sides_and_cispo_stops_the_ratio_gradient(runtime: BaseModelRuntime) -> None:
    """The clipped losses must differ from the unclipped importance-sampling gradient."""
    rng = np.random.default_rng(5)
    per_loss = {}
    for loss_fn in ("importance_sampling", "ppo", "cispo"):
        model_id = new_adapter(runtime)
        randomize(runtime, model_id, seed=2)
        datum = rl_datum(runtime, model_id, np.random.default_rng(5), 12)
        runtime.forward_backward(model_id, [datum], loss_fn, None, backward=True)
        per_loss[loss_fn] = grads(runtime, model_id)
        runtime.delete_adapter(model_id)
    del rng
    name = next(iter(per_loss["ppo"]))
    assert not torch.allclose(per_loss["ppo"][name], per_loss["importance_sampling"][name])
    assert not torch.allclose(per_loss["cispo"][name], per_loss["importance_sampling"][name])


def test_clipped_tokens_contribute_no_ppo_gradient(runtime: BaseModelRuntime) -> None:
    """With every ratio outside the clip range on its clipped side, PPO's gradient is exactly zero."""
    model_id = new_adapter(runtime)
    randomize(runtime, model_id, seed=4)
    rng = np.random.default_rng(9)
    tokens = rng.integers(0, runtime.vocab_size, 9)
    probe = DatumArrays(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.zeros(8, np.float32)})
    lp = runtime.forward_backward(model_id, [probe], "cross_entropy", None, backward=False).logprobs[0]
    # r = 2 with A > 0 is clipped at the top; r = 0.25 with A < 0 is clipped at the bottom.
    log_ratios = np.resize(np.log([2.0, 0.25]), 8)
    advantages = np.resize([1.0, -1.0], 8).astype(np.float32)
    datum = DatumArrays(
        tokens[:-1],
        {
            "target_tokens": tokens[1:],
            "logprobs": (lp - log_ratios).astype(np.float32),
            "advantages": advantages,
        },
    )
    result = runtime.forward_backward(model_id, [datum], "ppo", None, backward=True)
    assert result.metrics["loss:sum"] == pytest.approx(-float(np.sum(np.resize([1.2, -0.8], 8))), rel=1e-5)
    assert all(float(g.abs().max()) == 0.0 for g in grads(runtime, model_id).values())
    runtime.delete_adapter(model_id)


def test_two_forward_backward_calls_accumulate_like_one(runtime: BaseModelRuntime) -> None:
    rng = np.random.default_rng(11)
    data = [sft_datum(rng, runtime.vocab_size, n) for n in (5, 9, 14)]
    split, joint = new_adapter(runtime, seed=3), new_adapter(runtime, seed=3)
    runtime.forward_backward(split, data[:1], "cross_entropy", None, backward=True)
    runtime.forward_backward(split, data[1:], "cross_entropy", None, backward=True)
    runtime.forward_backward(joint, data, "cross_entropy", None, backward=True)
    assert_tensors_close(grads(runtime, split), grads(runtime, joint))
    runtime.optim_step(split, **ADAM)
    runtime.optim_step(joint, **ADAM)
    assert_tensors_close(weights(runtime, split), weights(runtime, joint))
    changed = weights(runtime, split)
    runtime.delete_adapter(split)
    runtime.delete_adapter(joint)
    assert any(float(v.abs().max()) > 0 for k, v in changed.items() if "lora_B" in k)


@pytest.mark.parametrize(
    ("weight_decay", "grad_clip_norm"), [(0.0, 0.0), (0.1, 0.0), (0.0, 0.05), (0.05, 0.05)]
)
def test_optim_step_equals_torch_adamw(
    runtime: BaseModelRuntime, weight_decay: float, grad_clip_norm: float
) -> None:
    model_id = new_adapter(runtime)
    randomize(runtime, model_id, seed=5)
    names = list(runtime.adapter_parameters(model_id))
    reference = [
        p.detach().clone().requires_grad_(True) for p in runtime.adapter_parameters(model_id).values()
    ]
    params = {**ADAM, "weight_decay": weight_decay, "grad_clip_norm": grad_clip_norm, "eps": 1e-12}
    optimizer = torch.optim.AdamW(
        reference, lr=params["learning_rate"], betas=(0.9, 0.95), eps=1e-12, weight_decay=weight_decay
    )
    rng = np.random.default_rng(13)
    for _ in range(3):
        runtime.forward_backward(
            model_id, [sft_datum(rng, runtime.vocab_size, 10)], "cross_entropy", None, True
        )
        engine_grads = grads(runtime, model_id)
        for ref, name in zip(reference, names, strict=True):
            ref.grad = engine_grads[name].clone()
        expected_norm = float(
            torch.linalg.vector_norm(torch.stack([g.norm() for g in engine_grads.values()]))
        )
        if grad_clip_norm > 0:
            torch.nn.utils.clip_grad_norm_(reference, grad_clip_norm)
        optimizer.step()
        metrics = runtime.optim_step(model_id, **params)
        assert metrics["grad_norm:mean"] == pytest.approx(expected_norm, rel=1e-5)
        assert all(p.grad is None for p in runtime.adapter_parameters(model_id).values())
        assert_tensors_close(weights(runtime, model_id), dict(zip(names, reference, strict=True)), atol=1e-6)
    runtime.delete_adapter(model_id)


def test_step_without_gradients_only_decays(runtime: BaseModelRuntime) -> None:
    model_id = new_adapter(runtime)
    randomize(runtime, model_id, seed=6)
    before = weights(runtime, model_id)
    runtime.optim_step(model_id, **{**ADAM, "weight_decay": 0.1})
    after = weights(runtime, model_id)
    factor = 1 - ADAM["learning_rate"] * 0.1
    assert_tensors_close(after, {k: v * factor for k, v in before.items()}, atol=1e-7)
    runtime.delete_adapter(model_id)


def test_bucketed_mixed_lengths_equal_per_datum_results(runtime: BaseModelRuntime) -> None:
    rng = np.random.default_rng(17)
    lengths = [3, 40, 7, 38, 120, 12, 64, 5, 100, 33]
    data = [sft_datum(rng, runtime.vocab_size, n) for n in lengths]
    assert len(bucket_by_length(lengths)) > 1  # the batch really is split into several micro-batches
    batched, single = new_adapter(runtime, seed=8), new_adapter(runtime, seed=8)
    randomize(runtime, batched, seed=8)
    randomize(runtime, single, seed=8)
    together = runtime.forward_backward(batched, data, "cross_entropy", None, backward=True)
    one_by_one = [runtime.forward_backward(single, [d], "cross_entropy", None, backward=True) for d in data]
    for got, alone in zip(together.logprobs, one_by_one, strict=True):
        np.testing.assert_allclose(got, alone.logprobs[0], atol=2e-5)
    total = sum(r.metrics["loss:sum"] for r in one_by_one)
    assert together.metrics["loss:sum"] == pytest.approx(total, rel=1e-5)
    assert_tensors_close(grads(runtime, batched), grads(runtime, single))
    runtime.delete_adapter(batched)
    runtime.delete_adapter(single)


def test_bucket_by_length_groups_similar_lengths() -> None:
    lengths = [10, 800, 12, 790, 11, 300, 500, 130]
    batches = bucket_by_length(lengths)
    assert sorted(i for batch in batches for i in batch) == list(range(len(lengths)))
    for batch in batches:
        longest = max(lengths[i] for i in batch)
        assert all(longest - lengths[i] <= max(0.25 * longest, 64) for i in batch)
    assert sorted(sorted(b) for b in batches) == [[0, 2, 4], [1, 3], [5], [6], [7]]


def test_two_adapters_train_without_affecting_each_other(runtime: BaseModelRuntime) -> None:
    rng = np.random.default_rng(19)
    data = [sft_datum(rng, runtime.vocab_size, 12)]
    busy, quiet = new_adapter(runtime, seed=9), new_adapter(runtime, seed=10, rank=8, train_mlp=False)
    randomize(runtime, quiet, seed=10)
    quiet_before = weights(runtime, quiet)
    quiet_lp = runtime.forward_backward(quiet, data, "cross_entropy", None, backward=False).logprobs[0]
    runtime.forward_backward(quiet, data, "cross_entropy", None, backward=True)
    quiet_grads = grads(runtime, quiet)
    for _ in range(3):
        runtime.forward_backward(busy, data, "cross_entropy", None, backward=True)
        runtime.optim_step(busy, **ADAM)
    assert_tensors_close(weights(runtime, quiet), quiet_before, atol=0, rtol=0)
    assert_tensors_close(grads(runtime, quiet), quiet_grads, atol=0, rtol=0)
    again = runtime.forward_backward(quiet, data, "cross_entropy", None, backward=False).logprobs[0]
    np.testing.assert_array_equal(again, quiet_lp)
    busy_lp = runtime.forward_backward(busy, data, "cross_entropy", None, backward=False).logprobs[0]
    assert float(np.sum(busy_lp)) > float(np.sum(quiet_lp))  # the busy one learned the data
    runtime.delete_adapter(busy)
    runtime.delete_adapter(quiet)


def bad_calls(runtime: BaseModelRuntime, model_id: str) -> Iterator[tuple[str, object]]:
    """(expected message fragment, a call that must be refused)."""
    rng = np.random.default_rng(23)
    good = sft_datum(rng, runtime.vocab_size, 6)
    t, w = good.loss_fn_inputs["target_tokens"], good.loss_fn_inputs["weights"]
    fb = runtime.forward_backward

    def call(
        data: list[DatumArrays], loss: str = "cross_entropy", config: dict[str, float] | None = None
    ) -> object:
        return lambda: fb(model_id, data, loss, config, True)

    too_long = runtime.max_context_length + 1
    yield "data is empty", call([])
    yield (
        "outside the vocabulary",
        call([good, DatumArrays(np.array([1, runtime.vocab_size, 2, 3, 4, 5]), good.loss_fn_inputs)]),
    )
    yield (
        "outside the vocabulary",
        call([DatumArrays(good.input_tokens, {"target_tokens": t + runtime.vocab_size, "weights": w})]),
    )
    yield "has shape", call([DatumArrays(good.input_tokens, {"target_tokens": t, "weights": w[:-1]})])
    yield "needs loss_fn_inputs", call([DatumArrays(good.input_tokens, {"target_tokens": t})])
    yield "needs loss_fn_inputs ['advantages', 'logprobs']", call([good], "ppo")
    yield "unknown loss_fn", call([good], "hinge")
    yield "non-finite", call([DatumArrays(good.input_tokens, {"target_tokens": t, "weights": w * np.nan})])
    yield "unknown model", lambda: fb("no-such-model", [good], "cross_entropy", None, True)
    yield (
        "context",
        call(
            [
                DatumArrays(
                    np.ones(too_long, np.int64),
                    {"target_tokens": np.ones(too_long, np.int64), "weights": np.ones(too_long, np.float32)},
                )
            ]
        ),
    )
    yield "not used by cross_entropy", call([good], "cross_entropy", {"beta": 1.0})
    yield (
        "dro needs",
        call([DatumArrays(good.input_tokens, {"target_tokens": t, "logprobs": w, "advantages": w})], "dro"),
    )
    yield (
        "no input tokens",
        call(
            [
                DatumArrays(
                    np.zeros(0, np.int64),
                    {"target_tokens": np.zeros(0, np.int64), "weights": np.zeros(0, np.float32)},
                )
            ]
        ),
    )
    yield "learning_rate", lambda: runtime.optim_step(model_id, **{**ADAM, "learning_rate": float("nan")})
    yield "grad_clip_norm", lambda: runtime.optim_step(model_id, **{**ADAM, "grad_clip_norm": -1.0})


def test_bad_input_is_refused_and_changes_nothing(runtime: BaseModelRuntime) -> None:
    rng = np.random.default_rng(29)
    data = [sft_datum(rng, runtime.vocab_size, 8)]
    probed, clean = new_adapter(runtime, seed=11), new_adapter(runtime, seed=11)
    for model_id in (probed, clean):
        runtime.forward_backward(model_id, data, "cross_entropy", None, backward=True)
    refused = 0
    for fragment, bad in bad_calls(runtime, probed):
        with pytest.raises(EngineUserError) as caught:
            bad()  # type: ignore[operator]
        assert fragment in str(caught.value)
        refused += 1
    assert refused >= 8
    assert_tensors_close(grads(runtime, probed), grads(runtime, clean), atol=0, rtol=0)
    for model_id in (probed, clean):
        runtime.forward_backward(model_id, data, "cross_entropy", None, backward=True)
        runtime.optim_step(model_id, **ADAM)
    assert_tensors_close(weights(runtime, probed), weights(runtime, clean), atol=0, rtol=0)
    runtime.delete_adapter(probed)
    runtime.delete_adapter(clean)


def test_adapter_lifecycle_errors(runtime: BaseModelRuntime) -> None:
    model_id = new_adapter(runtime)
    with pytest.raises(EngineUserError, match="already exists"):
        runtime.create_adapter(model_id, LoraSpec(rank=4, seed=1))
    with pytest.raises(EngineUserError, match="rank"):
        runtime.create_adapter("zero-rank", LoraSpec(rank=0, seed=1))
    with pytest.raises(EngineUserError, match="at least one"):
        runtime.create_adapter(
            "nothing", LoraSpec(rank=2, seed=1, train_mlp=False, train_attn=False, train_unembed=False)
        )
    assert not runtime.has_adapter("zero-rank") and not runtime.has_adapter("nothing")
    runtime.delete_adapter(model_id)
    assert not runtime.has_adapter(model_id)
    with pytest.raises(EngineUserError, match="unknown model"):
        runtime.delete_adapter(model_id)


def test_same_seed_gives_same_initial_adapter(runtime: BaseModelRuntime) -> None:
    first, second, other = (
        new_adapter(runtime, seed=21),
        new_adapter(runtime, seed=21),
        new_adapter(runtime, seed=22),
    )
    assert_tensors_close(weights(runtime, first), weights(runtime, second), atol=0, rtol=0)
    a_name = next(k for k in weights(runtime, first) if "lora_A" in k)
    assert not torch.equal(weights(runtime, first)[a_name], weights(runtime, other)[a_name])
    for model_id in (first, second, other):
        runtime.delete_adapter(model_id)


def test_save_and_resume_with_optimizer_matches_uninterrupted_run(
    runtime: BaseModelRuntime, tmp_path: Path
) -> None:
    rng = np.random.default_rng(31)
    batches = [[sft_datum(rng, runtime.vocab_size, 9)] for _ in range(4)]
    straight = new_adapter(runtime, seed=12)
    for batch in batches:
        runtime.forward_backward(straight, batch, "cross_entropy", None, backward=True)
        runtime.optim_step(straight, **{**ADAM, "weight_decay": 0.01})
    interrupted = new_adapter(runtime, seed=12)
    for batch in batches[:2]:
        runtime.forward_backward(interrupted, batch, "cross_entropy", None, backward=True)
        runtime.optim_step(interrupted, **{**ADAM, "weight_decay": 0.01})
    runtime.save_state(interrupted, tmp_path / "step2", include_optimizer=True)
    runtime.delete_adapter(interrupted)
    spec = runtime.load_state("resumed", tmp_path / "step2", include_optimizer=True)
    assert spec == LoraSpec(rank=4, seed=12)
    for batch in batches[2:]:
        runtime.forward_backward("resumed", batch, "cross_entropy", None, backward=True)
        runtime.optim_step("resumed", **{**ADAM, "weight_decay": 0.01})
    assert_tensors_close(weights(runtime, "resumed"), weights(runtime, straight), atol=0, rtol=0)

    # Without the optimizer state, Adam restarts: the next step differs from the resumed run.
    runtime.load_state("fresh-optimizer", tmp_path / "step2", include_optimizer=False)
    for batch in batches[2:]:
        runtime.forward_backward("fresh-optimizer", batch, "cross_entropy", None, backward=True)
        runtime.optim_step("fresh-optimizer", **{**ADAM, "weight_decay": 0.01})
    name = next(k for k in weights(runtime, straight) if "lora_B" in k)
    assert not torch.equal(weights(runtime, "fresh-optimizer")[name], weights(runtime, straight)[name])
    for model_id in ("resumed", "fresh-optimizer", straight):
        runtime.delete_adapter(model_id)


def test_saved_adapter_loads_with_plain_peft(
    runtime: BaseModelRuntime, tiny_model_path: Path, tmp_path: Path
) -> None:
    model_id = new_adapter(runtime, seed=13)
    randomize(runtime, model_id, seed=13)
    runtime.save_state(model_id, tmp_path / "sampler", include_optimizer=False)
    assert sorted(p.name for p in (tmp_path / "sampler").iterdir()) == [
        "adapter_config.json",
        "adapter_model.safetensors",
        "tinkerrpc_lora.json",
    ]
    assert not [p for p in tmp_path.iterdir() if p.name.startswith(".")]  # no staging leftovers
    # The file holds what PEFT's own state dict of the adapter holds, under the same names.
    saved = load_file(tmp_path / "sampler" / "adapter_model.safetensors")
    peft_name = runtime._adapters[model_id].peft_name
    expected_weights = get_peft_model_state_dict(
        runtime._peft, adapter_name=peft_name, save_embedding_layers=False
    )
    assert sorted(saved) == sorted(expected_weights)
    for key, value in expected_weights.items():
        assert torch.equal(saved[key], value)
    peft_model = PeftModel.from_pretrained(load_plain_model(tiny_model_path), str(tmp_path / "sampler"))
    tokens = np.random.default_rng(37).integers(0, runtime.vocab_size, 16)
    datum = DatumArrays(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(15, np.float32)})
    with torch.no_grad():
        expected = reference_logprobs(peft_model, datum).numpy()
    got = runtime.forward_backward(model_id, [datum], "cross_entropy", None, backward=False).logprobs[0]
    np.testing.assert_allclose(got, expected, atol=1e-5)
    with pytest.raises(EngineUserError, match="no optimizer state"):
        runtime.load_state("other", tmp_path / "sampler", include_optimizer=True)
    with pytest.raises(EngineUserError, match="no saved adapter"):
        runtime.load_state("other", tmp_path / "missing", include_optimizer=False)
    assert not runtime.has_adapter("other")
    runtime.delete_adapter(model_id)


def test_save_state_replaces_an_existing_checkpoint(runtime: BaseModelRuntime, tmp_path: Path) -> None:
    first, second = new_adapter(runtime, seed=14), new_adapter(runtime, seed=15)
    randomize(runtime, first, seed=14)
    randomize(runtime, second, seed=15)
    runtime.save_state(first, tmp_path / "ckpt", include_optimizer=True)
    runtime.save_state(second, tmp_path / "ckpt", include_optimizer=False)
    runtime.load_state("loaded", tmp_path / "ckpt", include_optimizer=False)
    assert_tensors_close(weights(runtime, "loaded"), weights(runtime, second), atol=0, rtol=0)
    assert not (tmp_path / "ckpt" / "optimizer.safetensors").exists()
    assert sorted(p.name for p in tmp_path.iterdir()) == ["ckpt"]
    for model_id in (first, second, "loaded"):
        runtime.delete_adapter(model_id)
