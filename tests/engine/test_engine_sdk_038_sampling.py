"""Tinker 0.38's sampling semantics through the unmodified SDK against a real engine: K alternative tokens
per prompt position, the prompt tokens whose KV a request reused, inflight sampling clients that follow
later saves, provenance spans checked against what the engine sampled, and the stability information
recorded per sampled sequence for stable_reinforce."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from engine_proc import TINY
from tinker import types

from tinkerrpc.contract.limits import MAX_ENGINE_TOPK_LOGPROBS

pytestmark = pytest.mark.process

PROMPT = types.ModelInput.from_ints([5, 17, 42, 8, 99])


def expect_failure(call: object, *fragments: str) -> str:
    with pytest.raises((tinker.RequestFailedError, tinker.APIStatusError)) as info:
        call.result()  # type: ignore[attr-defined]
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)
    return str(info.value)


def id_grid(ids: np.ndarray) -> types.TensorData:
    return types.TensorData(data=ids.reshape(-1).tolist(), dtype="int64", shape=list(ids.shape))


# ---- prompt_alt_tokens_k ----


def test_prompt_alt_tokens_are_k_draws_per_prompt_position_with_their_logprobs(
    service: tinker.ServiceClient,
) -> None:
    sampler = service.create_sampling_client(base_model=TINY).result()
    k = 6
    params = types.SamplingParams(max_tokens=2, seed=21, temperature=1.0)
    answer = sampler.sample(PROMPT, 1, params, prompt_alt_tokens_k=k).result()
    alt = answer.prompt_alt_tokens
    assert alt is not None
    assert alt.tokens.dtype == "int64" and alt.logprobs.dtype == "float32"
    assert alt.tokens.shape == alt.logprobs.shape == [PROMPT.length - 1, k]
    tokens, logprobs = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
    assert np.all(tokens >= 0) and np.all(logprobs <= 0) and np.all(np.isfinite(logprobs))
    # At T = 1 each draw's logprob is the model's logprob of that token at that prompt position.
    scored = sampler.sample(
        PROMPT, 1, types.SamplingParams(max_tokens=1), target_prompt_logprobs=id_grid(tokens)
    ).result()
    np.testing.assert_allclose(logprobs, scored.target_prompt_logprobs.to_numpy(), atol=1e-4)  # type: ignore[union-attr]
    # The same seed draws the same tokens; another seed, others.
    again = sampler.sample(PROMPT, 1, params, prompt_alt_tokens_k=k).result().prompt_alt_tokens
    np.testing.assert_array_equal(again.tokens.to_numpy(), tokens)  # type: ignore[union-attr]
    reseeded = types.SamplingParams(max_tokens=2, seed=22, temperature=1.0)
    other = sampler.sample(PROMPT, 1, reseeded, prompt_alt_tokens_k=k).result().prompt_alt_tokens
    assert not np.array_equal(other.tokens.to_numpy(), tokens)  # type: ignore[union-attr]
    assert sampler.sample(PROMPT, 1, params).result().prompt_alt_tokens is None


def test_prompt_alt_tokens_follow_the_requests_temperature(service: tinker.ServiceClient) -> None:
    sampler = service.create_sampling_client(base_model=TINY).result()
    top = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=1), topk_prompt_logprobs=1).result()
    assert top.topk_prompt_logprobs_np is not None
    best_ids = top.topk_prompt_logprobs_np.token_ids[1:, 0]
    best_logprobs = top.topk_prompt_logprobs_np.logprobs[1:, 0]
    # Greedy: every draw is the most likely token, with its logprob.
    greedy = types.SamplingParams(max_tokens=1, temperature=0.0)
    alt = sampler.sample(PROMPT, 1, greedy, prompt_alt_tokens_k=3).result().prompt_alt_tokens
    assert alt is not None
    np.testing.assert_array_equal(alt.tokens.to_numpy(), np.repeat(best_ids[:, None], 3, axis=1))
    np.testing.assert_allclose(
        alt.logprobs.to_numpy(), np.repeat(best_logprobs[:, None], 3, axis=1), atol=1e-4
    )
    # At T the logprobs are log-softmax(logits / T): two draws at one position differ by 1/T times what
    # they differ by at T = 1.
    warm = types.SamplingParams(max_tokens=1, temperature=0.5, seed=4)
    alt = sampler.sample(PROMPT, 1, warm, prompt_alt_tokens_k=8).result().prompt_alt_tokens
    assert alt is not None
    tokens, at_t = alt.tokens.to_numpy(), alt.logprobs.to_numpy()
    scored = sampler.sample(
        PROMPT, 1, types.SamplingParams(max_tokens=1), target_prompt_logprobs=id_grid(tokens)
    ).result()
    at_1 = scored.target_prompt_logprobs.to_numpy()  # type: ignore[union-attr]
    np.testing.assert_allclose(at_t - at_t[:, :1], (at_1 - at_1[:, :1]) / 0.5, atol=1e-3)
    assert not np.allclose(at_t, at_1, atol=1e-3)


def test_prompt_alt_tokens_k_out_of_range_is_refused_naming_the_field(service: tinker.ServiceClient) -> None:
    sampler = service.create_sampling_client(base_model=TINY).result()
    params = types.SamplingParams(max_tokens=1)
    # The SDK refuses a negative K itself; the engine, K over its cap.
    expect_failure(
        sampler.sample(PROMPT, 1, params, prompt_alt_tokens_k=MAX_ENGINE_TOPK_LOGPROBS + 1),
        "prompt_alt_tokens_k",
        str(MAX_ENGINE_TOPK_LOGPROBS),
    )
    at_cap = sampler.sample(PROMPT, 1, params, prompt_alt_tokens_k=MAX_ENGINE_TOPK_LOGPROBS).result()
    assert at_cap.prompt_alt_tokens is not None
    assert at_cap.prompt_alt_tokens.tokens.shape == [PROMPT.length - 1, MAX_ENGINE_TOPK_LOGPROBS]


# ---- prompt_cache_hit_tokens ----


def busy_training_client(service: tinker.ServiceClient) -> tuple[tinker.TrainingClient, list[types.Datum]]:
    client = service.create_lora_training_client(TINY, rank=4, seed=5).result()
    tokens = list(range(3, 3 + 129))
    batch = [
        types.Datum(
            model_input=types.ModelInput.from_ints(tokens[:-1]),
            loss_fn_inputs={
                "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
                "weights": np.ones(len(tokens) - 1, dtype=np.float32),
            },
        )
    ] * 48
    return client, batch


def test_prompt_cache_hit_tokens_count_the_prompt_tokens_whose_kv_was_reused(
    service: tinker.ServiceClient,
) -> None:
    sampler = service.create_sampling_client(base_model=TINY).result()
    params = types.SamplingParams(max_tokens=3, seed=1)
    # Alone, a request computes its whole prompt (its n samples share that one prefill): no hit.
    alone = sampler.sample(PROMPT, 3, params).result()
    assert alone.prompt_cache_hit_tokens == 0
    # Requests with one prompt that wait together (the compute thread is busy training) are prefilled
    # together: the first computes the prompt's KV, the others reuse all of it.
    client, batch = busy_training_client(service)
    training = client.forward_backward(batch, "cross_entropy")
    waiting = [sampler.sample(PROMPT, 1, params) for _ in range(3)]
    other = sampler.sample(types.ModelInput.from_ints([7, 8, 9]), 1, params)
    training.result()
    hits = sorted(call.result().prompt_cache_hit_tokens for call in waiting)
    assert hits == [0, PROMPT.length, PROMPT.length]
    assert other.result().prompt_cache_hit_tokens == 0
