"""Token choice (engine/compute/token_choice.py), on torch's ops and on the fused CPU kernel, against the
plain definition: a row's token is the first vocabulary index whose cumulative softmax(logits / T) mass
exceeds its uniform draw (greedy rows: the argmax), and its logprob is log-softmax(logits / T) there, for
vocabularies that fill whole blocks of the two-level inverse CDF and for those that do not; a row's
token and logprob do not depend on the rows beside it."""

from __future__ import annotations

import pytest
import torch

from tinkerrpc_server.engine.compute.execution_plan import process_plan
from tinkerrpc_server.engine.compute.token_choice import RowSampling, choose

pytestmark = pytest.mark.unit


@pytest.fixture(params=[False, True], ids=["torch", "kernel"])
def kernels(request: pytest.FixtureRequest) -> bool:
    on_kernel = bool(request.param)
    if on_kernel and not process_plan().cpu_kernels:
        pytest.skip("the fused CPU kernels are not built here")
    return on_kernel


def _reference(
    logits: torch.Tensor, temperatures: torch.Tensor, uniforms: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    greedy = temperatures <= 0
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures).double()
    logprobs = torch.log_softmax(logits.double() / scale.unsqueeze(-1), dim=-1)
    cdf = logprobs.exp().cumsum(-1)
    drawn = torch.searchsorted(cdf, (uniforms.double() * cdf[:, -1]).unsqueeze(-1), right=True).squeeze(-1)
    tokens = torch.where(greedy, logits.argmax(-1), drawn.clamp(max=logits.shape[-1] - 1))
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


@pytest.mark.parametrize("vocab", [151_936, 49_152, 1000, 7])
def test_tokens_and_logprobs_are_the_plain_definitions(vocab: int, kernels: bool) -> None:
    generator = torch.Generator().manual_seed(vocab)
    rows = 48
    logits = torch.randn(rows, vocab, generator=generator) * 4
    temperatures = torch.tensor([1.0, 0.7, 0.0, 1.3] * (rows // 4))
    uniforms = torch.rand(rows, generator=generator)
    uniforms[:2] = torch.tensor([0.0, 1.0 - 1e-7])  # the ends of the distribution
    off = torch.zeros(rows, dtype=torch.long), torch.ones(rows)
    tokens, logprobs = choose(logits, RowSampling.of(temperatures, *off), uniforms, kernels)
    expected_tokens, expected_logprobs = _reference(logits, temperatures, uniforms)
    # float32 sums may put a draw within ~1e-6 of a boundary on the other side: allow one such row.
    assert int((tokens != expected_tokens).sum()) <= 1
    same = tokens == expected_tokens
    torch.testing.assert_close(logprobs[same].double(), expected_logprobs[same], atol=2e-5, rtol=0)
    assert bool((tokens < vocab).all()) and bool((tokens >= 0).all())


def test_a_draw_follows_the_distribution(kernels: bool) -> None:
    """Over many uniforms, how often each token is drawn matches its probability."""
    probabilities = torch.tensor([0.05, 0.6, 0.0, 0.35] + [0.0] * 2044)
    logits = probabilities.clamp(min=1e-30).log().expand(20_000, -1)
    uniforms = torch.rand(20_000, generator=torch.Generator().manual_seed(3))
    off = torch.zeros(20_000, dtype=torch.long), torch.ones(20_000)
    tokens, _ = choose(logits, RowSampling.of(torch.ones(20_000), *off), uniforms, kernels)
    counts = torch.bincount(tokens, minlength=2048).double() / 20_000
    torch.testing.assert_close(counts[:4], probabilities[:4].double(), atol=0.015, rtol=0)
    assert counts[4:].sum() == 0


def test_a_rows_choice_does_not_depend_on_the_rows_beside_it(kernels: bool) -> None:
    """The same row, alone or beside greedy and top-k/top-p rows, gets the same token and logprob; the
    top-k/top-p rows keep to their truncation and a greedy row takes its argmax whatever its top-k."""
    generator = torch.Generator().manual_seed(11)
    vocab = 3000
    logits = torch.randn(4, vocab, generator=generator) * 3
    uniforms = torch.rand(4, generator=generator)
    temperatures = torch.tensor([0.9, 0.0, 1.0, 1.2])
    top_ks = torch.tensor([0, 5, 2, 0])
    top_ps = torch.tensor([1.0, 1.0, 1.0, 0.5])
    tokens, logprobs = choose(logits, RowSampling.of(temperatures, top_ks, top_ps), uniforms, kernels)
    for row in range(4):
        one = slice(row, row + 1)
        alone = choose(
            logits[one], RowSampling.of(temperatures[one], top_ks[one], top_ps[one]), uniforms[one], kernels
        )
        assert (int(alone[0]), float(alone[1])) == (int(tokens[row]), float(logprobs[row]))
    assert int(tokens[1]) == int(logits[1].argmax())
    assert int(tokens[2]) in logits[2].topk(2).indices.tolist()
    expected = torch.log_softmax(logits / torch.where(temperatures > 0, temperatures, 1.0).unsqueeze(-1), -1)
    torch.testing.assert_close(
        logprobs, expected.gather(-1, tokens.unsqueeze(-1)).squeeze(-1), atol=2e-5, rtol=0
    )


def test_the_kernel_and_torch_choose_alike() -> None:
    """Over many rows the kernel's choice is torch's: the same tokens but for draws within rounding of a
    boundary, logprobs within float rounding."""
    if not process_plan().cpu_kernels:
        pytest.skip("the fused CPU kernels are not built here")
    generator = torch.Generator().manual_seed(5)
    rows, vocab = 256, 49_152
    logits = torch.randn(rows, vocab, generator=generator) * 5
    temperatures = torch.tensor([1.0, 0.6, 0.0, 1.5] * (rows // 4))
    uniforms = torch.rand(rows, generator=generator)
    off = torch.zeros(rows, dtype=torch.long), torch.ones(rows)
    on_torch = choose(logits, RowSampling.of(temperatures, *off), uniforms, kernels=False)
    on_kernel = choose(logits, RowSampling.of(temperatures, *off), uniforms, kernels=True)
    same = on_torch[0] == on_kernel[0]
    assert int((~same).sum()) <= 1
    torch.testing.assert_close(on_kernel[1][same], on_torch[1][same], atol=1e-5, rtol=0)
