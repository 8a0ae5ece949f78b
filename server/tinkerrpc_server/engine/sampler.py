"""Continuously batched autoregressive sampling with a KV cache and per-sequence random generators.

Our own decoding loop instead of `generate()`: every knob (temperature, top-k, top-p, stops) is
per sequence, the randomness of a sequence depends only on its seed (not on what else is in the
batch), and the returned logprobs are computed from exactly the logits we sample from.

Requests come from a `RequestFeed` while the batch decodes: a request that arrives joins the running
batch (its prompt prefilled in bounded chunks between decode steps, then its KV merged in), a sequence
that stops leaves the batch at once, and a request is answered as soon as its own sequences stop.
The n samples of one request, and requests with an identical prompt admitted together, share one
prefill. A batch pauses between decode steps for the feed's other work (training) and stops decoding
for requests nobody waits for. Above ~400 lines: the batch's KV bookkeeping (merge, drop, trim) and
its prefill belong together with the loop that drives them.
"""

from __future__ import annotations

import os
from collections.abc import Callable, Collection, Sequence
from contextlib import AbstractContextManager
from dataclasses import dataclass, field
from typing import Any, Generic, Protocol, TypeVar

import torch
import torch.nn.functional as F
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer


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


# Baseline/diagnostic switch, read when a batch starts: "gather" is the engine's batching before
# continuous batching (a9353ed), which bench/sampling.py measures against: requests join only an empty
# batch, every row is computed until the batch's last row stops, all are answered then (gather, then run
# to completion), and every row is prefilled on its own.
BATCHING_ENV = "TINKERRPC_ENGINE_BATCHING"


@dataclass(frozen=True)
class BatchPolicy:
    """How many sequences decode together and how prompts enter the batch.

    A waiting request is admitted when its rows fit: live rows + its num_samples <= max_rows, and the
    batch's KV cache with its rows merged in (rows × columns, left padding included) holds at most
    max_kv_tokens. The KV bound is checked at admission: admitted rows keep decoding as the cache grows
    (up to max_rows × the longest prompt + max_tokens), and the next request waits until finished rows
    have made room. Requests are admitted in arrival order (one that does not fit holds back those after it, so none starves), and
    a request is always admitted into an empty batch, however large. Prompts are prefilled in forward
    passes of at most prefill_chunk_tokens tokens (over all rows being prefilled), one such pass
    between two decode steps, so a long prompt delays the running rows by one chunk at a time.
    """

    max_rows: int = 64
    max_kv_tokens: int = 64 * 1024
    prefill_chunk_tokens: int = 512
    # Requests join a running batch, their rows leave it as they stop, and they are answered as soon as
    # those have; off: they join only an empty batch, whose rows all compute until its last one stops,
    # and are answered then (the gather-then-run baseline).
    continuous: bool = True
    # Rows with the same prompt (a request's n samples, identical concurrent prompts) share one prefill.
    share_prompts: bool = True

    @classmethod
    def from_environment(cls) -> BatchPolicy:
        if os.environ.get(BATCHING_ENV, "continuous") == "gather":
            return cls(continuous=False, share_prompts=False)
        return cls()


@dataclass
class DecodeStats:
    """Counters of the decoding loop (the engine reports them with its worker's counters)."""

    decode_steps: int = 0
    decoded_rows: int = 0  # summed over decode steps: decoded_rows / decode_steps = mean batch size
    largest_decode_rows: int = 0
    rows_left_early: int = 0  # rows that stopped and left while other rows kept decoding
    requests_joined_running_batch: int = 0
    prefill_chunks: int = 0
    prefill_chunks_in_decode_steps: int = 0  # chunks run in the same forward pass as a decode step
    shared_prefill_rows: int = 0  # rows whose prompt KV was copied from another row's prefill
    # Decode steps whose rows all held one prompt's KV: its columns were read once for all of them.
    shared_prompt_decode_steps: int = 0


In_co = TypeVar("In_co", covariant=True)
Out_contra = TypeVar("Out_contra", contravariant=True)


class RequestFeed(Protocol[In_co, Out_contra]):
    """Where a running batch gets its requests and answers them, and what it does between steps."""

    @property
    def stats(self) -> DecodeStats: ...

    def joining(self) -> Sequence[tuple[int, In_co]]:
        """Requests that arrived since the last call, each with a key unique within the feed."""
        ...

    def deliver(self, key: int, result: Out_contra) -> None:
        """The result of request `key`; called once per request, as soon as it is complete."""
        ...

    def abandoned(self) -> Collection[int]:
        """Keys of requests nobody waits for any more (already answered): they stop decoding."""
        ...

    def other_work_waiting(self) -> bool:
        """Whether work that should not wait for the whole batch is queued."""
        ...

    def run_other_work(self) -> None:
        """Run some of that work; it runs outside `model_context`."""
        ...


DecodeFeed = RequestFeed[SampleRequest, RequestResult]

A = TypeVar("A")
B = TypeVar("B")
C = TypeVar("C")
D = TypeVar("D")


class MappedFeed(Generic[A, B, C, D]):
    """`inner` seen through conversions: `take` turns its requests into ours (None: it answered the
    request itself, e.g. with an error), `give` turns our results into its."""

    def __init__(
        self,
        inner: RequestFeed[A, B],
        take: Callable[[int, A], C | None],
        give: Callable[[int, D], B],
    ) -> None:
        self._inner, self._take, self._give = inner, take, give

    @property
    def stats(self) -> DecodeStats:
        return self._inner.stats

    def joining(self) -> list[tuple[int, C]]:
        taken = []
        for key, item in self._inner.joining():
            converted = self._take(key, item)
            if converted is not None:
                taken.append((key, converted))
        return taken

    def deliver(self, key: int, result: D) -> None:
        self._inner.deliver(key, self._give(key, result))

    def abandoned(self) -> Collection[int]:
        return self._inner.abandoned()

    def other_work_waiting(self) -> bool:
        return self._inner.other_work_waiting()

    def run_other_work(self) -> None:
        self._inner.run_other_work()


class FixedRequests:
    """A feed of a fixed list of requests (keyed by their index) that collects their results."""

    def __init__(self, requests: list[SampleRequest]) -> None:
        self.stats = DecodeStats()
        self._requests: list[SampleRequest] | None = requests
        self.results: list[RequestResult | None] = [None] * len(requests)

    def joining(self) -> list[tuple[int, SampleRequest]]:
        requests, self._requests = self._requests or [], None
        return list(enumerate(requests))

    def deliver(self, key: int, result: RequestResult) -> None:
        self.results[key] = result

    def abandoned(self) -> Collection[int]:
        return ()

    def other_work_waiting(self) -> bool:
        return False

    def run_other_work(self) -> None:
        pass


# A causal LM called as transformers calls one (input_ids, attention_mask, position_ids, past_key_values,
# use_cache, logits_to_keep) whose output has .logits and .past_key_values: the transformers model itself
# or the engine's own decoder (engine/decoder.py).
SamplingModel = Callable[..., Any]
ModelContext = Callable[[], AbstractContextManager[SamplingModel]]


def generate(
    model_context: ModelContext,
    requests: list[SampleRequest],
    tokenizer: object,
    device: torch.device,
    policy: BatchPolicy,
) -> list[RequestResult]:
    """Sample every request's num_samples continuations; results in the order of `requests`."""
    feed = FixedRequests(requests)
    decode(model_context, feed, tokenizer, device, policy)
    answered = [result for result in feed.results if result is not None]
    assert len(answered) == len(requests), "a request was never answered"
    return answered


def decode(
    model_context: ModelContext,
    feed: DecodeFeed,
    tokenizer: object,
    device: torch.device,
    policy: BatchPolicy,
) -> None:
    """Serve `feed` until it has no request left to decode.

    The model is used only inside `model_context()`; when `feed` has other work waiting, decoding
    leaves that context between two steps, lets the work run, and re-enters it (the KV cache is kept).
    """
    batch = _Batch(feed, tokenizer, device, policy)
    while True:
        with model_context() as model:
            batch.advance(model)
        if batch.idle:
            return
        feed.run_other_work()


@dataclass(eq=False)
class _Request:
    key: int
    request: SampleRequest
    rows: list[_Row] = field(default_factory=list)
    unfinished: int = 0
    prompt_logprobs: list[float | None] | None = None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None = None
    dropped: bool = False


@dataclass(eq=False)
class _Row:
    owner: _Request
    uniforms: torch.Tensor  # one draw per token it may sample, from its own seed
    tokens: list[int] = field(default_factory=list)
    logprobs: list[float] = field(default_factory=list)
    stop_reason: str | None = None
    # The prefill whose prompt KV the row holds a copy of (rows of one prompt share it), and its length.
    prefix: tuple[int, int] | None = None
    prefix_length: int = 0


@dataclass
class _Rows:
    """Rows and their per-row tensors, aligned on dim 0; the KV cache holds their left-padded keys and
    values (columns where `mask` is 0 are padding). `next_logits` are the logits to sample from next."""

    rows: list[_Row]
    cache: DynamicCache
    mask: torch.Tensor  # (rows, columns)
    last_positions: torch.Tensor  # (rows, 1)
    next_logits: torch.Tensor  # (rows, vocab)
    uniforms: torch.Tensor  # (rows, longest max_tokens)
    temperatures: torch.Tensor
    top_ks: torch.Tensor
    top_ps: torch.Tensor

    def keep(self, indices: list[int]) -> _Rows:
        """Only the rows at `indices` (ascending). Kept rows past the new end move into the places the
        others left, so only they are copied; the leading columns none of the kept rows needs are cut
        off (a copy of every row) once they are a quarter of the width."""
        count = len(indices)
        kept = set(indices)
        holes = [i for i in range(count) if i not in kept]
        movers = [i for i in indices if i >= count]
        order = list(range(count))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        index = torch.tensor(order, dtype=torch.long, device=self.mask.device)
        mask = self.mask.index_select(0, index)
        first = int(mask.any(dim=0).to(torch.int8).argmax())
        if first * 4 >= mask.shape[1] > 0 and first > 0:
            for layer in self.cache.layers:
                layer.keep_rows(index, first)
            mask = mask[:, first:]
        else:
            for layer in self.cache.layers:
                layer.move_rows(holes, movers, count)
        return _Rows(
            [self.rows[i] for i in order],
            self.cache,
            mask,
            self.last_positions.index_select(0, index),
            self.next_logits.index_select(0, index),
            self.uniforms.index_select(0, index),
            self.temperatures.index_select(0, index),
            self.top_ks.index_select(0, index),
            self.top_ps.index_select(0, index),
        )

    def merge(self, other: _Rows) -> _Rows:
        """Both batches' rows in one, the narrower side's cache and mask left-padded to the same width."""
        width = max(self.mask.shape[1], other.mask.shape[1])
        for mine, theirs in zip(self.cache.layers, other.cache.layers, strict=True):
            mine.stack_rows(theirs, width)
        draws = max(self.uniforms.shape[1], other.uniforms.shape[1])
        return _Rows(
            self.rows + other.rows,
            self.cache,
            torch.cat([_left_pad(self.mask, width), _left_pad(other.mask, width)]),
            torch.cat([self.last_positions, other.last_positions]),
            torch.cat([self.next_logits, other.next_logits]),
            torch.cat([_right_pad(self.uniforms, draws), _right_pad(other.uniforms, draws)]),
            torch.cat([self.temperatures, other.temperatures]),
            torch.cat([self.top_ks, other.top_ks]),
            torch.cat([self.top_ps, other.top_ps]),
        )


class _GrowingLayer(DynamicLayer):  # type: ignore[misc]  # transformers is untyped here
    """A cache layer whose keys and values are leading views (rows, columns) of buffers with room for
    more of both: a decode step writes its keys in place instead of copying the whole cache
    (DynamicLayer's torch.cat) every step; rows joining are written after the others and rows leaving
    are replaced by the last ones, copying only those rows; what does not fit is copied once, into new
    buffers with room."""

    keys: torch.Tensor
    values: torch.Tensor
    key_buffer: torch.Tensor | None
    value_buffer: torch.Tensor | None

    def update(
        self, key_states: torch.Tensor, value_states: torch.Tensor, *args: object, **kwargs: object
    ) -> tuple[torch.Tensor, torch.Tensor]:
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self.key_buffer = self.value_buffer = None
        self.keys, self.key_buffer = _appended(self.keys, self.key_buffer, key_states)
        self.values, self.value_buffer = _appended(self.values, self.value_buffer, value_states)
        return self.keys, self.values

    def keep_rows(self, index: torch.Tensor, first_column: int = 0) -> None:
        """Only the rows at `index` (repeats allowed), from column `first_column` on (a copy of all)."""
        self.keys, self.key_buffer = _rows_kept(self.keys, index, first_column)
        self.values, self.value_buffer = _rows_kept(self.values, index, first_column)

    def move_rows(self, holes: list[int], movers: list[int], count: int) -> None:
        """Row `movers[i]` copied into row `holes[i]`, then only the first `count` rows kept."""
        for hole, mover in zip(holes, movers, strict=True):
            # One strided copy per row: index_select/index_copy_ on these views take a slow path.
            self.keys[hole].copy_(self.keys[mover])
            self.values[hole].copy_(self.values[mover])
        self.keys, self.values = self.keys[:count], self.values[:count]

    def stack_rows(self, other: _GrowingLayer, width: int) -> None:
        """This layer's rows, then `other`'s, each left-padded with zeros to `width` columns."""
        self.keys, self.key_buffer = _stacked(self.keys, self.key_buffer, other.keys, width)
        self.values, self.value_buffer = _stacked(self.values, self.value_buffer, other.values, width)


def _room(columns: int) -> int:
    """Columns a buffer gets for `columns` in use: half as many again, so one is copied O(log) times as
    its sequences grow."""
    return columns + max(64, columns // 2)


def _row_room(rows: int) -> int:
    """Rows a buffer gets for `rows` in use: room for a few more to join without a copy."""
    return rows + max(4, rows // 4)


def _in_place(view: torch.Tensor, buffer: torch.Tensor | None, rows: int, columns: int) -> bool:
    """Whether `view` is the leading part of `buffer` and the buffer holds `rows` × `columns`."""
    return (
        buffer is not None
        and view.dim() == 4
        and view.data_ptr() == buffer.data_ptr()
        and view.stride() == buffer.stride()
        and buffer.shape[0] >= rows
        and buffer.shape[-2] >= columns
    )


def _rows_kept(
    tensor: torch.Tensor, index: torch.Tensor, first_column: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """The rows at `index` of `tensor` from `first_column` on, as a view of a new buffer with room."""
    _, heads, columns, dim = tensor.shape
    width = columns - first_column
    buffer = tensor.new_empty((_row_room(len(index)), heads, _room(width), dim))
    kept = buffer[: len(index), :, :width]
    torch.index_select(tensor[:, :, first_column:], 0, index, out=kept)
    return kept, buffer


def _stacked(
    top: torch.Tensor, buffer: torch.Tensor | None, bottom: torch.Tensor, width: int
) -> tuple[torch.Tensor, torch.Tensor]:
    """`top`'s rows then `bottom`'s, right-aligned in `width` columns with zeros on the left (finite: a
    masked column's value is still multiplied by its zero weight). Written after `top` in its buffer when
    that has room and `top` needs no padding; else both are copied into a new buffer with room."""
    rows, joining = top.shape[0], bottom.shape[0]
    if top.shape[-2] == width and _in_place(top, buffer, rows + joining, width):
        assert buffer is not None
        parts = [(rows, bottom)]
    else:
        heads, dim = top.shape[1], top.shape[-1]
        buffer = top.new_empty((_row_room(rows + joining), heads, _room(width), dim))
        parts = [(0, top), (rows, bottom)]
    for start, part in parts:
        pad = width - part.shape[-2]
        buffer[start : start + part.shape[0], :, :pad].zero_()
        buffer[start : start + part.shape[0], :, pad:width].copy_(part)
    return buffer[: rows + joining, :, :width], buffer


def _appended(
    current: torch.Tensor, buffer: torch.Tensor | None, new: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """`current` with `new` appended along the sequence dimension, as a view of a (new) buffer."""
    used = current.shape[-2] if current.dim() == 4 else 0
    total = used + new.shape[-2]
    rows = new.shape[0]
    if not _in_place(current, buffer, rows, total) or buffer is None or buffer.shape[1] != new.shape[1]:
        buffer = new.new_empty((_row_room(rows), new.shape[1], _room(total), new.shape[-1]))
        if used:
            buffer[:rows, :, :used] = current
    buffer[:rows, :, used:total] = new
    return buffer[:rows, :, :total], buffer


class _SamplerCache(DynamicCache):  # type: ignore[misc]  # transformers is untyped here
    """The sampler's KV cache. `shared_columns` (start, end), set before a decode step when every row
    holds a copy of one prompt's KV there, lets engine/decoder.py read those columns once for all rows."""

    shared_columns: tuple[int, int] | None = None


def _new_cache() -> DynamicCache:
    cache = _SamplerCache()
    cache.layer_class_to_replicate = _GrowingLayer
    return cache


def _left_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    """Zero columns on the left of the sequence dimension (-1 of a mask, -2 of keys/values)."""
    missing = width - tensor.shape[-1 if tensor.dim() == 2 else -2]
    if missing == 0:
        return tensor
    return F.pad(tensor, (missing, 0) if tensor.dim() == 2 else (0, 0, missing, 0))


def _right_pad(tensor: torch.Tensor, width: int) -> torch.Tensor:
    return F.pad(tensor, (0, width - tensor.shape[1]))


class _Prefill:
    """The prompts of a group of admitted requests, prefilled chunk by chunk into their own cache."""

    def __init__(self, batch: _Batch, requests: list[_Request]) -> None:
        self.requests = requests
        batch.prefills_started += 1
        self.serial = batch.prefills_started
        device = batch.device
        prompt_of_row: list[int] = []
        prompts: list[list[int]] = []
        index_of_prompt: dict[tuple[int, ...], int] = {}
        for owner in requests:
            for _ in range(owner.request.num_samples):
                key = tuple(owner.request.prompt)
                if not batch.policy.share_prompts or key not in index_of_prompt:
                    index_of_prompt[key] = len(prompts)
                    prompts.append(owner.request.prompt)
                prompt_of_row.append(index_of_prompt[key])
        self.prompt_of_row = prompt_of_row
        self.first_row_of_prompt = {p: prompt_of_row.index(p) for p in range(len(prompts))}
        width = max(len(p) for p in prompts)
        self.input_ids = torch.full((len(prompts), width), batch.pad_id, dtype=torch.long)
        self.mask = torch.zeros_like(self.input_ids)
        for index, prompt in enumerate(prompts):
            self.input_ids[index, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            self.mask[index, width - len(prompt) :] = 1
        self.input_ids, self.mask = self.input_ids.to(device), self.mask.to(device)
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = _new_cache()
        self.done_columns = 0
        self.columns_per_chunk = max(1, batch.policy.prefill_chunk_tokens // len(prompts))
        self.top_k = max(o.request.topk_prompt_logprobs for o in requests)
        self.wants_logprobs = any(o.request.include_prompt_logprobs for o in requests) or self.top_k > 0
        if self.wants_logprobs:
            # Per prompt column j: logprob of the token at j + 1 (and the top-k there).
            self.target_logprobs = torch.zeros((len(prompts), width - 1), device=device)
            self.top_values = torch.zeros((len(prompts), width - 1, self.top_k), device=device)
            self.top_ids = torch.zeros((len(prompts), width - 1, self.top_k), dtype=torch.long, device=device)
        self.last_logits: torch.Tensor | None = None

    @property
    def done(self) -> bool:
        return self.last_logits is not None

    def next_chunk(self) -> dict[str, Any]:
        """The model call that prefills the next chunk of columns."""
        start, end = self.done_columns, self._chunk_end()
        return {
            "input_ids": self.input_ids[:, start:end],
            "attention_mask": self.mask[:, :end],
            "position_ids": self.positions[:, start:end],
            "past_key_values": self.cache,
            "use_cache": True,
            "logits_to_keep": 0 if self.wants_logprobs else 1,
        }

    def take_chunk(self, out: Any) -> None:
        """Record what the `next_chunk` call returned."""
        start, end, width = self.done_columns, self._chunk_end(), self.input_ids.shape[1]
        self.cache = out.past_key_values
        if self.wants_logprobs:
            self._record_prompt_logprobs(out.logits, start, end)
        self.done_columns = end
        if end == width:
            self.last_logits = out.logits[:, -1, :].float()

    def _chunk_end(self) -> int:
        return min(self.input_ids.shape[1], self.done_columns + self.columns_per_chunk)

    def _record_prompt_logprobs(self, logits: torch.Tensor, start: int, end: int) -> None:
        stop = min(end, self.input_ids.shape[1] - 1)
        if stop <= start:
            return
        logprobs = torch.log_softmax(logits[:, : stop - start].float(), dim=-1)
        targets = self.input_ids[:, start + 1 : stop + 1]
        self.target_logprobs[:, start:stop] = logprobs.gather(-1, targets.unsqueeze(-1)).squeeze(-1)
        if self.top_k:
            values, ids = logprobs.topk(min(self.top_k, logprobs.shape[-1]), dim=-1)
            self.top_values[:, start:stop, : values.shape[-1]] = values
            self.top_ids[:, start:stop, : ids.shape[-1]] = ids

    def rows(self, batch: _Batch) -> _Rows | None:
        """The prefilled rows of the requests still wanted, their prompt KV copied to each of their
        rows; None if nobody wants them any more."""
        assert self.last_logits is not None
        width = self.input_ids.shape[1]
        wanted: list[int] = []
        row = 0
        for owner in self.requests:
            if not owner.dropped:
                self._set_prompt_logprobs(owner, self.prompt_of_row[row], width)
                wanted.extend(range(row, row + owner.request.num_samples))
            row += owner.request.num_samples
        if not wanted:
            return None
        prompts = [self.prompt_of_row[r] for r in wanted]
        batch.feed.stats.shared_prefill_rows += len(prompts) - len(set(prompts))
        index = torch.tensor(prompts, dtype=torch.long, device=batch.device)
        for layer in self.cache.layers:
            layer.keep_rows(index)
        new_rows = [r for o in self.requests if not o.dropped for r in o.rows]
        for new_row, prompt in zip(new_rows, prompts, strict=True):
            new_row.prefix, new_row.prefix_length = (self.serial, prompt), len(new_row.owner.request.prompt)
        requests = [r.owner.request for r in new_rows]
        device = batch.device
        return _Rows(
            new_rows,
            self.cache,
            self.mask.index_select(0, index),
            self.positions[:, -1:].index_select(0, index),
            self.last_logits.index_select(0, index),
            torch.nn.utils.rnn.pad_sequence([r.uniforms for r in new_rows], batch_first=True).to(device),
            torch.tensor([q.temperature for q in requests], dtype=torch.float32, device=device),
            torch.tensor([q.top_k for q in requests], dtype=torch.long, device=device),
            torch.tensor([q.top_p for q in requests], dtype=torch.float32, device=device),
        )

    def _set_prompt_logprobs(self, owner: _Request, prompt: int, width: int) -> None:
        request = owner.request
        if not (request.include_prompt_logprobs or request.topk_prompt_logprobs):
            return
        start = width - len(request.prompt)
        plain: list[float | None] = [None]
        plain.extend(self.target_logprobs[prompt, start:].tolist())
        owner.prompt_logprobs = plain
        if request.topk_prompt_logprobs:
            k = min(request.topk_prompt_logprobs, self.top_ids.shape[-1])
            ids = self.top_ids[prompt, start:, :k].tolist()
            values = self.top_values[prompt, start:, :k].tolist()
            topk: list[list[tuple[int, float]] | None] = [None]
            topk.extend(
                list(zip(id_row, value_row, strict=True))
                for id_row, value_row in zip(ids, values, strict=True)
            )
            owner.topk_prompt_logprobs = topk


class _Batch:
    """The requests of one feed: waiting, being prefilled, or decoding as rows of one batch."""

    def __init__(
        self, feed: DecodeFeed, tokenizer: object, device: torch.device, policy: BatchPolicy
    ) -> None:
        self.feed = feed
        self.tokenizer = tokenizer
        self.device = device
        self.policy = policy
        self.pad_id = int(getattr(tokenizer, "pad_token_id", None) or 0)
        self.waiting: list[_Request] = []
        self.prefill: _Prefill | None = None
        self.decoding: _Rows | None = None
        self.by_key: dict[int, _Request] = {}
        self.prefills_started = 0  # numbers each prefill: rows of one prefill share its prompts' KV
        self.finished_in_batch: list[_Request] = []  # gather-then-run: answered when the batch is done
        self.idle = False

    def advance(self, model: SamplingModel) -> None:
        """Admit, prefill and decode until nothing is left or, after some progress, other work waits."""
        while True:
            self._receive()
            if self.decoding is None and self.prefill is None:
                for owner in self.finished_in_batch:
                    self._answer(owner)
                self.finished_in_batch = []
                if not self.waiting:
                    self.idle = True
                    return
            self._admit()
            self._forward(model)
            if self.feed.other_work_waiting():
                return

    def _receive(self) -> None:
        for key, request in self.feed.joining():
            owner = _Request(key, request)
            for sample_index in range(request.num_samples):
                seed = request.seed + sample_index if request.seed is not None else _fresh_seed()
                generator = torch.Generator(device="cpu")
                generator.manual_seed(seed % (2**63))
                owner.rows.append(_Row(owner, torch.rand(request.max_tokens, generator=generator)))
            owner.unfinished = request.num_samples
            self.by_key[key] = owner
            self.waiting.append(owner)
        abandoned = [self.by_key.pop(key) for key in self.feed.abandoned() if key in self.by_key]
        if not abandoned:
            return
        for owner in abandoned:
            owner.dropped = True
        self.waiting = [owner for owner in self.waiting if not owner.dropped]
        if self.decoding is not None:
            self._keep([i for i, row in enumerate(self.decoding.rows) if not row.owner.dropped])

    def _admit(self) -> None:
        """Start prefilling the waiting requests that fit the policy (see BatchPolicy)."""
        if self.prefill is not None or not self.waiting:
            return
        running = self.decoding is not None
        if running and not self.policy.continuous:
            return
        rows, columns = self.decoding.mask.shape if self.decoding is not None else (0, 0)
        admitted: list[_Request] = []
        for owner in self.waiting:
            rows += owner.request.num_samples
            columns = max(columns, len(owner.request.prompt))
            fits = rows <= self.policy.max_rows and rows * columns <= self.policy.max_kv_tokens
            if not fits and (running or admitted):
                break
            admitted.append(owner)
        if not admitted:
            return
        self.waiting = self.waiting[len(admitted) :]
        if running:
            self.feed.stats.requests_joined_running_batch += len(admitted)
        self.prefill = _Prefill(self, admitted)

    def _forward(self, model: SamplingModel) -> None:
        """A decode step for the running rows and the next chunk of the prefill in progress: in one pass
        when the model runs several calls together (their tokens share the matmuls, which at a few dozen
        rows cost little more for more rows), else the chunk first, its rows joining at once."""
        run_together = getattr(model, "forward_together", None)
        if run_together is None or self.prefill is None or self.decoding is None:
            if self.prefill is not None:
                self._take_prefill_chunk(model(**self.prefill.next_chunk()))
            if self.decoding is not None:
                step = self._sample()
                if step is not None:
                    self._take_step(model(**step))
            return
        step = self._sample()
        if step is None:
            self._take_prefill_chunk(model(**self.prefill.next_chunk()))
            return
        step_out, chunk_out = run_together([step, self.prefill.next_chunk()])
        self.feed.stats.prefill_chunks_in_decode_steps += 1
        self._take_step(step_out)
        self._take_prefill_chunk(chunk_out)

    def _take_prefill_chunk(self, out: Any) -> None:
        """Record a prefill chunk's output; a finished prefill's rows join the decoding rows."""
        assert self.prefill is not None
        self.prefill.take_chunk(out)
        self.feed.stats.prefill_chunks += 1
        if not self.prefill.done:
            return
        prefill, self.prefill = self.prefill, None
        joined = prefill.rows(self)
        if joined is not None:
            self.decoding = joined if self.decoding is None else self.decoding.merge(joined)

    def _sample(self) -> dict[str, Any] | None:
        """Sample one token for every row and answer the requests that completed; the model call that
        gives the remaining rows their next logits (None when no row remains)."""
        batch = self.decoding
        assert batch is not None
        # (A stopped row still in a gather-then-run batch draws past its end; what it samples is unused.)
        drawn = torch.tensor([len(row.tokens) for row in batch.rows], device=self.device)
        drawn = drawn.clamp_(max=batch.uniforms.shape[1] - 1)
        uniforms = batch.uniforms.gather(1, drawn.unsqueeze(-1)).squeeze(-1)
        tokens, logprobs = _choose(
            batch.next_logits, batch.temperatures, batch.top_ks, batch.top_ps, uniforms
        )
        live: list[int] = []
        for index, (row, token, logprob) in enumerate(
            zip(batch.rows, tokens.tolist(), logprobs.tolist(), strict=True)
        ):
            if row.stop_reason is not None:
                continue
            row.tokens.append(token)
            row.logprobs.append(logprob)
            row.stop_reason = _stop_reason(row, self.tokenizer)
            if row.stop_reason is None:
                live.append(index)
            else:
                row.owner.unfinished -= 1
                if row.owner.unfinished == 0:
                    self._deliver(row.owner)
        if len(live) < len(batch.rows) and (self.policy.continuous or not live):
            if live:
                self.feed.stats.rows_left_early += len(batch.rows) - len(live)
            self._keep(live)
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
        return {
            "input_ids": feed,
            "attention_mask": batch.mask,
            "position_ids": batch.last_positions,
            "past_key_values": batch.cache,
            "use_cache": True,
        }

    def _take_step(self, out: Any) -> None:
        """Record the output of the `_sample` call: the rows' next logits."""
        batch = self.decoding
        assert batch is not None
        batch.cache = out.past_key_values
        batch.next_logits = out.logits[:, -1, :].float()
        stats = self.feed.stats
        stats.decode_steps += 1
        stats.decoded_rows += len(batch.rows)
        stats.largest_decode_rows = max(stats.largest_decode_rows, len(batch.rows))

    def _keep(self, indices: list[int]) -> None:
        """Drop every decoding row but those at `indices`."""
        assert self.decoding is not None
        if len(indices) == len(self.decoding.rows):
            return
        self.decoding = self.decoding.keep(indices) if indices else None

    def _deliver(self, owner: _Request) -> None:
        if self.policy.continuous:
            self._answer(owner)
        else:
            self.finished_in_batch.append(owner)

    def _answer(self, owner: _Request) -> None:
        if self.by_key.pop(owner.key, None) is None:
            return  # abandoned meanwhile: its caller has its answer
        self.feed.deliver(
            owner.key,
            RequestResult(
                sequences=[GeneratedSeq(r.tokens, r.logprobs, r.stop_reason or "length") for r in owner.rows],
                prompt_logprobs=owner.prompt_logprobs if owner.request.include_prompt_logprobs else None,
                topk_prompt_logprobs=owner.topk_prompt_logprobs
                if owner.request.topk_prompt_logprobs
                else None,
            ),
        )


def _shared_columns(batch: _Rows) -> tuple[int, int] | None:
    """The cache columns of the prompt every row copied from one prefill, if all of them did (then
    they were admitted together: same left padding, and no row's prompt starts elsewhere)."""
    first = batch.rows[0]
    if len(batch.rows) < 2 or first.prefix is None or any(row.prefix != first.prefix for row in batch.rows):
        return None
    start = int(batch.mask[0].argmax())
    return start, start + first.prefix_length


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
    # Rows without top-k/top-p draw from the cumulative distribution in vocabulary order, which needs no
    # sort over the vocabulary; rows with them always take the sorted path. Either way a row's token
    # depends on its own logits and uniform only.
    cdf = logprobs.exp().cumsum(-1)
    sampled = _searchsorted(cdf, uniforms)
    truncated = (top_ks > 0) | (top_ps < 1)
    if bool(truncated.any()):
        sorted_logprobs, order = torch.sort(logprobs, dim=-1, descending=True, stable=True)
        sorted_probs = sorted_logprobs.exp()
        ranks = torch.arange(logits.shape[-1], device=logits.device).unsqueeze(0)
        keep = (top_ks.unsqueeze(-1) <= 0) | (ranks < top_ks.unsqueeze(-1))
        # Nucleus: keep a token while the mass strictly before it is under top_p (the first always stays).
        keep &= (sorted_probs.cumsum(-1) - sorted_probs) < top_ps.unsqueeze(-1)
        kept_cdf = torch.where(keep, sorted_probs, torch.zeros_like(sorted_probs)).cumsum(-1)
        picked = _searchsorted(kept_cdf, uniforms)
        sampled = torch.where(truncated, order.gather(-1, picked.unsqueeze(-1)).squeeze(-1), sampled)
    tokens = torch.where(greedy, logits.argmax(dim=-1), sampled)
    return tokens, logprobs.gather(-1, tokens.unsqueeze(-1)).squeeze(-1)


def _searchsorted(cdf: torch.Tensor, uniforms: torch.Tensor) -> torch.Tensor:
    """Per row, the first index whose cumulative mass exceeds uniform × the row's total mass."""
    targets = (uniforms * cdf[:, -1]).unsqueeze(-1)
    return torch.searchsorted(cdf, targets, right=True).squeeze(-1).clamp(max=cdf.shape[-1] - 1)


def _stop_reason(row: _Row, tokenizer: object) -> str | None:
    request = row.owner.request
    if row.tokens[-1] in request.stop_token_ids:
        return "stop"
    if request.stop_strings:
        text = tokenizer.decode(row.tokens)  # type: ignore[attr-defined]
        if any(stop in text for stop in request.stop_strings):
            return "stop"
    if len(row.tokens) >= request.max_tokens:
        return "length"
    return None


def _fresh_seed() -> int:
    return int.from_bytes(os.urandom(8), "little")
