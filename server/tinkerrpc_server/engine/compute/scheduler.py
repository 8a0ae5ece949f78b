"""Continuously batched autoregressive sampling with a KV cache and per-sequence random generators.

Our own decoding loop instead of `generate()`: every knob (temperature, top-k, top-p, stops) is
per sequence, the randomness of a sequence depends only on its seed (not on what else is in the
batch), and the returned logprobs are computed from exactly the logits we sample from.

Jobs come from a `RequestFeed` while the batch decodes: a job that arrives joins the running batch
(its prompt prefilled in bounded chunks between decode steps, then its KV merged in), a sequence that
stops leaves the batch at once, and a job is answered as soon as its own sequences stop. The n samples
of one job, and jobs with an identical prompt admitted together, share one prefill. A batch pauses
between decode steps when the feed has other work waiting (its caller runs it: training, another
model's batch) and stops decoding for jobs nobody waits for. How jobs join and leave is the policy's
`BatchingStrategy`.
"""

from __future__ import annotations

from collections.abc import Callable, Iterator
from contextlib import AbstractContextManager
from dataclasses import dataclass
from typing import Protocol, TypeVar

import torch

from tinkerrpc_server.engine.compute.feed import DecodeFeed, FixedRequests
from tinkerrpc_server.engine.compute.forward_call import ForwardCall, SamplingModel
from tinkerrpc_server.engine.compute.kv_cache import DecodingRows
from tinkerrpc_server.engine.compute.prefill import Prefill
from tinkerrpc_server.engine.compute.rows import DecodingJob, Row
from tinkerrpc_server.engine.compute.samples import SampleJob, SampleOutput, TokenEvent
from tinkerrpc_server.engine.compute.token_choice import choose
from tinkerrpc_server.engine.compute.topk import sampled_top_logprobs

# The sampling model (the engine's own decoder or a transformers model, forward_call.py), made usable
# for the span of its context.
ModelContext = Callable[[], AbstractContextManager[SamplingModel]]

JobT = TypeVar("JobT")


class BatchingStrategy(Protocol):
    """When jobs join a batch, when stopped rows leave it, and when finished jobs are answered."""

    def admits_into_running_batch(self) -> bool:
        """Whether waiting jobs may join a batch that is decoding."""
        ...

    def rows_kept(self, live: list[int], rows: int) -> list[int]:
        """Which of a step's `rows` decode on, given the `live` ones (those that did not stop)."""
        ...

    def finished(self, job: JobT, answer: Callable[[JobT], None]) -> None:
        """`job`'s rows have all stopped; `answer` delivers it."""
        ...

    def batch_drained(self) -> None:
        """No row is decoding or being prefilled any more."""
        ...


class ContinuousBatching:
    """Jobs join a running batch, their rows leave it as they stop, and each is answered at once."""

    def admits_into_running_batch(self) -> bool:
        return True

    def rows_kept(self, live: list[int], rows: int) -> list[int]:
        return live

    def finished(self, job: JobT, answer: Callable[[JobT], None]) -> None:
        answer(job)

    def batch_drained(self) -> None:
        pass


@dataclass(frozen=True)
class BatchPolicy:
    """How many sequences decode together and how prompts enter the batch.

    A waiting job is admitted when its rows fit: live rows + its num_samples <= max_rows, and the
    batch's KV cache with its rows merged in (rows × columns, left padding included) holds at most
    max_kv_tokens. The KV bound is checked at admission: admitted rows keep decoding as the cache grows
    (up to max_rows × the longest prompt + max_tokens), and the next job waits until finished rows
    have made room. Jobs are admitted in arrival order (one that does not fit holds back those after
    it, so none starves), and a job is always admitted into an empty batch, however large. Prompts are
    prefilled in forward passes of at most prefill_chunk_tokens tokens (over all rows being prefilled),
    one such pass between two decode steps, so a long prompt delays the running rows by one chunk at a
    time.
    """

    max_rows: int = 64
    max_kv_tokens: int = 64 * 1024
    prefill_chunk_tokens: int = 512
    # Rows with the same prompt (a job's n samples, identical concurrent prompts) share one prefill.
    share_prompts: bool = True
    # Made once per batch: a strategy may keep state for the batch it runs.
    batching: Callable[[], BatchingStrategy] = ContinuousBatching

    def __post_init__(self) -> None:
        for name in ("max_rows", "max_kv_tokens", "prefill_chunk_tokens"):
            if getattr(self, name) < 1:
                raise ValueError(f"BatchPolicy.{name} must be at least 1, got {getattr(self, name)}")


def generate(
    model_context: ModelContext,
    jobs: list[SampleJob],
    tokenizer: object,
    device: torch.device,
    policy: BatchPolicy,
) -> list[SampleOutput]:
    """Sample every checked job's num_samples continuations; outputs in the order of `jobs`."""
    feed = FixedRequests(jobs)
    for _ in decode(model_context, feed, tokenizer, device, policy):
        pass  # a fixed feed has no other work: decoding never pauses
    answered = [result for result in feed.results if result is not None]
    assert len(answered) == len(jobs), "a job was never answered"
    return answered


def decode(
    model_context: ModelContext,
    feed: DecodeFeed,
    tokenizer: object,
    device: torch.device,
    policy: BatchPolicy,
) -> Iterator[None]:
    """Serve `feed` (checked jobs) until it has no job left to decode, one stretch per `next()`.

    The model is used only inside `model_context()`; when `feed` has other work waiting, decoding
    leaves that context between two steps and yields, so the caller can run that work before the next
    `next()` re-enters it (the KV cache is kept).
    """
    batch = DecodeBatch(feed, tokenizer, device, policy)
    while True:
        with model_context() as model:
            batch.advance(model)
        if batch.idle:
            return
        yield


class DecodeBatch:
    """The jobs of one feed: waiting, being prefilled, or decoding as rows of one batch."""

    def __init__(
        self, feed: DecodeFeed, tokenizer: object, device: torch.device, policy: BatchPolicy
    ) -> None:
        self.feed = feed
        self.tokenizer = tokenizer
        self.device = device
        self.policy = policy
        self.strategy = policy.batching()
        self.pad_id = int(getattr(tokenizer, "pad_token_id", None) or 0)
        self.waiting: list[DecodingJob] = []
        self.prefill: Prefill | None = None
        self.decoding: DecodingRows[Row] | None = None
        self.by_key: dict[int, DecodingJob] = {}
        self.prefills_started = 0  # numbers each prefill: rows of one prefill share its prompts' KV
        self.idle = False

    def advance(self, model: SamplingModel) -> None:
        """Admit, prefill and decode until nothing is left or, after some progress, other work waits."""
        while True:
            self._receive()
            if self.decoding is None and self.prefill is None:
                self.strategy.batch_drained()
                if not self.waiting:
                    self.idle = True
                    return
            self._admit()
            self._forward(model)
            if self.feed.other_work_waiting():
                return

    def _receive(self) -> None:
        for key, job in self.feed.joining():
            decoding = DecodingJob.start(key, job, self.tokenizer)
            self.by_key[key] = decoding
            self.waiting.append(decoding)
        abandoned = [self.by_key.pop(key) for key in self.feed.abandoned() if key in self.by_key]
        if not abandoned:
            return
        for owner in abandoned:
            owner.dropped = True
        self.waiting = [owner for owner in self.waiting if not owner.dropped]
        if self.decoding is not None:
            self._keep([i for i, row in enumerate(self.decoding.rows) if not row.owner.dropped])

    def _admit(self) -> None:
        """Start prefilling the waiting jobs that fit the policy (see BatchPolicy)."""
        if self.prefill is not None or not self.waiting:
            return
        running = self.decoding is not None
        if running and not self.strategy.admits_into_running_batch():
            return
        rows, columns = self.decoding.mask.shape if self.decoding is not None else (0, 0)
        admitted: list[DecodingJob] = []
        for owner in self.waiting:
            rows += owner.job.num_samples
            columns = max(columns, len(owner.job.prompt_tokens))
            fits = rows <= self.policy.max_rows and rows * columns <= self.policy.max_kv_tokens
            if not fits and (running or admitted):
                break
            admitted.append(owner)
        if not admitted:
            return
        self.waiting = self.waiting[len(admitted) :]
        if running:
            self.feed.stats.requests_joined_running_batch += len(admitted)
        self.prefills_started += 1
        self.prefill = Prefill(
            admitted,
            self.prefills_started,
            self.device,
            self.pad_id,
            self.policy.share_prompts,
            self.policy.prefill_chunk_tokens,
        )

    def _forward(self, model: SamplingModel) -> None:
        """A decode step for the running rows and the next chunk of the prefill in progress: in one pass
        when the model runs several calls together (their tokens share the matmuls, which at a few dozen
        rows cost little more for more rows), else the chunk first, its rows joining at once."""
        if not model.runs_calls_together or self.prefill is None or self.decoding is None:
            if self.prefill is not None:
                (chunk_logits,) = model.forward([self.prefill.next_chunk()])
                self._take_prefill_chunk(chunk_logits)
            if self.decoding is not None:
                step = self._sample(model)
                if step is not None:
                    (step_logits,) = model.forward([step])
                    self._take_step(step_logits)
            return
        step = self._sample(model)
        if step is None:
            (chunk_logits,) = model.forward([self.prefill.next_chunk()])
            self._take_prefill_chunk(chunk_logits)
            return
        step_logits, chunk_logits = model.forward([step, self.prefill.next_chunk()])
        self.feed.stats.prefill_chunks_in_decode_steps += 1
        self._take_step(step_logits)
        self._take_prefill_chunk(chunk_logits)

    def _take_prefill_chunk(self, logits: torch.Tensor) -> None:
        """Record a prefill chunk's logits; a finished prefill's rows join the decoding rows."""
        assert self.prefill is not None
        self.prefill.take_chunk(logits)
        self.feed.stats.prefill_chunks += 1
        if not self.prefill.done:
            return
        prefill, self.prefill = self.prefill, None
        joined = prefill.rows(self.feed.stats)
        if joined is not None:
            self.decoding = joined if self.decoding is None else self.decoding.merge(joined)

    def _sample(self, model: SamplingModel) -> ForwardCall | None:
        """Sample one token for every row and answer the jobs that completed; the model call that
        gives the remaining rows their next logits (None when no row remains)."""
        batch = self.decoding
        assert batch is not None
        # A stopped row a strategy keeps in the batch draws past its end; what it samples is unused.
        drawn = torch.tensor([len(row.tokens) for row in batch.rows], device=self.device)
        drawn = drawn.clamp_(max=batch.uniforms.shape[1] - 1)
        uniforms = batch.uniforms.gather(1, drawn.unsqueeze(-1)).squeeze(-1)
        logits = batch.next_logits
        kernels = model.fused_kernels_for(logits)
        tokens, logprobs = choose(logits, batch.sampling, uniforms, kernels)
        wanted = [0 if row.stop_reason else row.owner.job.topk_sample_logprobs for row in batch.rows]
        tops = sampled_top_logprobs(batch.next_logits, batch.temperatures, wanted)
        live: list[int] = []
        for index, (row, token, logprob) in enumerate(
            zip(batch.rows, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            if row.stop_reason is not None:
                continue
            row.tokens.append(token)
            row.logprobs.append(logprob)
            top = tops[index]
            if top is not None:
                row.topk.append(top)
            row.stop_reason = row.owner.stop.reason(row.tokens)
            if row.owner.job.on_token is not None:
                row.owner.job.on_token(TokenEvent(row.sample_index, token, logprob, top, row.stop_reason))
            if row.stop_reason is None:
                live.append(index)
            else:
                row.owner.unfinished -= 1
                if row.owner.unfinished == 0:
                    self.strategy.finished(row.owner, self._answer)
        kept = self.strategy.rows_kept(live, len(batch.rows))
        if len(kept) < len(batch.rows):
            if kept:
                self.feed.stats.rows_left_early += len(batch.rows) - len(kept)
            self._keep(kept)
            if self.decoding is None:
                return None
            batch = self.decoding
            # The rows kept may have moved: each row's input is the token it just sampled.
            tokens = torch.tensor([row.tokens[-1] for row in batch.rows], device=self.device)
        feed = tokens.unsqueeze(-1)
        batch.cache.shared_columns = _shared_columns(batch)
        if batch.cache.shared_columns is not None:
            self.feed.stats.shared_prompt_decode_steps += 1
        batch.mask = torch.cat([batch.mask, torch.ones_like(feed)], dim=-1)
        batch.last_positions = batch.last_positions + 1
        return ForwardCall(feed, batch.mask, batch.last_positions, batch.cache)

    def _take_step(self, logits: torch.Tensor) -> None:
        """Record the logits of the `_sample` call: the rows' next logits."""
        batch = self.decoding
        assert batch is not None
        batch.next_logits = logits[:, -1, :].float()
        stats = self.feed.stats
        stats.decode_steps += 1
        stats.decoded_rows += len(batch.rows)
        stats.largest_decode_rows = max(stats.largest_decode_rows, len(batch.rows))
        self.feed.decoding(len(batch.rows))

    def _keep(self, indices: list[int]) -> None:
        """Drop every decoding row but those at `indices`."""
        assert self.decoding is not None
        if len(indices) == len(self.decoding.rows):
            return
        self.decoding = self.decoding.keep(indices) if indices else None
        self.feed.decoding(len(indices))

    def _answer(self, owner: DecodingJob) -> None:
        if self.by_key.pop(owner.key, None) is None:
            return  # abandoned meanwhile: its caller has its answer
        self.feed.deliver(owner.key, owner.output())


def _shared_columns(batch: DecodingRows[Row]) -> tuple[int, int] | None:
    """The cache columns of the prompt every row copied from one prefill, if all of them did (then
    they were admitted together: same left padding, and no row's prompt starts elsewhere)."""
    first = batch.rows[0]
    if len(batch.rows) < 2 or first.prefix is None or any(row.prefix != first.prefix for row in batch.rows):
        return None
    start = int(batch.mask[0].argmax())
    return start, start + first.prefix_length
