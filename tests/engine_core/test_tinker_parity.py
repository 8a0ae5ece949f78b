"""The engine's LoRA parametrization, optimizer, sampling defaults and the gspo and stable_reinforce losses
against Tinker's (docs/tinker_parity.md names the source of each fact)."""

from __future__ import annotations

import math
import os
from collections.abc import Iterator
from pathlib import Path

import numpy as np
import pytest
import tinker
import torch
from engine_core_ref import hand_lora, load_plain_model, lora_leaves, reference_logprobs
from peft.tuners.lora import LoraLayer
from tinker import types

from tinkerrpc_server.engine.losses import LOSSES
from tinkerrpc_server.engine.protocol import BadRequest, sample_job
from tinkerrpc_server.engine.runtime import (
    LORA_ALPHA,
    BaseModelRuntime,
    DatumArrays,
    EngineUserError,
    LoraSpec,
)
from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.model_store import TINY_CHAT

pytestmark = pytest.mark.process


def _lora_layers(runtime: BaseModelRuntime) -> list[LoraLayer]:
    assert runtime._peft is not None
    return [m for m in runtime._peft.modules() if isinstance(m, LoraLayer)]


def _peft_name(runtime: BaseModelRuntime, model_id: str) -> str:
    return runtime._require_adapter(model_id).peft_name


@pytest.mark.parametrize("rank", [1, 8, 32, 64])
def test_lora_alpha_is_fixed_at_32_so_the_scale_is_alpha_over_rank(
    runtime: BaseModelRuntime, rank: int
) -> None:
    model_id = f"alpha-r{rank}"
    runtime.create_adapter(model_id, LoraSpec(rank=rank, seed=1))
    try:
        name = _peft_name(runtime, model_id)
        layers = [layer for layer in _lora_layers(runtime) if name in layer.scaling]
        assert layers and LORA_ALPHA == 32
        for layer in layers:
            assert layer.r[name] == rank and layer.lora_alpha[name] == 32
            assert layer.scaling[name] == pytest.approx(32 / rank)
    finally:
        runtime.delete_adapter(model_id)


def test_lora_init_b_zero_a_uniform_with_scale_one_over_sqrt_fan_in(runtime: BaseModelRuntime) -> None:
    """B = 0, so a new adapter is the base model; A ~ U(-1/sqrt(d_in), 1/sqrt(d_in)) (Kaiming-uniform, a=sqrt(5))."""
    runtime.create_adapter("init", LoraSpec(rank=16, seed=5))
    try:
        name = _peft_name(runtime, "init")
        layers = [layer for layer in _lora_layers(runtime) if name in layer.lora_A]
        for layer in layers:
            a = layer.lora_A[name].weight.detach()
            b = layer.lora_B[name].weight.detach()
            assert torch.count_nonzero(b) == 0
            bound = 1 / math.sqrt(a.shape[1])
            assert float(a.abs().max()) <= bound
            # A uniform distribution on [-bound, bound] has standard deviation bound / sqrt(3).
            assert float(a.std()) == pytest.approx(bound / math.sqrt(3), rel=0.25)
    finally:
        runtime.delete_adapter("init")


def test_adam_defaults_are_the_sdk_s_and_reach_the_optimizer(runtime: BaseModelRuntime) -> None:
    """The engine's optim_step body is the SDK's: an empty adam_params means Tinker's documented defaults,
    and those are what torch's AdamW (decoupled weight decay) runs with; grad_clip_norm 0 is no clipping."""
    request = types.OptimStepRequest.model_validate({"model_id": "m", "adam_params": {}})
    adam = request.optim_params
    assert isinstance(adam, types.AdamParams)
    assert (adam.learning_rate, adam.beta1, adam.beta2, adam.eps, adam.weight_decay, adam.grad_clip_norm) == (
        1e-4,
        0.9,
        0.95,
        1e-12,
        0.0,
        0.0,
    )
    runtime.create_adapter("adam", LoraSpec(rank=4, seed=2))
    try:
        runtime.optim_step(
            "adam",
            adam.learning_rate,
            adam.beta1,
            adam.beta2,
            adam.eps,
            adam.weight_decay,
            adam.grad_clip_norm,
        )
        optimizer = runtime._require_adapter("adam").optimizer
        assert isinstance(optimizer, torch.optim.AdamW)
        for group in optimizer.param_groups:
            assert group["lr"] == 1e-4 and group["betas"] == (0.9, 0.95)
            assert group["eps"] == 1e-12 and group["weight_decay"] == 0.0
    finally:
        runtime.delete_adapter("adam")


def test_sampling_defaults_are_the_sdk_s() -> None:
    """Default SamplingParams: temperature 1, no top-k (tinker's -1, the engine's 0), no nucleus (top_p 1),
    EOS stops (stop None), and no max_tokens means until the context is full (-1, filled in when the
    model is known)."""
    request = types.SampleRequest(
        sampling_session_id="s:sample:0",
        seq_id=0,
        num_samples=1,
        prompt=types.ModelInput.from_ints([1, 2, 3]),
        sampling_params=types.SamplingParams(),
    )
    job = sample_job(request)
    assert (job.temperature, job.top_k, job.top_p, job.max_tokens) == (1.0, 0, 1.0, -1)
    # tinker's top_k convention is converted once, here; a value it does not define is refused here.
    assert (
        sample_job(request.model_copy(update={"sampling_params": types.SamplingParams(top_k=5)})).top_k == 5
    )
    with pytest.raises(BadRequest, match="top_k must be -1"):
        sample_job(request.model_copy(update={"sampling_params": types.SamplingParams(top_k=-2)}))
    assert job.stop_token_ids is None and job.stop_strings == [] and job.seed is None


# ---------------------------------------------------------------- gspo and stable_reinforce


def reference_gspo(
    lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """Tinker's GSPO-token (docs/tinker_parity.md), position by position: s is the geometric mean of the
    token ratios over the masked positions; token t carries sg(s) · p_t / sg(p_t)."""
    q, advantages, mask = inputs["logprobs"], inputs["advantages"], inputs["sequence_ratio_mask"]
    values = lp.detach()
    marked = [t for t in range(len(lp)) if float(mask[t]) != 0.0]
    s = math.exp(sum(float(values[t]) - float(q[t]) for t in marked) / len(marked))
    low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
    terms = []
    for t in range(len(lp)):
        s_t = s * torch.exp(lp[t] - lp[t].detach())
        a = advantages[t]
        terms.append(-torch.minimum(s_t * a, s_t.clamp(low, high) * a))
    return torch.stack(terms).sum()


def reference_stable_reinforce(
    lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    """The engine's stable_reinforce (docs/tinker_parity.md), position by position."""
    terms = []
    for t in range(len(lp)):
        q, a = inputs["logprobs"][t], inputs["advantages"][t]
        weight = math.exp(float(lp[t].detach()) - float(q))
        kl = torch.exp(lp[t] - q) - 1 - (lp[t] - q)
        terms.append(-(weight * lp[t] * a - config.get("kl_coeff", 0.0) * kl))
    return torch.stack(terms).sum()


REFERENCES = {"gspo": reference_gspo, "stable_reinforce": reference_stable_reinforce}
PROMPT_POSITIONS = 2


def _as_tensors(inputs: dict[str, np.ndarray]) -> dict[str, torch.Tensor]:
    return {k: torch.tensor(np.asarray(v, dtype=np.float64)).float() for k, v in inputs.items()}


def _rl_inputs(loss_fn: str, lp: np.ndarray, log_ratio_centre: float, seed: int) -> dict[str, np.ndarray]:
    """Sampler logprobs that put the ratios around exp(log_ratio_centre); mixed-sign advantages, zero on
    the first PROMPT_POSITIONS positions (the prompt, which gspo's mask leaves out)."""
    rng = np.random.default_rng(seed)
    n = len(lp)
    log_ratios = log_ratio_centre + rng.uniform(-0.2, 0.2, n)
    advantages = np.resize([1.0, -1.5, 0.5, -0.7], n).astype(np.float32)
    advantages[:PROMPT_POSITIONS] = 0.0
    inputs = {"logprobs": (lp - log_ratios).astype(np.float32), "advantages": advantages}
    if loss_fn == "gspo":
        inputs["sequence_ratio_mask"] = np.array([0.0] * PROMPT_POSITIONS + [1.0] * (n - PROMPT_POSITIONS))
    return inputs


def _probe(runtime: BaseModelRuntime, model_id: str, tokens: np.ndarray) -> np.ndarray:
    probe = DatumArrays(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.zeros(len(tokens) - 1)})
    return runtime.forward_backward(model_id, [probe], "cross_entropy", None, backward=False).logprobs[0]


@pytest.fixture(scope="module")
def plain_model(tiny_model_path: Path) -> torch.nn.Module:
    return load_plain_model(tiny_model_path)


NEW_LOSS_CASES = [
    ("gspo", None),
    ("gspo", {"clip_low_threshold": 0.95, "clip_high_threshold": 1.05}),
    ("stable_reinforce", None),
    ("stable_reinforce", {"kl_coeff": 0.5}),
]


@pytest.mark.parametrize(("loss_fn", "config"), NEW_LOSS_CASES)
def test_new_losses_value_and_gradients_match_plain_torch(
    runtime: BaseModelRuntime, plain_model: torch.nn.Module, loss_fn: str, config: dict[str, float] | None
) -> None:
    """One sequence's ratios sit above the clip range, one's inside it, one's below: the clipped and the
    unclipped branch of gspo both carry gradient (or none) as Tinker's formula says."""
    rank = 4
    model_id = f"new-loss-{loss_fn}-{len(config or {})}"
    runtime.create_adapter(model_id, LoraSpec(rank=rank, seed=7))
    try:
        generator = torch.Generator().manual_seed(1)
        with torch.no_grad():
            for param in runtime.adapter_parameters(model_id).values():
                param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
        rng = np.random.default_rng(5)
        data = []
        for n, centre in ((7, 0.3), (10, -0.02), (9, -0.4)):
            tokens = rng.integers(0, runtime.vocab_size, n + 1)
            lp = _probe(runtime, model_id, tokens)
            inputs = _rl_inputs(loss_fn, lp, centre, seed=n)
            data.append(DatumArrays(tokens[:-1], {"target_tokens": tokens[1:], **inputs}))

        result = runtime.forward_backward(model_id, data, loss_fn, config, backward=True)

        leaves = lora_leaves(runtime, model_id)
        with hand_lora(plain_model, leaves, scaling=LORA_ALPHA / rank):
            ref_lps = [reference_logprobs(plain_model, d) for d in data]
            ref_loss = sum(
                REFERENCES[loss_fn](lp, _as_tensors(d.loss_fn_inputs), config or {})
                for lp, d in zip(ref_lps, data, strict=True)
            )
        assert isinstance(ref_loss, torch.Tensor)
        ref_loss.backward()
        assert result.metrics["loss:sum"] == pytest.approx(ref_loss.item(), rel=1e-4, abs=1e-4)
        for got, want in zip(result.logprobs, ref_lps, strict=True):
            np.testing.assert_allclose(got, want.detach().numpy(), atol=1e-5)
        for name, param in runtime.adapter_parameters(model_id).items():
            assert param.grad is not None
            torch.testing.assert_close(param.grad, leaves[name].grad, atol=1e-5, rtol=1e-4, msg=name)
    finally:
        runtime.delete_adapter(model_id)


def _gradient(
    loss_fn: str, lp: torch.Tensor, inputs: dict[str, torch.Tensor], config: dict[str, float]
) -> torch.Tensor:
    leaf = lp.clone().requires_grad_(True)
    (grad,) = torch.autograd.grad(LOSSES[loss_fn].fn(leaf, inputs, config), leaf)
    return grad


def test_gspo_gives_every_token_the_sequence_ratio_and_clips_whole_sequences() -> None:
    """d loss / d lp_t = −s·A_t where the sequence is unclipped, 0 where clipping binds: the value of
    one ratio per sequence, the gradient of each token's own logprob."""
    lp = torch.tensor([-1.0, -2.0, -0.5, -1.5, -0.7])
    config = {"clip_low_threshold": 0.8, "clip_high_threshold": 1.2}
    mask = torch.tensor([0.0, 1.0, 1.0, 1.0, 1.0])
    advantages = torch.tensor([0.0, 1.0, -1.0, 2.0, -0.5])
    token_log_ratios = torch.tensor(
        [5.0, 0.1, -0.1, 0.2, 0.0]
    )  # the unmasked prompt position counts for nothing
    inputs = {"logprobs": lp - token_log_ratios, "advantages": advantages, "sequence_ratio_mask": mask}
    s = math.exp(0.05)
    torch.testing.assert_close(_gradient("gspo", lp, inputs, config), -s * advantages)
    # s = e^0.5 > 1.2: tokens with A > 0 are clipped (no gradient), tokens with A < 0 keep −s·A.
    high = {**inputs, "logprobs": lp - 0.5}
    expected = torch.where(advantages > 0, torch.zeros(5), -math.exp(0.5) * advantages)
    torch.testing.assert_close(_gradient("gspo", lp, high, config), expected)


def test_stable_reinforce_gradient_is_ratio_weighted_reinforce_plus_the_kl_pull() -> None:
    lp = torch.tensor([-1.0, -0.3, -2.2])
    q = torch.tensor([-1.2, -0.3, -1.9])
    advantages = torch.tensor([1.0, -2.0, 0.5])
    ratio = torch.exp(lp - q)
    inputs = {"logprobs": q, "advantages": advantages}
    # d/dlp [(r − 1) − (lp − q)] = r − 1: zero on-policy, pulling lp back towards q either way.
    expected = -ratio * advantages + 0.3 * (ratio - 1)
    torch.testing.assert_close(_gradient("stable_reinforce", lp, inputs, {"kl_coeff": 0.3}), expected)
    torch.testing.assert_close(
        _gradient("stable_reinforce", lp, inputs, {"kl_coeff": 0.0}), -ratio * advantages
    )


@pytest.mark.parametrize(
    ("loss_fn", "config", "mask", "fragment"),
    [
        ("gspo", None, [0.0, 0.0, 0.0], "marks no position"),
        ("gspo", None, None, "needs loss_fn_inputs ['sequence_ratio_mask']"),
        ("gspo", {"clip_low_threshold": 1.3}, [1.0, 1.0, 1.0], "must not exceed clip_high_threshold"),
        ("stable_reinforce", {"kl_coeff": -0.1}, None, "must be >= 0"),
        ("stable_reinforce", {"kl_coeff": math.inf}, None, "must be finite"),
        ("stable_reinforce", {"beta": 0.1}, None, "not used by stable_reinforce (allowed: kl_coeff)"),
    ],
)
def test_new_losses_refuse_bad_input_and_change_nothing(
    runtime: BaseModelRuntime,
    loss_fn: str,
    config: dict[str, float] | None,
    mask: list[float] | None,
    fragment: str,
) -> None:
    runtime.create_adapter("refuse", LoraSpec(rank=4, seed=3))
    try:
        inputs = {
            "target_tokens": np.array([1, 2, 3]),
            "logprobs": np.full(3, -1.0),
            "advantages": np.ones(3),
        }
        if mask is not None:
            inputs["sequence_ratio_mask"] = np.array(mask)
        with pytest.raises(EngineUserError) as raised:
            runtime.forward_backward(
                "refuse", [DatumArrays(np.array([4, 5, 6]), inputs)], loss_fn, config, True
            )
        assert fragment in str(raised.value)
        assert all(p.grad is None for p in runtime.adapter_parameters("refuse").values())
    finally:
        runtime.delete_adapter("refuse")


# ---------------------------------------------------------------- through the real tinker SDK


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    work = tmp_path_factory.mktemp("parity-engine")
    running = LocalEngine(work / "data", work / "models", work / "engine.log", startup_timeout=90.0).start()
    yield running
    assert running.stop() == 0, running.log()[-3000:]


def test_gspo_and_stable_reinforce_train_through_the_tinker_sdk(engine: LocalEngine) -> None:
    """forward reports each loss as the reference computes it from the returned learner logprobs; a
    forward_backward + optim_step with each moves the weights."""
    with engine.service_client() as service:
        client = service.create_lora_training_client(TINY_CHAT, rank=4, seed=5).result()
        rng = np.random.default_rng(2)
        tokens = [rng.integers(0, 200, n + 1) for n in (8, 12)]
        probe = [
            types.Datum(
                model_input=types.ModelInput.from_ints(t[:-1].tolist()),
                loss_fn_inputs={
                    "target_tokens": types.TensorData.from_numpy(t[1:]),
                    "weights": types.TensorData.from_numpy(np.zeros(len(t) - 1, np.float32)),
                },
            )
            for t in tokens
        ]
        learner = [
            o["logprobs"].to_numpy() for o in client.forward(probe, "cross_entropy").result().loss_fn_outputs
        ]
        cases: list[tuple[types.LossFnType, dict[str, float]]] = [
            ("gspo", {"clip_high_threshold": 1.1}),
            ("stable_reinforce", {"kl_coeff": 0.2}),
        ]
        for loss_fn, config in cases:
            data, expected = [], 0.0
            for t, lp, centre in zip(tokens, learner, (0.3, -0.05), strict=True):
                inputs = _rl_inputs(loss_fn, lp, centre, seed=len(t))
                data.append(
                    types.Datum(
                        model_input=types.ModelInput.from_ints(t[:-1].tolist()),
                        loss_fn_inputs={
                            "target_tokens": types.TensorData.from_numpy(t[1:]),
                            **{k: types.TensorData.from_numpy(v) for k, v in inputs.items()},
                        },
                    )
                )
                expected += float(REFERENCES[loss_fn](torch.tensor(lp), _as_tensors(inputs), config))
            forward = client.forward(data, loss_fn, config).result()
            assert forward.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
            client.forward_backward(data, loss_fn, config).result()
            client.optim_step(types.AdamParams(learning_rate=1e-2)).result()
            moved = [
                o["logprobs"].to_numpy()
                for o in client.forward(probe, "cross_entropy").result().loss_fn_outputs
            ]
            assert max(float(np.abs(a - b).max()) for a, b in zip(moved, learner, strict=True)) > 1e-5
            learner = moved
        with pytest.raises(tinker.RequestFailedError, match="kl_coeff"):
            client.forward(data, "stable_reinforce", {"kl_coeff": -1.0}).result()


def test_stable_reinforce_takes_datums_with_provenance_from_a_recording_sampler(engine: LocalEngine) -> None:
    """Tinker's stable_reinforce flow (cookbook 0.6 rl_loop.py): a sampling client made with
    record_stability_info, a datum naming its sampled sequence_id through provenance spans. The engine
    checks the spans against what it sampled, takes q from the recorded logprobs (docs/tinker_parity.md),
    and trains."""
    with engine.service_client() as service:
        client = service.create_lora_training_client(TINY_CHAT, rank=4, seed=9).result()
        sampler = client.save_weights_and_get_sampling_client(record_stability_info=True).result()
        prompt = types.ModelInput.from_ints([5, 6, 7, 8])
        params = types.SamplingParams(max_tokens=4, seed=1)
        sequence = sampler.sample(prompt=prompt, num_samples=1, sampling_params=params).result().sequences[0]
        assert sequence.sequence_id and sequence.logprobs is not None
        n, prompt_positions = len(sequence.tokens), prompt.length - 1
        datum = types.Datum(
            model_input=prompt.append(types.EncodedTextChunk(tokens=sequence.tokens[:-1])),
            loss_fn_inputs={
                "target_tokens": types.TensorData.from_numpy(
                    np.array(prompt.to_ints()[1:] + sequence.tokens)
                ),
                "logprobs": types.TensorData.from_numpy(
                    np.array([0.0] * prompt_positions + sequence.logprobs, np.float32)
                ),
                "advantages": types.TensorData.from_numpy(
                    np.array([0.0] * prompt_positions + [1.0] * n, np.float32)
                ),
            },
        ).with_provenance(
            model_input=[
                types.PromptProvenanceSpan(sequence_id=sequence.sequence_id, length=prompt.length),
                types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=n - 1),
            ],
            loss_fn_inputs=[
                types.PromptProvenanceSpan(
                    sequence_id=sequence.sequence_id, offset=1, length=prompt_positions
                ),
                types.SampledProvenanceSpan(sequence_id=sequence.sequence_id, length=n),
            ],
        )
        output = client.forward_backward([datum], "stable_reinforce").result()
        lp = torch.tensor(output.loss_fn_outputs[0]["logprobs"].to_numpy())
        inputs = _as_tensors(
            {k: v.to_numpy() for k, v in datum.loss_fn_inputs.items() if k != "target_tokens"}
        )
        expected = float(reference_stable_reinforce(lp, inputs, {}))
        assert output.metrics["loss:sum"] == pytest.approx(expected, rel=1e-4, abs=1e-4)
        assert client.optim_step(types.AdamParams(learning_rate=1e-2)).result() is not None
