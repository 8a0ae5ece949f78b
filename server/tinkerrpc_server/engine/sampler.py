"""Batched autoregressive sampling with a KV cache and per-sequence random generators.

Our own decoding loop instead of `generate()`: every knob (temperature, top-k, top-p, stops) is
per sequence, the randomness of a sequence depends only on its seed (not on what else is in the
batch), and the returned logprobs are computed from exactly the logits we sample from. A batch can
pause between decode steps (for queued training work) and stops decoding rows nobody waits for.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol

import torch


@dataclass
class SampleRequest:
    prompt: list[int]
    num_samples: int
    max_tokens: int
    temperature: float  # 0 = greedy
    top_k: int  # 0 = off
    top_p: float
    stop_token_ids: frozenset[int]
    stop_strings: list[str]
    seed: int | None
    include_prompt_logprobs: bool
    topk_prompt_logprobs: int


@dataclass
class GeneratedSeq:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str  # "stop" | "length"


@dataclass
class RequestResult:
    sequences: list[GeneratedSeq]
    prompt_logprobs: list[float | None] | None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None


@dataclass
class _Row:
    request: SampleRequest
    generator: torch.Generator
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str | None = None


class DecodeBreaks(Protocol):
    """What a batch does between two decode steps (the compute worker's side of it)."""

    def abandoned(self) -> Collection[int]:
        """Indices of the requests nobody waits for any more: their rows stop decoding."""
        ...

    def other_work_waiting(self) -> bool:
        """Whether work that should not wait for the whole batch is queued."""
        ...

    def run_other_work(self) -> None:
        """Run some of that work; it runs outside `model_context`."""
        ...


class _NoBreaks:
    """Decode straight through."""

    def abandoned(self) -> Collection[int]:
        return ()

    def other_work_waiting(self) -> bool:
        return False

    def run_other_work(self) -> None:
        pass


NO_BREAKS: DecodeBreaks = _NoBreaks()


def generate(
    model_context: Callable[[], AbstractContextManager[torch.nn.Module]],
    requests: list[SampleRequest],
    tokenizer: object,
    device: torch.device,
    breaks: DecodeBreaks,
) -> list[RequestResult]:
    """Sample every request's num_samples continuations in one left-padded batch.

    The model is used only inside `model_context()`; when `breaks` has other work waiting, decoding
    leaves that context between two steps, lets the work run, and re-enters it (the KV cache is kept).
    """
    decoding = _Decoding(requests, tokenizer, device)
    while True:
        with model_context() as model:
            decoding.advance(model, breaks)
        if decoding.finished:
            return decoding.results()
        breaks.run_other_work()


class _Decoding:
    """The state of one batch's decoding, advanced by `advance` until every row has stopped."""

    def __init__(self, requests: list[SampleRequest], tokenizer: object, device: torch.device) -> None:
        self.requests = requests
        self.tokenizer = tokenizer
        self.device = device
        self.rows: list[_Row] = []
        self.request_of_row: list[int] = []
        for request_index, request in enumerate(requests):
            for sample_index in range(request.num_samples):
                seed = request.seed + sample_index if request.seed is not None else _fresh_seed()
                generator = torch.Generator(device="cpu")
                generator.manual_seed(seed % (2**63))
                self.rows.append(_Row(request, generator, [], []))
                self.request_of_row.append(request_index)
        self.pad_id = int(getattr(tokenizer, "pad_token_id", None) or 0)
        self.steps_left = max(r.request.max_tokens for r in self.rows)
        self.finished = False
        self.prompt_stats: dict[int, tuple[list[float | None], list[list[tuple[int, float]] | None]]] = {}
        self.temperatures = torch.tensor(
            [r.request.temperature for r in self.rows], dtype=torch.float32, device=device
        )
        self.top_ks = torch.tensor([r.request.top_k for r in self.rows], dtype=torch.long, device=device)
        self.top_ps = torch.tensor([r.request.top_p for r in self.rows], dtype=torch.float32, device=device)
        self.prefilled = False

    def _prefill(self, model: torch.nn.Module) -> None:
        rows, device = self.rows, self.device
        width = max(len(row.request.prompt) for row in rows)
        input_ids = torch.full((len(rows), width), self.pad_id, dtype=torch.long, device=device)
        mask = torch.zeros_like(input_ids)
        for index, row in enumerate(rows):
            n = len(row.request.prompt)
            input_ids[index, width - n :] = torch.tensor(row.request.prompt, dtype=torch.long)
            mask[index, width - n :] = 1
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        wants_prompt_logprobs = any(
            r.include_prompt_logprobs or r.topk_prompt_logprobs for r in self.requests
        )
        out = model(
            input_ids=input_ids,
            attention_mask=mask,
            position_ids=positions,
            use_cache=True,
            logits_to_keep=0 if wants_prompt_logprobs else 1,
        )
        if wants_prompt_logprobs:
            self.prompt_stats = _prompt_logprobs(rows, out.logits, width)
        self.next_logits = out.logits[:, -1, :].float()
        self.cache = out.past_key_values
        self.mask = mask
        self.last_position = positions[:, -1:]
        self.prefilled = True

    def advance(self, model: torch.nn.Module, breaks: DecodeBreaks) -> None:
        """Decode until every row stopped or, after at least one step, other work is waiting."""
        if not self.prefilled:
            self._prefill(model)
        stepped = False
        while not self.finished and not (stepped and breaks.other_work_waiting()):
            self._stop_abandoned(breaks.abandoned())
            self._step(model)
            stepped = True

    def _stop_abandoned(self, abandoned: Collection[int]) -> None:
        for row, request_index in zip(self.rows, self.request_of_row, strict=True):
            if request_index in abandoned and row.stop_reason is None:
                row.stop_reason = "length"

    def _step(self, model: torch.nn.Module) -> None:
        rows = self.rows
        uniforms = torch.stack([torch.rand((), generator=row.generator) for row in rows]).to(self.device)
        tokens, logprobs = _choose(self.next_logits, self.temperatures, self.top_ks, self.top_ps, uniforms)
        for row, token, logprob in zip(rows, tokens.tolist(), logprobs.tolist(), strict=True):
            if row.stop_reason is None:
                row.tokens.append(token)
                row.logprobs.append(logprob)
                row.stop_reason = _stop_reason(row, self.tokenizer)
        self.steps_left -= 1
        if self.steps_left <= 0 or all(row.stop_reason is not None for row in rows):
            self.finished = True
            return
        feed = torch.tensor(
            [row.tokens[-1] if row.stop_reason is None else self.pad_id for row in rows], device=self.device
        ).unsqueeze(-1)
        self.mask = torch.cat([self.mask, torch.ones_like(feed)], dim=-1)
        self.last_position = self.last_position + 1
        out = model(
            input_ids=feed,
            attention_mask=self.mask,
            position_ids=self.last_position,
            past_key_values=self.cache,
            use_cache=True,
        )
        self.cache = out.past_key_values
        self.next_logits = out.logits[:, -1, :].float()

    def results(self) -> list[RequestResult]:
        results = []
        cursor = 0
        for request in self.requests:
            own = self.rows[cursor : cursor + request.num_samples]
            plain, topk = self.prompt_stats.get(cursor, (None, None))
            cursor += request.num_samples
            results.append(
                RequestResult(
                    sequences=[GeneratedSeq(r.tokens, r.logprobs, r.stop_reason or "length") for r in own],
                    prompt_logprobs=plain if request.include_prompt_logprobs else None,
                    topk_prompt_logprobs=topk if request.topk_prompt_logprobs else None,
                )
            )
        return results


def _choose(
    logits: torch.Tensor,
    temperatures: torch.Tensor,
    top_ks: torch.Tensor,
    top_ps: torch.Tensor,
    uniforms: torch.Tensor,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Pick one token per row; return it with its logprob.

    The logprob is log-softmax(logits / T) over the whole vocabulary (T = 1 for greedy rows):
    the model's distribution with temperature applied, before top-k/top-p truncation — the same
    number the learner computes at T = 1, which is what importance ratios compare against.
    """
    greedy = temperatures <= 0
    scale = torch.where(greedy, torch.ones_like(temperatures), temperatures)
    logprobs = torch.log_softmax(logits / scale.unsqueeze(-1), dim=-1)
    sorted_logprobs, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)
    sorted_probs = sorted_logprobs.exp()
    ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
    keep = (top_ks.unsqueeze(-1) <= 0) | (ranks < top_ks.unsqueeze(-1))
    # Nucleus: keep a token while the mass strictly before it is under top_p (the first always stays).
    keep &= (sorted_probs.cumsum(-1) - sorted_probs) < top_ps.unsqueeze(-1)
    cdf = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs)).cumsum(-1)
    targets = (uniforms * cdf[:, -1]).unsqueeze(-1)
    picked = torch.searchsorted(cdf, targets, right=True).clamp(max=logits.shape[-1] - 1)
    sampled = order.gather(-1, picked).squeeze(-1)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _stop_reason(row: _Row, tokenizer: object) -> str | None:
    request = row.request
    if row.tokens[-1] in request.stop_token_ids:
        return "stop"
    if request.stop_strings:
        text = tokenizer.decode(row.tokens)  # type: ignore[attr-defined]
        if any(stop in text for stop in request.stop_strings):
            return "stop"
    if len(row.tokens) >= request.max_tokens:
        return "length"
    return None


def _prompt_logprobs(
    rows: list[_Row], logits: torch.Tensor, width: int
) -> dict[int, tuple[list[float | None], list[list[tuple[int, float]] | None]]]:
    """Per request (keyed by its first row): logprob of each prompt token given its prefix."""
    stats = {}
    index = 0
    while index < len(rows):
        request = rows[index].request
        n = len(request.prompt)
        row_logprobs = torch.log_softmax(logits[index, width - n : width - 1].float(), dim=-1)
        targets = torch.tensor(request.prompt[1:], dtype=torch.long, device=logits.device)
        plain: list[float | None] = [None]
        plain.extend(row_logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1).tolist())
        topk: list[list[tuple[int, float]] | None] = [None]
        if request.topk_prompt_logprobs:
            values, ids = row_logprobs.topk(min(request.topk_prompt_logprobs, row_logprobs.shape[-1]), dim=-1)
            topk.extend(
                list(zip(id_row, value_row, strict=True))
                for id_row, value_row in zip(ids.tolist(), values.tolist(), strict=True)
            )
        stats[index] = (plain, topk)
        index += request.num_samples
    return stats


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little")
