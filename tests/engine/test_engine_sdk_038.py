"""Tinker 0.38's newer sampling options through the unmodified SDK against a real engine: the sampler's
top-K logprobs of sampled tokens (and the cap on K), and the logprobs of given ids at prompt positions
(target_prompt_logprobs, dense and sparse). The optimizer families and soft targets:
test_engine_sdk_038_losses.py."""

from __future__ import annotations

import numpy as np
import pytest
import tinker
from engine_proc import TINY
from tinker import types

from tinkerrpc.contract.limits import MAX_ENGINE_TOPK_LOGPROBS

pytestmark = pytest.mark.process


def expect_failure(call: object, *fragments: str) -> None:
    with pytest.raises((tinker.RequestFailedError, tinker.APIStatusError)) as info:
        call.result()  # type: ignore[attr-defined]
    for fragment in fragments:
        assert fragment in str(info.value), str(info.value)


PROMPT = types.ModelInput.from_ints([5, 17, 42, 8, 99])


@pytest.mark.parametrize("temperature", [1.0, 0.6, 0.0])
def test_topk_sample_logprobs_are_the_sampled_positions_distribution(
    service: tinker.ServiceClient, temperature: float
) -> None:
    sampler = service.create_sampling_client(base_model=TINY).result()
    params = types.SamplingParams(max_tokens=6, seed=11, temperature=temperature, stop=[])
    k = 4
    response = sampler.sample(PROMPT, 2, params, topk_sample_logprobs=k).result()
    for seq in response.sequences:
        top = seq.topk_logprobs_np
        assert top is not None and top.token_ids.shape == top.logprobs.shape == (len(seq.tokens), k)
        assert np.all(np.diff(top.logprobs, axis=1) <= 0) and np.all(top.logprobs <= 0)
        assert all(len(set(row)) == k for row in top.token_ids.tolist())
        for position, (token, logprob) in enumerate(zip(seq.tokens, seq.logprobs, strict=True)):
            listed = dict(zip(top.token_ids[position].tolist(), top.logprobs[position].tolist(), strict=True))
            if temperature == 0.0:
                assert top.token_ids[position, 0] == token
            if token in listed:  # the sampled token's own logprob is the one listed for it
                assert listed[token] == pytest.approx(logprob, abs=1e-4)
        assert seq.topk_logprobs is not None and seq.topk_logprobs[0] == list(
            zip(top.token_ids[0].tolist(), top.logprobs[0].tolist(), strict=True)
        )
        if temperature == 1.0:
            # At T = 1 they are the model's next-token distribution: the prompt top-K of the same tokens.
            extended = types.ModelInput.from_ints(PROMPT.to_ints() + seq.tokens)
            scored = sampler.sample(extended, 1, types.SamplingParams(max_tokens=1), topk_prompt_logprobs=k)
            prompt_top = scored.result().topk_prompt_logprobs_np
            assert prompt_top is not None
            # The first position has no entry: the SDK's sentinel row, which it reads as None.
            assert scored.result().topk_prompt_logprobs[0] is None  # type: ignore[index]
            rows = slice(PROMPT.length, PROMPT.length + len(seq.tokens))
            np.testing.assert_array_equal(top.token_ids, prompt_top.token_ids[rows])
            np.testing.assert_allclose(top.logprobs, prompt_top.logprobs[rows], atol=1e-4)
    plain = sampler.sample(PROMPT, 1, params).result()
    assert plain.sequences[0].topk_logprobs is None


def test_topk_logprobs_out_of_range_are_refused_naming_the_field(service: tinker.ServiceClient) -> None:
    sampler = service.create_sampling_client(base_model=TINY).result()
    params = types.SamplingParams(max_tokens=2)
    for field in ("topk_sample_logprobs", "topk_prompt_logprobs"):
        for k in (-1, MAX_ENGINE_TOPK_LOGPROBS + 1):
            expect_failure(
                sampler.sample(PROMPT, 1, params, **{field: k}), field, str(MAX_ENGINE_TOPK_LOGPROBS)
            )
    at_cap = sampler.sample(PROMPT, 1, params, topk_sample_logprobs=MAX_ENGINE_TOPK_LOGPROBS).result()
    assert at_cap.sequences[0].topk_logprobs_np.token_ids.shape == (2, MAX_ENGINE_TOPK_LOGPROBS)  # type: ignore[union-attr]


def id_grid(rows: list[list[int]]) -> types.TensorData:
    return types.TensorData(
        data=[i for row in rows for i in row], dtype="int64", shape=[len(rows), len(rows[0])]
    )


def scored_prompt(sampler: tinker.SamplingClient, k: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """The prompt's own next-token logprobs and its top-k (ids, logprobs) at positions 1.."""
    response = sampler.sample(
        PROMPT, 1, types.SamplingParams(max_tokens=1), include_prompt_logprobs=True, topk_prompt_logprobs=k
    ).result()
    top = response.topk_prompt_logprobs_np
    assert response.prompt_logprobs_np is not None and top is not None
    return response.prompt_logprobs_np[1:], top.token_ids[1:], top.logprobs[1:]


def test_target_prompt_logprobs_are_the_prompts_logprobs_of_those_ids(service: tinker.ServiceClient) -> None:
    sampler = service.create_sampling_client(base_model=TINY).result()
    own, top_ids, top_logprobs = scored_prompt(sampler, 3)
    tokens = PROMPT.to_ints()
    # Column 0: the prompt's own next tokens; then its top-3 in reverse; -1 asks for nothing.
    rows = [[tokens[i + 1], *reversed(top_ids[i].tolist())] for i in range(len(tokens) - 1)]
    rows[1][2] = -1
    params = types.SamplingParams(max_tokens=2, seed=3)
    answer = sampler.sample(PROMPT, 1, params, target_prompt_logprobs=id_grid(rows)).result()
    assert answer.target_prompt_logprobs is not None and answer.target_prompt_logprobs.shape == [4, 4]
    got = answer.target_prompt_logprobs.to_numpy()
    np.testing.assert_allclose(got[:, 0], own, atol=1e-4)
    expected = top_logprobs[:, ::-1].copy()
    expected[1, 1] = 0.0  # the -1 cell
    np.testing.assert_allclose(got[:, 1:], expected, atol=1e-4)
    assert got[1, 2] == 0.0
    assert sampler.sample(PROMPT, 1, params).result().target_prompt_logprobs is None

    # Two requests on one prompt, prefilled together, each get the logprobs of their own ids.
    other = [[top_ids[i, 0]] for i in range(len(tokens) - 1)]
    first = sampler.sample(PROMPT, 2, params, target_prompt_logprobs=id_grid(rows))
    second = sampler.sample(PROMPT, 1, params, target_prompt_logprobs=id_grid(other))
    np.testing.assert_allclose(first.result().target_prompt_logprobs.to_numpy(), got, atol=1e-5)  # type: ignore[union-attr]
    np.testing.assert_allclose(
        second.result().target_prompt_logprobs.to_numpy()[:, 0],  # type: ignore[union-attr]
        top_logprobs[:, 0],
        atol=1e-4,
    )


def test_sparse_target_prompt_logprobs_answer_the_listed_cells_in_the_same_layout(
    service: tinker.ServiceClient,
) -> None:
    sampler = service.create_sampling_client(base_model=TINY).result()
    own, top_ids, top_logprobs = scored_prompt(sampler, 2)
    tokens = PROMPT.to_ints()
    # Rows 0 and 2 list nothing; row 1 lists cell 5 (its own next token); row 3 cells 0 and 7.
    sparse = types.TensorData(
        data=[tokens[2], int(top_ids[3, 1]), tokens[4]],
        dtype="int64",
        shape=[4, 8],
        sparse_crow_indices=[0, 0, 1, 1, 3],
        sparse_col_indices=[5, 0, 7],
    )
    answer = sampler.sample(PROMPT, 1, types.SamplingParams(max_tokens=1), target_prompt_logprobs=sparse)
    got = answer.result().target_prompt_logprobs
    assert got is not None and got.dtype == "float32" and got.shape == [4, 8]
    assert got.sparse_crow_indices == [0, 0, 1, 1, 3] and got.sparse_col_indices == [5, 0, 7]
    np.testing.assert_allclose(got.data, [own[1], top_logprobs[3, 1], own[3]], atol=1e-4)


def test_bad_target_prompt_logprobs_are_refused_naming_the_field(service: tinker.ServiceClient) -> None:
    sampler = service.create_sampling_client(base_model=TINY).result()
    params = types.SamplingParams(max_tokens=1)
    field = "target_prompt_logprobs"
    bad = {
        "rows": id_grid([[1]] * 5),  # the prompt has 5 tokens: 4 rows
        "K over the cap": id_grid([[1] * (MAX_ENGINE_TOPK_LOGPROBS + 1)] * 4),
        "id past the vocabulary": id_grid([[1], [10**9], [1], [1]]),
        "id below -1": id_grid([[1], [-2], [1], [1]]),
        "row pointers": types.TensorData(
            data=[1], dtype="int64", shape=[4, 2], sparse_crow_indices=[0, 1, 1], sparse_col_indices=[0]
        ),
        "column past K": types.TensorData(
            data=[1], dtype="int64", shape=[4, 2], sparse_crow_indices=[0, 1, 1, 1, 1], sparse_col_indices=[2]
        ),
        "repeated column": types.TensorData(
            data=[1, 2],
            dtype="int64",
            shape=[4, 2],
            sparse_crow_indices=[0, 2, 2, 2, 2],
            sparse_col_indices=[1, 1],
        ),
    }
    for case, grid in bad.items():
        with pytest.raises((tinker.RequestFailedError, tinker.APIStatusError)) as info:
            sampler.sample(PROMPT, 1, params, target_prompt_logprobs=grid).result()
        assert field in str(info.value), (case, str(info.value))
    # The sampler still answers.
    ok = sampler.sample(PROMPT, 1, params, target_prompt_logprobs=id_grid([[1]] * 4)).result()
    assert ok.target_prompt_logprobs is not None
