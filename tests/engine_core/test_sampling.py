"""BaseModelRuntime.sample: seeds, greedy decoding, stops, logprobs, and isolation from training."""

from __future__ import annotations

from pathlib import Path

import numpy as np
import pytest
import torch
from engine_core_ref import load_plain_model

from tinkerrpc_server.engine.compute.samples import SampleJob
from tinkerrpc_server.engine.runtime import (
    BaseModelRuntime,
    DatumArrays,
    EngineUserError,
    LoraSpec,
)

pytestmark = pytest.mark.unit

PROMPT = [1, 291, 201, 420, 311, 408, 14, 338, 310, 409, 16, 2, 201, 1, 293, 201]


def learner_logprobs(
    runtime: BaseModelRuntime, model_id: str, prompt: list[int], completion: list[int]
) -> np.ndarray:
    tokens = np.array(prompt + completion, dtype=np.int64)
    n = len(tokens) - 1
    datum = DatumArrays(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.zeros(n, np.float32)})
    return runtime.forward_backward(model_id, [datum], "cross_entropy", None, backward=False).logprobs[0]


def test_same_seed_same_tokens_alone_or_batched(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    job = SampleJob(PROMPT, num_samples=3, max_tokens=12, seed=42, stop_token_ids=[])
    alone = runtime.sample(sampler_dir, [job])[0]
    again = runtime.sample(sampler_dir, [job])[0]
    crowd = runtime.sample(
        sampler_dir,
        [SampleJob([5, 6, 7], 2, 20, seed=1), job, SampleJob(PROMPT * 2, 4, 3, temperature=0.7)],
    )[1]
    tokens = [s.tokens for s in alone.sequences]
    assert tokens == [s.tokens for s in again.sequences] == [s.tokens for s in crowd.sequences]
    assert len({tuple(t) for t in tokens}) == 3  # samples within a job differ
    other_seed = runtime.sample(sampler_dir, [SampleJob(PROMPT, 3, 12, seed=43, stop_token_ids=[])])[0]
    assert [s.tokens for s in other_seed.sequences] != tokens


def test_temperature_zero_is_argmax(
    runtime: BaseModelRuntime, sampler_dir: Path, tiny_model_path: Path
) -> None:
    out = runtime.sample(None, [SampleJob(PROMPT, 2, 10, temperature=0.0, stop_token_ids=[])])[0]
    model = load_plain_model(tiny_model_path)
    tokens = list(PROMPT)
    with torch.no_grad():
        for _ in range(10):
            tokens.append(int(model(input_ids=torch.tensor([tokens])).logits[0, -1].argmax()))
    assert out.sequences[0].tokens == out.sequences[1].tokens == tokens[len(PROMPT) :]
    assert all(s.stop_reason == "length" for s in out.sequences)


def test_sampled_logprobs_equal_learner_logprobs(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    runtime.load_state("policy-copy", sampler_dir, include_optimizer=False)
    out = runtime.sample(sampler_dir, [SampleJob(PROMPT, 4, 16, seed=5, stop_token_ids=[])])[0]
    for seq in out.sequences:
        expected = learner_logprobs(runtime, "policy-copy", PROMPT, seq.tokens)[len(PROMPT) - 1 :]
        np.testing.assert_allclose(seq.logprobs, expected, atol=1e-4)
    greedy = runtime.sample(sampler_dir, [SampleJob(PROMPT, 1, 8, temperature=0.0, stop_token_ids=[])])[0]
    seq = greedy.sequences[0]
    expected = learner_logprobs(runtime, "policy-copy", PROMPT, seq.tokens)[len(PROMPT) - 1 :]
    np.testing.assert_allclose(seq.logprobs, expected, atol=1e-4)
    runtime.delete_adapter("policy-copy")


def test_prompt_logprobs_match_the_learner(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    runtime.load_state("policy-copy", sampler_dir, include_optimizer=False)
    job = SampleJob(PROMPT, 1, 1, include_prompt_logprobs=True, topk_prompt_logprobs=3)
    out = runtime.sample(sampler_dir, [SampleJob([7, 8], 2, 2), job])[1]
    assert out.prompt_logprobs is not None and out.topk_prompt_logprobs is not None
    assert out.prompt_logprobs[0] is None and out.topk_prompt_logprobs[0] is None
    expected = learner_logprobs(runtime, "policy-copy", PROMPT[:1], PROMPT[1:])
    np.testing.assert_allclose(np.array(out.prompt_logprobs[1:], dtype=np.float64), expected, atol=1e-4)
    for position, top in enumerate(out.topk_prompt_logprobs[1:], start=1):
        assert top is not None and len(top) == 3
        assert [v for _, v in top] == sorted((v for _, v in top), reverse=True)
        assert top[0][1] >= out.prompt_logprobs[position] - 1e-6  # type: ignore[operator]
    runtime.delete_adapter("policy-copy")


def test_prompt_logprobs_of_the_last_n_positions_only(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    every = SampleJob(PROMPT, 1, 1, include_prompt_logprobs=True)
    last_three = SampleJob(PROMPT, 1, 1, include_prompt_logprobs=True, prompt_logprobs_last_n=3)
    full, trimmed = runtime.sample(sampler_dir, [every, last_three])
    assert full.prompt_logprobs is not None and trimmed.prompt_logprobs is not None
    assert len(trimmed.prompt_logprobs) == len(PROMPT)
    assert trimmed.prompt_logprobs[:-3] == [None] * (len(PROMPT) - 3)
    np.testing.assert_allclose(trimmed.prompt_logprobs[-3:], full.prompt_logprobs[-3:], atol=1e-5)  # type: ignore[arg-type]


def test_stop_token_ids_default_stops_and_max_tokens(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    free = runtime.sample(sampler_dir, [SampleJob(PROMPT, 1, 12, temperature=0.0, stop_token_ids=[])])[0]
    greedy = free.sequences[0].tokens
    stop_id = greedy[4]
    first = greedy.index(stop_id)
    stopped = runtime.sample(
        sampler_dir, [SampleJob(PROMPT, 1, 12, temperature=0.0, stop_token_ids=[stop_id])]
    )
    seq = stopped[0].sequences[0]
    assert seq.tokens == greedy[: first + 1] and seq.stop_reason == "stop"

    short = runtime.sample(sampler_dir, [SampleJob(PROMPT, 1, 3, temperature=0.0, stop_token_ids=[])])[0]
    assert short.sequences[0].tokens == greedy[:3] and short.sequences[0].stop_reason == "length"

    im_end = runtime.tokenizer.convert_tokens_to_ids("<|im_end|>")
    assert im_end in runtime.default_stop_token_ids
    defaults = runtime.sample(sampler_dir, [SampleJob(PROMPT, 8, 40, seed=9)])[0]
    for seq in defaults.sequences:
        stops = [i for i, t in enumerate(seq.tokens) if t in runtime.default_stop_token_ids]
        if seq.stop_reason == "stop":
            assert stops == [len(seq.tokens) - 1]
        else:
            assert not stops and len(seq.tokens) == 40


def test_stop_strings_end_the_sequence_at_the_completing_token(
    runtime: BaseModelRuntime, sampler_dir: Path
) -> None:
    free = runtime.sample(sampler_dir, [SampleJob(PROMPT, 1, 12, temperature=0.0, stop_token_ids=[])])[0]
    tokens = free.sequences[0].tokens
    text = runtime.tokenizer.decode(tokens)
    # A stop string spanning the end of token 5 and the start of token 6.
    prefix5 = runtime.tokenizer.decode(tokens[:5])
    prefix6 = runtime.tokenizer.decode(tokens[:6])
    stop = prefix5[-2:] + prefix6[len(prefix5) :][:1] if len(prefix6) > len(prefix5) else prefix6[-1:]
    first_hit = next(i for i in range(1, len(tokens) + 1) if stop in runtime.tokenizer.decode(tokens[:i]))
    job = SampleJob(
        PROMPT, 1, 12, temperature=0.0, stop_token_ids=[], stop_strings=[stop, "never-produced-xyz"]
    )
    seq = runtime.sample(sampler_dir, [job])[0].sequences[0]
    assert stop in text
    assert seq.tokens == tokens[:first_hit] and seq.stop_reason == "stop"


def test_sampling_leaves_training_state_alone(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    runtime.create_adapter("trainee", LoraSpec(rank=4, seed=1))
    tokens = np.arange(1, 13, dtype=np.int64)
    datum = DatumArrays(tokens[:-1], {"target_tokens": tokens[1:], "weights": np.ones(11, np.float32)})
    before = runtime.forward_backward("trainee", [datum], "cross_entropy", None, backward=True)
    grads = {
        n: p.grad.clone() for n, p in runtime.adapter_parameters("trainee").items() if p.grad is not None
    }
    runtime.sample(sampler_dir, [SampleJob(PROMPT, 2, 5, seed=1)])
    runtime.sample(None, [SampleJob(PROMPT, 2, 5, seed=1)])
    after = runtime.forward_backward("trainee", [datum], "cross_entropy", None, backward=False)
    np.testing.assert_array_equal(before.logprobs[0], after.logprobs[0])
    params = runtime.adapter_parameters("trainee")
    assert grads and all(torch.equal(params[n].grad, g) for n, g in grads.items())  # type: ignore[arg-type]
    assert all(p.requires_grad for p in params.values())
    runtime.delete_adapter("trainee")


def test_base_model_samples_differ_from_the_adapter(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    job = SampleJob(PROMPT, 1, 10, temperature=0.0, stop_token_ids=[])
    base = runtime.sample(None, [job])[0].sequences[0].tokens
    adapted = runtime.sample(sampler_dir, [job])[0].sequences[0].tokens
    assert base != adapted


@pytest.mark.parametrize(
    ("job", "fragment"),
    [
        (SampleJob([], 1, 4), "prompt is empty"),
        (SampleJob([1, 100000], 1, 4), "outside the vocabulary"),
        (SampleJob([1, -1], 1, 4), "outside the vocabulary"),
        (SampleJob([1, 2], 0, 4), "num_samples"),
        (SampleJob([1, 2], 1, 0), "max_tokens"),
        (SampleJob([1] * 2040, 1, 10), "context"),
        (SampleJob([1, 2], 1, 4, temperature=-1.0), "temperature"),
        (SampleJob([1, 2], 1, 4, top_p=0.0), "top_p"),
        (SampleJob([1, 2], 1, 4, top_k=-5), "top_k"),
        (SampleJob([1, 2], 1, 4, top_k=-1), "top_k must be 0 \\(off\\)"),
        (SampleJob([1, 2, 3], 1, 4, prompt_logprobs_last_n=3), "prompt_logprobs_last_n"),
        (SampleJob([1, 2, 3], 1, 4, prompt_logprobs_last_n=0), "prompt_logprobs_last_n"),
        (SampleJob([1, 2], 1, 4, stop_token_ids=[10**6]), "outside the vocabulary"),
        (SampleJob([1, 2], 1, 4, stop_strings=[""]), "stop strings"),
    ],
)
def test_bad_sample_jobs_are_refused(runtime: BaseModelRuntime, job: SampleJob, fragment: str) -> None:
    with pytest.raises(EngineUserError, match=fragment):
        runtime.sample(None, [SampleJob([1, 2], 1, 2), job])


def test_topk_sample_logprobs_up_to_the_whole_vocabulary(runtime: BaseModelRuntime) -> None:
    vocab = runtime.vocab_size
    with pytest.raises(EngineUserError, match=f"topk_sample_logprobs must be in \\[0, {vocab}\\]"):
        runtime.sample(None, [SampleJob([1, 2], 1, 2, topk_sample_logprobs=vocab + 1)])
    job = SampleJob([1, 2], 1, 3, temperature=0.7, seed=3, stop_token_ids=[], topk_sample_logprobs=vocab)
    (seq,) = runtime.sample(None, [job])[0].sequences
    assert seq.topk_logprobs is not None and seq.topk_logprobs.token_ids.shape == (3, vocab)
    # The whole distribution at the row's temperature: every token once, the probabilities sum to 1.
    assert all(sorted(row) == list(range(vocab)) for row in seq.topk_logprobs.token_ids.tolist())
    np.testing.assert_allclose(
        np.exp(seq.topk_logprobs.logprobs.astype(np.float64)).sum(axis=1), 1.0, atol=1e-4
    )
    for position, token in enumerate(seq.tokens):
        listed = seq.topk_logprobs.logprobs[position][seq.topk_logprobs.token_ids[position] == token]
        assert listed[0] == pytest.approx(seq.logprobs[position], abs=1e-5)


def test_missing_sampler_weights_are_refused(runtime: BaseModelRuntime, tmp_path: Path) -> None:
    with pytest.raises(EngineUserError, match="no sampler weights"):
        runtime.sample(tmp_path / "nothing-here", [SampleJob([1, 2], 1, 2)])


def test_top_k_and_top_p_restrict_the_choices(runtime: BaseModelRuntime, sampler_dir: Path) -> None:
    greedy = runtime.sample(sampler_dir, [SampleJob(PROMPT, 1, 6, temperature=0.0, stop_token_ids=[])])[0]
    for job in (
        SampleJob(PROMPT, 6, 6, top_k=1, seed=3, stop_token_ids=[]),
        SampleJob(PROMPT, 6, 6, top_p=1e-6, seed=3, stop_token_ids=[]),
    ):
        out = runtime.sample(sampler_dir, [job])[0]
        assert all(s.tokens == greedy.sequences[0].tokens for s in out.sequences)
    loose = runtime.sample(
        sampler_dir, [SampleJob(PROMPT, 6, 6, top_k=50, top_p=0.9, seed=3, stop_token_ids=[])]
    )
    assert len({tuple(s.tokens) for s in loose[0].sequences}) > 1
