"""Prefill: the prompts of jobs admitted together, run through the model in bounded chunks into their own
KV cache (one prompt per distinct prompt when prompts are shared), with the prompt logprobs asked for."""

from __future__ import annotations

import torch

from tinkerrpc_server.engine.compute.feed import DecodeStats
from tinkerrpc_server.engine.compute.forward_call import ForwardCall
from tinkerrpc_server.engine.compute.kv_cache import DecodingRows, new_cache
from tinkerrpc_server.engine.compute.prompt_alt_tokens import PromptAltDraws
from tinkerrpc_server.engine.compute.prompt_targets import NO_TARGET
from tinkerrpc_server.engine.compute.rows import DecodingJob, Row


class Prefill:
    """The prompts of a group of admitted requests, prefilled chunk by chunk into their own cache."""

    def __init__(
        self,
        jobs: list[DecodingJob],
        serial: int,
        device: torch.device,
        pad_id: int,
        share_prompts: bool,
        chunk_tokens: int,
    ) -> None:
        self.jobs = jobs
        self.serial = serial
        self.device = device
        prompt_of_row: list[int] = []
        prompts: list[list[int]] = []
        index_of_prompt: dict[tuple[int, ...], int] = {}
        # Requests whose prompt an earlier request of this prefill computed: its KV is reused for them.
        self.reused_prompt: set[int] = set()
        for owner in jobs:
            key = tuple(owner.job.prompt_tokens)
            if share_prompts and key in index_of_prompt:
                self.reused_prompt.add(owner.key)
            for _ in range(owner.job.num_samples):
                if not share_prompts or key not in index_of_prompt:
                    index_of_prompt[key] = len(prompts)
                    prompts.append(owner.job.prompt_tokens)
                prompt_of_row.append(index_of_prompt[key])
        self.prompt_of_row = prompt_of_row
        self.first_row_of_prompt = {p: prompt_of_row.index(p) for p in range(len(prompts))}
        width = max(len(p) for p in prompts)
        self.input_ids = torch.full((len(prompts), width), pad_id, dtype=torch.long)
        self.mask = torch.zeros_like(self.input_ids)
        for index, prompt in enumerate(prompts):
            self.input_ids[index, width - len(prompt) :] = torch.tensor(prompt, dtype=torch.long)
            self.mask[index, width - len(prompt) :] = 1
        self.input_ids, self.mask = self.input_ids.to(device), self.mask.to(device)
        self.positions = (self.mask.cumsum(-1) - 1).clamp(min=0)
        self.cache = new_cache()
        self.done_columns = 0
        self.columns_per_chunk = max(1, chunk_tokens // len(prompts))
        self.top_k = max(o.job.topk_prompt_logprobs for o in jobs)
        self._gather_targets(prompts, width)
        self.alt_draws = {
            o.key: PromptAltDraws(
                o.job.prompt_alt_tokens_k,
                o.job.temperature,
                o.job.seed,
                len(o.job.prompt_tokens),
                width,
                device,
            )
            for o in jobs
            if o.job.prompt_alt_tokens_k
        }
        self.wants_logprobs = (
            any(o.job.include_prompt_logprobs for o in jobs)
            or self.top_k > 0
            or self.asked_ids is not None
            or bool(self.alt_draws)
        )
        if self.wants_logprobs:
            # Per prompt column j: logprob of the token at j + 1 (and the top-k there).
            self.target_logprobs = torch.zeros((len(prompts), width - 1), device=device)
            self.top_values = torch.zeros((len(prompts), width - 1, self.top_k), device=device)
            self.top_ids = torch.zeros((len(prompts), width - 1, self.top_k), dtype=torch.long, device=device)
        self.last_logits: torch.Tensor | None = None

    def _gather_targets(self, prompts: list[list[int]], width: int) -> None:
        """Lay out the target ids each prompt's requests ask about, side by side per prompt column (a
        shared prompt's requests each get their own columns), NO_TARGET in every other cell."""
        self.asked_ids: torch.Tensor | None = None
        self.asked_columns: dict[int, int] = {}  # job key -> its first column
        used = [0] * len(prompts)
        row = 0
        for owner in self.jobs:
            targets = owner.job.target_prompt_logprobs
            if targets is not None:
                self.asked_columns[owner.key] = used[self.prompt_of_row[row]]
                used[self.prompt_of_row[row]] += targets.ids.shape[1]
            row += owner.job.num_samples
        if not any(used):
            return
        asked = torch.full((len(prompts), width - 1, max(used)), NO_TARGET, dtype=torch.long)
        row = 0
        for owner in self.jobs:
            targets = owner.job.target_prompt_logprobs
            if targets is not None:
                first = self.asked_columns[owner.key]
                rows = slice(width - len(owner.job.prompt_tokens), width - 1)
                columns = slice(first, first + targets.ids.shape[1])
                asked[self.prompt_of_row[row], rows, columns] = torch.from_numpy(targets.ids)
            row += owner.job.num_samples
        self.asked_ids = asked.to(self.device)
        self.asked_logprobs = torch.zeros(asked.shape, device=self.device)

    @property
    def done(self) -> bool:
        return self.last_logits is not None

    def next_chunk(self) -> ForwardCall:
        """The model call that prefills the next chunk of columns."""
        start, end = self.done_columns, self._chunk_end()
        return ForwardCall(
            self.input_ids[:, start:end],
            self.mask[:, :end],
            self.positions[:, start:end],
            self.cache,
            logits_to_keep=0 if self.wants_logprobs else 1,
        )

    def take_chunk(self, logits: torch.Tensor) -> None:
        """Record the logits the `next_chunk` call returned (its cache holds the chunk's keys and values)."""
        start, end, width = self.done_columns, self._chunk_end(), self.input_ids.shape[1]
        if self.wants_logprobs:
            self._record_prompt_logprobs(logits, start, end)
        self.done_columns = end
        if end == width:
            self.last_logits = logits[:, -1, :].float()

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
        if self.asked_ids is not None:
            asked = self.asked_ids[:, start:stop].clamp(min=0)
            self.asked_logprobs[:, start:stop] = logprobs.gather(-1, asked)
        row = 0
        for owner in self.jobs:
            draws = self.alt_draws.get(owner.key)
            if draws is not None:
                draws.record(logits[self.prompt_of_row[row], : stop - start], start, stop)
            row += owner.job.num_samples

    def rows(self, stats: DecodeStats) -> DecodingRows[Row] | None:
        """The prefilled rows of the requests still wanted, their prompt KV copied to each of their
        rows; None if nobody wants them any more."""
        assert self.last_logits is not None
        width = self.input_ids.shape[1]
        wanted: list[int] = []
        row = 0
        for owner in self.jobs:
            if not owner.dropped:
                self._set_prompt_logprobs(owner, self.prompt_of_row[row], width)
                wanted.extend(range(row, row + owner.job.num_samples))
            row += owner.job.num_samples
        if not wanted:
            return None
        prompts = [self.prompt_of_row[r] for r in wanted]
        stats.shared_prefill_rows += len(prompts) - len(set(prompts))
        index = torch.tensor(prompts, dtype=torch.long, device=self.device)
        for layer in self.cache.layers:
            layer.keep_rows(index)
        new_rows = [r for o in self.jobs if not o.dropped for r in o.rows]
        for new_row, prompt in zip(new_rows, prompts, strict=True):
            new_row.prefix, new_row.prefix_length = (
                (self.serial, prompt),
                len(new_row.owner.job.prompt_tokens),
            )
        jobs = [r.owner.job for r in new_rows]
        device = self.device
        return DecodingRows(
            new_rows,
            self.cache,
            self.mask.index_select(0, index),
            self.positions[:, -1:].index_select(0, index),
            self.last_logits.index_select(0, index),
            torch.nn.utils.rnn.pad_sequence([r.uniforms for r in new_rows], batch_first=True).to(device),
            torch.tensor([q.temperature for q in jobs], dtype=torch.float32, device=device),
            torch.tensor([q.top_k for q in jobs], dtype=torch.long, device=device),
            torch.tensor([q.top_p for q in jobs], dtype=torch.float32, device=device),
        )

    def _set_prompt_logprobs(self, owner: DecodingJob, prompt: int, width: int) -> None:
        job = owner.job
        owner.prompt_cache_hit_tokens = len(job.prompt_tokens) if owner.key in self.reused_prompt else 0
        draws = self.alt_draws.get(owner.key)
        if draws is not None:
            owner.prompt_alt_tokens = draws.answer()
        targets = job.target_prompt_logprobs
        if targets is not None:
            first = self.asked_columns[owner.key]
            rows = slice(width - len(job.prompt_tokens), width - 1)
            gathered = self.asked_logprobs[prompt, rows, first : first + targets.ids.shape[1]]
            owner.target_prompt_logprobs = targets.answer(gathered.cpu().numpy())
        if not (job.include_prompt_logprobs or job.topk_prompt_logprobs):
            return
        start = width - len(job.prompt_tokens)
        plain: list[float | None] = [None]
        plain.extend(self.target_logprobs[prompt, start:].tolist())
        owner.prompt_logprobs = plain
        if job.topk_prompt_logprobs:
            k = min(job.topk_prompt_logprobs, self.top_ids.shape[-1])
            ids = self.top_ids[prompt, start:, :k].tolist()
            values = self.top_values[prompt, start:, :k].tolist()
            topk: list[list[tuple[int, float]] | None] = [None]
            topk.extend(
                list(zip(id_row, value_row, strict=True))
                for id_row, value_row in zip(ids, values, strict=True)
            )
            owner.topk_prompt_logprobs = topk
