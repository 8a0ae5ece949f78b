"""Tinker 0.38's sampling semantics through the unmodified SDK against a real engine: K alternative tokens
per prompt position, the prompt tokens whose KV a request reused, inflight sampling clients that follow
later saves, provenance spans checked against what the engine sampled, and the stability information
recorded per sampled sequence for stable_reinforce."""

from __future__ import annotations

import dataclasses
from typing import Any

import httpx
import numpy as np
import pytest
import tinker
from engine_proc import TINY, seq_gaps
from tinker import types

from tinkerrpc.contract.limits import MAX_ENGINE_TOPK_LOGPROBS
from tinkerrpc_server.local.stack import LocalEngine

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


def test_prompt_cache_hit_tokens_count_the_prompt_tokens_whose_kv_was_reused(
    service: tinker.ServiceClient,
) -> None:
    sampler = service.create_sampling_client(base_model=TINY).result()
    params = types.SamplingParams(max_tokens=3, seed=1)
    # Alone, a request computes its whole prompt (its n samples share that one prefill): no hit.
    assert sampler.sample(PROMPT, 3, params).result().prompt_cache_hit_tokens == 0
    # Requests with one prompt that wait together are prefilled together: the first computes the
    # prompt's KV, each other one reuses all of it. They wait while the compute thread decodes for other
    # weights; when they are admitted is up to the scheduler, so a few tries, each exact.
    client = service.create_lora_training_client(TINY, rank=4, seed=5).result()
    other_weights = client.save_weights_and_get_sampling_client().result()
    long_decode = types.SamplingParams(max_tokens=400, seed=2, stop=[])
    shared = 0
    for _ in range(5):
        running = other_weights.sample(types.ModelInput.from_ints([7, 8, 9]), 4, long_decode)
        waiting = [sampler.sample(PROMPT, 1, params) for _ in range(3)]
        hits = [call.result().prompt_cache_hit_tokens for call in waiting]
        assert running.result().prompt_cache_hit_tokens == 0
        assert set(hits) <= {0, PROMPT.length} and 0 in hits, hits
        shared += hits.count(PROMPT.length)
        if shared:
            break
    assert shared > 0, "no two requests with one prompt were ever prefilled together"


# ---- what the engine sampled: provenance spans, inflight weights, stability information ----


def sequence_info(engine: LocalEngine, sequence_id: str) -> dict[str, Any]:
    """The engine extension that says which weights produced a sampled sequence's tokens."""
    response = httpx.get(
        f"{engine.base_url}/api/v1/sampled_sequences/{sequence_id}", headers=engine.auth_headers, timeout=30
    )
    response.raise_for_status()
    info: dict[str, Any] = response.json()
    return info


def sampled_datum(
    prompt: list[int], seq: types.SampledSequence, logprobs: np.ndarray | None = None
) -> types.Datum:
    """The prompt and the sampled tokens as one datum, with the spans that say where each token came from:
    input = prompt + sampled[:-1], targets = prompt[1:] + sampled; RL inputs on the sampled part."""
    tokens = prompt + seq.tokens
    n_prompt, n_sampled = len(prompt), len(seq.tokens)
    sampler_logprobs = np.asarray(seq.logprobs if logprobs is None else logprobs, dtype=np.float32)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "logprobs": np.concatenate([np.zeros(n_prompt - 1, np.float32), sampler_logprobs]),
            "advantages": np.concatenate(
                [np.zeros(n_prompt - 1, np.float32), np.full(n_sampled, 1.5, np.float32)]
            ),
        },
    )
    sid = seq.sequence_id
    return datum.with_provenance(
        model_input=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=0, length=n_prompt),
            types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=n_sampled - 1),
        ],
        loss_fn_inputs=[
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n_prompt - 1),
            types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=n_sampled),
        ],
    )


def with_spans(datum: types.Datum, model_input: list[Any], loss_fn_inputs: list[Any]) -> types.Datum:
    return dataclasses.replace(datum, model_input_spans=model_input, loss_fn_input_spans=loss_fn_inputs)


def test_provenance_spans_are_checked_against_what_the_engine_sampled(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    sampler = service.create_sampling_client(base_model=TINY).result()
    prompt = PROMPT.to_ints()
    seq = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=4, seed=2, stop=[])).result().sequences[0]
    good = sampled_datum(prompt, seq)
    client = service.create_lora_training_client(TINY, rank=4, seed=1).result()
    accepted = client.forward_backward([good], "importance_sampling").result()
    assert np.isfinite(accepted.metrics["loss:sum"])

    spans = good.model_input_spans, good.loss_fn_input_spans
    assert spans[0] is not None and spans[1] is not None
    never = types.PromptProvenanceSpan(sequence_id="req-00000000-1:0", offset=0, length=len(prompt))
    past_end = types.SampledProvenanceSpan(sequence_id=seq.sequence_id, offset=1, length=len(seq.tokens))
    shifted = types.PromptProvenanceSpan(sequence_id=seq.sequence_id, offset=0, length=len(prompt) - 1)
    bad = {
        "was not sampled by this engine": with_spans(good, [never, spans[0][1]], list(spans[1])),
        "past the end of sequence": with_spans(good, list(spans[0]), [spans[1][0], past_end]),
        # The target tokens are prompt[1:], not prompt[:-1].
        "are not sequence": with_spans(good, list(spans[0]), [shifted, spans[1][1]]),
    }
    for message, datum in bad.items():
        expect_failure(client.forward_backward([datum], "importance_sampling"), message)
    # The refusals changed nothing and kept their turns: the client answers as before.
    again = client.forward_backward([good], "importance_sampling").result()
    assert again.metrics["loss:sum"] == pytest.approx(accepted.metrics["loss:sum"], rel=1e-5)
    assert seq_gaps(engine, client.model_id) == []


def test_an_inflight_sampling_client_follows_the_weights_saved_later(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    client = service.create_lora_training_client(TINY, rank=4, seed=9).result()
    snapshot = client.save_weights_and_get_sampling_client().result()
    inflight = client.save_weights_and_get_sampling_client(kind="inflight").result()
    greedy = types.SamplingParams(max_tokens=5, temperature=0.0, stop=[])

    def answer(sampler: tinker.SamplingClient) -> tuple[list[int], list[float], dict[str, Any]]:
        seq = sampler.sample(PROMPT, 1, greedy).result().sequences[0]
        return seq.tokens, seq.logprobs or [], sequence_info(engine, seq.sequence_id)

    tokens_v1, logprobs_v1, info = answer(inflight)
    assert info["weights"] == [
        {"start": 0, "length": 5, "model_path": info["weights"][0]["model_path"], "weights_version": 1}
    ]
    first_path = info["weights"][0]["model_path"]
    _, snapshot_logprobs, snapshot_info = answer(snapshot)
    assert snapshot_info["weights"][0]["weights_version"] is None
    np.testing.assert_allclose(snapshot_logprobs, logprobs_v1, atol=1e-5)  # the same weights so far

    target = PROMPT.to_ints() + tokens_v1
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(target[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(target[1:], dtype=np.int64),
            "weights": np.ones(len(target) - 1, dtype=np.float32),
        },
    )
    for _ in range(3):
        client.forward_backward([datum], "cross_entropy").result()
        client.optim_step(types.AdamParams(learning_rate=5e-2)).result()
    newer = client.save_weights_and_get_sampling_client(kind="inflight").result()

    # The first inflight client now samples from the newer weights, as the newer client does.
    tokens_old_client, logprobs_old_client, info = answer(inflight)
    tokens_new_client, logprobs_new_client, newer_info = answer(newer)
    assert info["weights"][0]["weights_version"] == newer_info["weights"][0]["weights_version"] == 2
    assert info["weights"][0]["model_path"] == newer_info["weights"][0]["model_path"] != first_path
    assert tokens_old_client == tokens_new_client
    np.testing.assert_allclose(logprobs_old_client, logprobs_new_client, atol=1e-5)
    assert not np.allclose(logprobs_old_client, logprobs_v1, atol=1e-3), "training changed nothing"
    # The snapshot client keeps the weights it was made with.
    np.testing.assert_allclose(answer(snapshot)[1], snapshot_logprobs, atol=1e-5)


def test_stable_reinforce_uses_the_stability_information_recorded_per_sequence(
    service: tinker.ServiceClient, engine: LocalEngine
) -> None:
    client = service.create_lora_training_client(TINY, rank=4, seed=4).result()
    recording = client.save_weights_and_get_sampling_client(record_stability_info=True).result()
    plain = client.save_weights_and_get_sampling_client().result()
    params = types.SamplingParams(max_tokens=4, seed=8, stop=[])
    prompt = PROMPT.to_ints()
    seq = recording.sample(PROMPT, 1, params).result().sequences[0]
    assert sequence_info(engine, seq.sequence_id)["stability_info_recorded"] is True
    config = {"kl_coeff": 0.1}

    def loss(datum: types.Datum) -> float:
        return float(
            client.forward_backward([datum], "stable_reinforce", config).result().metrics["loss:sum"]
        )

    true_loss = loss(sampled_datum(prompt, seq))
    # The datum's logprobs are wrong (a client's bookkeeping slip); the recorded ones replace them where
    # its spans name the sequence, so the loss is the true one.
    wrong = np.asarray(seq.logprobs, dtype=np.float32) - 0.7
    assert loss(sampled_datum(prompt, seq, wrong)) == pytest.approx(true_loss, rel=1e-5)
    # Without spans there is nothing to look up: the datum's own logprobs count.
    unattributed = dataclasses.replace(
        sampled_datum(prompt, seq, wrong), model_input_spans=None, loss_fn_input_spans=None
    )
    assert loss(unattributed) != pytest.approx(true_loss, rel=1e-3)
    # A sequence sampled without record_stability_info cannot feed stable_reinforce by its spans.
    unrecorded = plain.sample(PROMPT, 1, params).result().sequences[0]
    assert sequence_info(engine, unrecorded.sequence_id)["stability_info_recorded"] is False
    expect_failure(
        client.forward_backward([sampled_datum(prompt, unrecorded)], "stable_reinforce", config),
        "record_stability_info",
    )
    assert seq_gaps(engine, client.model_id) == []
