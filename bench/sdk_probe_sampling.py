"""The SDK probe's SamplingClient calls, SamplingParams and ModelInput chunks (see sdk_probe_core)."""

from __future__ import annotations

import numpy as np
import tinker
from tinker import types

from bench.sdk_probe_core import (
    BATCH,
    PROMPT,
    TINY,
    Probe,
    Refused,
    SilentlyWrong,
    call,
    expect,
    expect_close,
    expect_refused,
    train_step,
)

PARAMS = types.SamplingParams(max_tokens=6, seed=11, stop=[])


def _tokens(p: Probe, params: types.SamplingParams, n: int = 2) -> list[list[int]]:
    return [list(s.tokens) for s in p.base_sampler.sample(PROMPT, n, params).result().sequences]


def _prompt_logprobs(p: Probe) -> list[float]:
    scored = p.base_sampler.compute_logprobs(PROMPT).result()
    expect(scored[0] is None and len(scored) == PROMPT.length, "compute_logprobs shape")
    return [float(x) for x in scored[1:] if x is not None]


@call("SamplingClient.sample(prompt, num_samples, SamplingParams(max_tokens, seed, stop=[]))")
def _sample(p: Probe) -> None:
    same = _tokens(p, PARAMS)
    expect(same == _tokens(p, PARAMS), "the same seed sampled differently")
    expect(all(len(s) == 6 for s in same), "stop=[] runs to max_tokens")
    expect(same != _tokens(p, PARAMS.model_copy(update={"seed": 12})), "another seed sampled the same")


@call("SamplingParams.stop (token ids and strings)")
def _stop(p: Probe) -> None:
    first = _tokens(p, PARAMS, 1)[0]
    stopped = p.base_sampler.sample(PROMPT, 1, PARAMS.model_copy(update={"stop": [first[3]]})).result()
    seq = stopped.sequences[0]
    expect(seq.stop_reason == "stop" and list(seq.tokens) == first[: first.index(first[3]) + 1], "stop id")
    text = p.base_sampler.get_tokenizer().decode(first[2:4])
    by_string = p.base_sampler.sample(PROMPT, 1, PARAMS.model_copy(update={"stop": [text]})).result()
    expect(len(by_string.sequences[0].tokens) <= 4, f"stop string {text!r} did not stop")


@call("SamplingParams.temperature=0 / top_k=1 / top_p (greedy equivalents)")
def _greedy(p: Probe) -> None:
    greedy = _tokens(p, PARAMS.model_copy(update={"temperature": 0.0}))
    expect(greedy[0] == greedy[1], "temperature 0 is not deterministic")
    expect(_tokens(p, PARAMS.model_copy(update={"top_k": 1, "seed": 3}))[0] == greedy[0], "top_k=1 != greedy")
    expect(
        _tokens(p, PARAMS.model_copy(update={"top_p": 1e-6, "seed": 4}))[0] == greedy[0], "top_p~0 != greedy"
    )


@call("SamplingClient.sample(include_prompt_logprobs)")
def _prompt_lp(p: Probe) -> None:
    out = p.base_sampler.sample(PROMPT, 1, PARAMS, include_prompt_logprobs=True).result()
    expect(out.prompt_logprobs is not None and out.prompt_logprobs[0] is None, "prompt logprobs")
    expect_close(out.prompt_logprobs[1:], _prompt_logprobs(p), "prompt logprobs vs compute_logprobs")  # type: ignore[index]


@call("SamplingClient.sample(prompt_logprobs_last_n) / compute_logprobs(prompt_logprobs_last_n)")
def _last_n(p: Probe) -> None:
    full = _prompt_logprobs(p)
    out = p.base_sampler.sample(PROMPT, 1, PARAMS, include_prompt_logprobs=True, prompt_logprobs_last_n=2)
    got = out.result().prompt_logprobs
    expect(got is not None and got[:-2] == [None] * (PROMPT.length - 2), f"last_n: {got}")
    expect_close(got[-2:], full[-2:], "the last 2")  # type: ignore[index]
    scored = p.base_sampler.compute_logprobs(PROMPT, prompt_logprobs_last_n=2).result()
    expect_close(scored[-2:], full[-2:], "compute_logprobs last 2")


@call("SamplingClient.sample(topk_prompt_logprobs)")
def _topk_prompt(p: Probe) -> None:
    out = p.base_sampler.sample(
        PROMPT, 1, PARAMS, include_prompt_logprobs=True, topk_prompt_logprobs=3
    ).result()
    top = out.topk_prompt_logprobs_np
    expect(top is not None and top.token_ids.shape == (PROMPT.length, 3), "topk shape")
    expect(bool(np.all(np.diff(top.logprobs[1:], axis=1) <= 0)), "top-K not most likely first")  # type: ignore[union-attr]


@call("SamplingClient.sample(topk_sample_logprobs)")
def _topk_sample(p: Probe) -> None:
    out = p.base_sampler.sample(
        PROMPT, 1, PARAMS.model_copy(update={"temperature": 0.0}), topk_sample_logprobs=3
    )
    seq = out.result().sequences[0]
    top = seq.topk_logprobs_np
    expect(top is not None and top.token_ids.shape == (len(seq.tokens), 3), "topk sample shape")
    expect(top.token_ids[:, 0].tolist() == list(seq.tokens), "greedy tokens are not the top-1")  # type: ignore[union-attr]


def _grid(p: Probe, sparse: bool) -> tuple[types.TensorData, np.ndarray]:
    tokens = PROMPT.to_ints()
    own = np.asarray(_prompt_logprobs(p))
    n = len(tokens) - 1
    if sparse:
        return types.TensorData(
            data=tokens[1:],
            dtype="int64",
            shape=[n, 4],
            sparse_crow_indices=list(range(n + 1)),
            sparse_col_indices=[2] * n,
        ), own
    ids = np.full((n, 2), -1, dtype=np.int64)
    ids[:, 0] = tokens[1:]
    return types.TensorData.from_numpy(ids), own


@call("SamplingClient.sample(target_prompt_logprobs: dense)")
def _target_dense(p: Probe) -> None:
    grid, own = _grid(p, sparse=False)
    got = (
        p.base_sampler.sample(PROMPT, 1, PARAMS, target_prompt_logprobs=grid).result().target_prompt_logprobs
    )
    expect(got is not None and got.shape == [PROMPT.length - 1, 2], "target shape")
    expect_close(got.to_numpy()[:, 0], own, "target logprobs")  # type: ignore[union-attr]
    expect_close(got.to_numpy()[:, 1], np.zeros(len(own)), "-1 cells")  # type: ignore[union-attr]


@call("SamplingClient.sample(target_prompt_logprobs: sparse)")
def _target_sparse(p: Probe) -> None:
    grid, own = _grid(p, sparse=True)
    got = (
        p.base_sampler.sample(PROMPT, 1, PARAMS, target_prompt_logprobs=grid).result().target_prompt_logprobs
    )
    expect(got is not None and got.sparse_col_indices == grid.sparse_col_indices, "sparse layout")
    expect_close(got.data, own, "sparse target logprobs")  # type: ignore[union-attr]


@call("SamplingClient.sample(prompt_alt_tokens_k)")
def _alt_tokens(p: Probe) -> None:
    out = p.base_sampler.sample(PROMPT, 1, PARAMS, prompt_alt_tokens_k=3).result()
    alt = out.prompt_alt_tokens
    expect(alt is not None and alt.tokens.shape == [PROMPT.length - 1, 3], f"alt tokens {alt}")
    scored = (
        p.base_sampler.sample(PROMPT, 1, PARAMS, topk_prompt_logprobs=200).result().topk_prompt_logprobs_np
    )
    ids, lps = alt.tokens.to_numpy(), alt.logprobs.to_numpy()  # type: ignore[union-attr]
    for row in range(ids.shape[0]):
        listed = dict(zip(scored.token_ids[row + 1].tolist(), scored.logprobs[row + 1].tolist(), strict=True))  # type: ignore[union-attr]
        for token, logprob in zip(ids[row].tolist(), lps[row].tolist(), strict=True):
            expect(token not in listed or abs(listed[token] - logprob) < 1e-3, "alt logprob != the model's")


@call("SampleResponse.prompt_cache_hit_tokens (one prompt, prefilled alone and together)")
def _cache_hits(p: Probe) -> None:
    """The engine keeps no prefix cache between requests: a prompt prefilled alone reuses nothing, and
    requests with one prompt admitted together share one prefill (all of it a hit for all but the first).
    They are held back together by a long decode on other weights; when they are admitted is up to the
    scheduler, so a few tries."""
    expect(
        p.base_sampler.sample(PROMPT, 2, PARAMS).result().prompt_cache_hit_tokens == 0, "a lone prompt hit"
    )
    other = p.new_model(seed=23).save_weights_and_get_sampling_client().result()
    long_decode = types.SamplingParams(max_tokens=300, seed=2, stop=[])
    for _ in range(4):
        running = other.sample(types.ModelInput.from_ints([7, 8, 9]), 2, long_decode)
        hits = [
            f.result().prompt_cache_hit_tokens
            for f in [p.base_sampler.sample(PROMPT, 1, PARAMS) for _ in range(3)]
        ]
        running.result()
        expect(set(hits) <= {0, PROMPT.length} and 0 in hits, f"hits {hits}")
        if PROMPT.length in hits:
            return
    raise SilentlyWrong("no two requests with one prompt ever shared a prefill's KV")


@call("SamplingClient.get_base_model / get_tokenizer / get_telemetry")
def _sampler_misc(p: Probe) -> None:
    expect(p.base_sampler.get_base_model() == TINY, "base model")
    expect(len(p.base_sampler.get_tokenizer().encode("hi")) > 0, "tokenizer")
    p.base_sampler.get_telemetry()


@call("SamplingClient.get_sampler_handle + from_sampler_handle(handle, api_key)")
def _handle(p: Probe) -> None:
    sampler = p.service.create_sampling_client(model_path=p.sampler_path).result()
    again = tinker.SamplingClient.from_sampler_handle(sampler.get_sampler_handle(), api_key=p.engine.api_key)
    try:
        expect_close(
            again.compute_logprobs(PROMPT).result()[1:],
            sampler.compute_logprobs(PROMPT).result()[1:],
            "handle",
        )
    finally:
        # The handle's client runs on a shadow of the session with a heartbeat of its own, which nothing
        # else closes: it would outlive the engine, warning every 10 s, as in a worker process of a user's.
        again.holder.close()


def _with_spans(seq: types.SampledSequence) -> types.Datum:
    """The prompt and a sampled sequence as one stable_reinforce datum, its spans naming the sequence."""
    tokens = [*PROMPT.to_ints(), *seq.tokens]
    n_prompt, n_sampled = PROMPT.length, len(seq.tokens)
    datum = types.Datum(
        model_input=types.ModelInput.from_ints(tokens[:-1]),
        loss_fn_inputs={
            "target_tokens": np.asarray(tokens[1:], dtype=np.int64),
            "logprobs": np.asarray([0.0] * (n_prompt - 1) + list(seq.logprobs or []), dtype=np.float32),
            "advantages": np.asarray([0.0] * (n_prompt - 1) + [1.0] * n_sampled, dtype=np.float32),
        },
    )
    sid = seq.sequence_id
    return datum.with_provenance(
        [
            types.PromptProvenanceSpan(sequence_id=sid, offset=0, length=n_prompt),
            types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=n_sampled - 1),
        ],
        [
            types.PromptProvenanceSpan(sequence_id=sid, offset=1, length=n_prompt - 1),
            types.SampledProvenanceSpan(sequence_id=sid, offset=0, length=n_sampled),
        ],
    )


@call(
    "ServiceClient.create_sampling_client(record_stability_info) / "
    "TrainingClient.create_sampling_client(record_stability_info) + stable_reinforce with provenance"
)
def _stability(p: Probe) -> None:
    """A recording client's sequences train stable_reinforce through their spans; a plain client's
    cannot (the engine recorded nothing for them)."""
    client = p.new_model(seed=21)
    path = client.save_weights_for_sampler("stability").result().path
    recording = [
        p.service.create_sampling_client(model_path=path, record_stability_info=True).result(),
        client.create_sampling_client(path, record_stability_info=True).result(),
    ]
    for sampler in recording:
        seq = sampler.sample(PROMPT, 1, PARAMS).result().sequences[0]
        out = client.forward_backward([_with_spans(seq)], "stable_reinforce").result()
        expect(np.isfinite(out.metrics["loss:sum"]), "stable_reinforce loss")
    plain = p.service.create_sampling_client(model_path=path).result()
    seq = plain.sample(PROMPT, 1, PARAMS).result().sequences[0]
    datum = _with_spans(seq)
    expect_refused(client.forward_backward([datum], "stable_reinforce").result, "record_stability_info")


@call("Datum.with_provenance naming a sequence the engine never sampled (refused)")
def _unknown_provenance(p: Probe) -> None:
    client = p.new_model(seed=22)
    d = BATCH[0]
    n_in, n_out = d.model_input.length, len(d.loss_fn_inputs["target_tokens"].to_numpy())
    spans = [types.SampledProvenanceSpan(sequence_id="no-such-sequence", length=n_in)]
    targets = [types.SampledProvenanceSpan(sequence_id="no-such-sequence", length=n_out)]
    expect_refused(
        lambda: client.forward_backward([d.with_provenance(spans, targets)], "cross_entropy").result(),
        "no-such-sequence",
    )
    train_step(client)  # the refused request did not poison the client


@call("ModelInput.chunks: ImageChunk / ImageAssetPointerChunk / DmelChunk (refused: text-only models)")
def _image_chunks(p: Probe) -> None:
    chunks = [
        *(types.ImageChunk(data=b"\x89PNG\r\n", format=f, expected_tokens=4) for f in ("png", "jpeg")),
        *(
            types.ImageAssetPointerChunk(location="file:///nowhere", format=f, expected_tokens=4)
            for f in ("png", "jpeg")
        ),
        types.DmelChunk(dmel=b"\x00\x01"),
    ]
    for chunk in chunks:
        prompt = types.ModelInput(chunks=[types.EncodedTextChunk(tokens=[5, 6]), chunk])
        expect_refused(p.base_sampler.sample(prompt, 1, PARAMS).result, chunk.type)
    raise Refused("image and dmel chunks: the engine's models read text only")


@call("SamplingClient.on_queue_state_change(queue_state, queue_state_reason)")
def _queue_state(p: Probe) -> None:
    from tinker.lib.api_future_impl import QueueState

    sampler = p.service.create_sampling_client(base_model=TINY).result()
    before = sampler.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens
    for state in QueueState:
        sampler.on_queue_state_change(state, "probe")
    expect(sampler.sample(PROMPT, 1, PARAMS).result().sequences[0].tokens == before, "sampling changed")


@call("ModelInput(chunks=[EncodedTextChunk, EncodedTextChunk])")
def _model_input_chunks(p: Probe) -> None:
    tokens = PROMPT.to_ints()
    split = types.ModelInput(
        chunks=[types.EncodedTextChunk(tokens=tokens[:2]), types.EncodedTextChunk(tokens=tokens[2:])]
    )
    expect_close(
        p.base_sampler.compute_logprobs(split).result()[1:], _prompt_logprobs(p), "two chunks != one prompt"
    )
    expect(
        _tokens(p, PARAMS)
        == [list(s.tokens) for s in p.base_sampler.sample(split, 2, PARAMS).result().sequences],
        "samples",
    )


@call(
    "SamplingClient.create(holder, model_path, base_model, sampling_session_id, retry_config, record_stability_info)"
)
def _sampling_create(p: Probe) -> None:
    from tinker.lib.retry_handler import RetryConfig

    made = tinker.SamplingClient.create(
        p.service.holder, base_model=TINY, retry_config=RetryConfig(), record_stability_info=True
    ).result()
    expect(made.get_base_model() == TINY, "base model")
    from_path = tinker.SamplingClient.create(p.service.holder, model_path=p.sampler_path).result()
    same_session = tinker.SamplingClient.create(
        p.service.holder,
        sampling_session_id=from_path._sampling_session_id,
    ).result()
    expect_close(
        same_session.compute_logprobs(PROMPT).result()[1:],
        from_path.compute_logprobs(PROMPT).result()[1:],
        "session",
    )
