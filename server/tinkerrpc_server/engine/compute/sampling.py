"""Sampling from a base model or from sampler weights saved for it: sample jobs checked and batched into
the scheduler, on the engine's own decoder when it can express the model, else on transformers."""

from __future__ import annotations

import math
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import replace
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig

from tinkerrpc_server.engine.compute.decoder import FusedDecoder
from tinkerrpc_server.engine.compute.errors import EngineUserError
from tinkerrpc_server.engine.compute.execution_plan import ExecutionPlan, process_plan
from tinkerrpc_server.engine.compute.feed import MappedFeed, RequestFeed
from tinkerrpc_server.engine.compute.forward_call import SamplingModel, TransformersSampler
from tinkerrpc_server.engine.compute.heap import return_freed_memory, returns_freed_memory
from tinkerrpc_server.engine.compute.prompt_targets import NO_TARGET
from tinkerrpc_server.engine.compute.samples import SampleJob, SampleOutput
from tinkerrpc_server.engine.compute.scheduler import (
    BatchPolicy,
    ModelContext,
    decode,
    generate,
)
from tinkerrpc_server.engine.compute.state_io import ADAPTER_CONFIG_FILE, ADAPTER_WEIGHTS_FILE, StateIO

# Sampler weights kept loaded as read-only adapters; the least recently sampled is unloaded first and
# loaded from its checkpoint again when next sampled. 8 covers an async RL loop's current and stale
# versions plus a KL reference or distillation teacher; each is one LoRA (23 MB at rank 16 on SmolLM2).
SAMPLER_CACHE_SIZE = 8


class Sampling(StateIO):
    """Samples from the base model or from sampler weights, batched under `policy` unless a call says
    otherwise, on the engine's own decoder with the kernels of `plan` (None: the process's plan)."""

    def __init__(
        self,
        model_path: Path,
        device: str | None = None,
        dtype: str | None = None,
        policy: BatchPolicy | None = None,
        plan: ExecutionPlan | None = None,
    ) -> None:
        super().__init__(model_path, device, dtype)
        self.policy = policy or BatchPolicy()
        self._plan = plan if plan is not None else process_plan()
        self._sampler_adapters: OrderedDict[str, str] = OrderedDict()  # weights key -> peft name
        # The decoder of the sampler weights sampled last: building its merged copy of the adapted
        # layers costs more than a short sample batch. Sampler adapters never change under their name;
        # one is kept, so at most one merged copy exists.
        self._last_decoder: tuple[str | None, FusedDecoder | None] | None = None
        self.default_stop_token_ids = self._default_stop_token_ids()

    @returns_freed_memory
    def sample(
        self, weights_dir: Path | None, jobs: list[SampleJob], policy: BatchPolicy | None = None
    ) -> list[SampleOutput]:
        """Sample `jobs` together (continuously batched under `policy`, by default the runtime's);
        a bad job raises before anything runs."""
        checked = [self._validate_job(index, job) for index, job in enumerate(jobs)]
        if not checked:
            raise EngineUserError("no sampling jobs given")
        return generate(
            self._sampling_model(weights_dir), checked, self.tokenizer, self.device, policy or self.policy
        )

    def serve_samples(
        self,
        weights_dir: Path | None,
        feed: RequestFeed[SampleJob, SampleOutput | EngineUserError],
        policy: BatchPolicy | None = None,
    ) -> Iterator[None]:
        """Sample the jobs `feed` brings, as they come, in one continuously batched decode (under
        `policy`, by default the runtime's), one stretch per `next()`: it pauses between two decode
        steps while `feed` has other work waiting (see `decode`). A bad job is answered with its
        EngineUserError without running."""

        def validated(key: int, job: SampleJob) -> SampleJob | None:
            try:
                return self._validate_job(key, job)
            except EngineUserError as exc:
                feed.deliver(key, exc)
                return None

        def output(key: int, result: SampleOutput) -> SampleOutput | EngineUserError:
            return result

        yield from decode(
            self._sampling_model(weights_dir),
            MappedFeed(feed, validated, output),
            self.tokenizer,
            self.device,
            policy or self.policy,
        )
        return_freed_memory()  # the batch's KV cache and logits

    def _sampling_model(self, weights_dir: Path | None) -> ModelContext:
        peft_name = None if weights_dir is None else self._sampler_adapter(Path(weights_dir))
        decoder = self._decoder(peft_name)

        @contextmanager
        def sampling_model() -> Iterator[SamplingModel]:
            # inference_mode, not no_grad: decoding never feeds autograd, so skip version counters too.
            if decoder is not None:
                with torch.inference_mode():
                    yield decoder
                return
            with self._active(peft_name) as model, torch.inference_mode():
                yield TransformersSampler(model)

        return sampling_model

    def _decoder(self, peft_name: str | None) -> FusedDecoder | None:
        """The engine's own decoder for a sampler adapter (None: the bare base), built once per adapter
        sampled in a row; None when it cannot express the model or adapter."""
        if self._last_decoder is not None and self._last_decoder[0] == peft_name:
            return self._last_decoder[1]
        self._last_decoder = None  # its merged copy goes before the next one is built
        decoder = FusedDecoder.build(self._decoder_weights, peft_name, self._plan)
        self._last_decoder = (peft_name, decoder)
        return decoder

    def _validate_job(self, index: int, job: SampleJob) -> SampleJob:
        """`job` checked, its default stops filled in."""
        where = f"sample job {index}"
        prompt = self._check_tokens(np.asarray(job.prompt_tokens, dtype=np.int64), f"{where} prompt")
        if len(prompt) == 0:
            raise EngineUserError(f"{where}: the prompt is empty")
        if job.num_samples < 1:
            raise EngineUserError(f"{where}: num_samples must be at least 1, got {job.num_samples}")
        if job.max_tokens < 1:
            raise EngineUserError(f"{where}: max_tokens must be at least 1, got {job.max_tokens}")
        if len(prompt) + job.max_tokens > self.max_context_length:
            raise EngineUserError(
                f"{where}: prompt ({len(prompt)} tokens) + max_tokens ({job.max_tokens}) exceeds the "
                f"model's context of {self.max_context_length}"
            )
        if not (math.isfinite(job.temperature) and job.temperature >= 0):
            raise EngineUserError(f"{where}: temperature must be >= 0, got {job.temperature}")
        if not (0 < job.top_p <= 1):
            raise EngineUserError(f"{where}: top_p must be in (0, 1], got {job.top_p}")
        if job.top_k < 0:
            raise EngineUserError(f"{where}: top_k must be 0 (off) or positive, got {job.top_k}")
        if job.topk_prompt_logprobs < 0:
            raise EngineUserError(f"{where}: topk_prompt_logprobs must be >= 0")
        if job.prompt_alt_tokens_k < 0:
            raise EngineUserError(f"{where}: prompt_alt_tokens_k must be >= 0")
        if not 0 <= job.topk_sample_logprobs <= self.vocab_size:
            raise EngineUserError(
                f"{where}: topk_sample_logprobs must be in [0, {self.vocab_size}] (the vocabulary), "
                f"got {job.topk_sample_logprobs}"
            )
        targets = job.target_prompt_logprobs
        if targets is not None and not np.all((targets.ids >= NO_TARGET) & (targets.ids < self.vocab_size)):
            raise EngineUserError(
                f"{where}: target_prompt_logprobs ids must be in [0, {self.vocab_size}) (the vocabulary) or "
                f"{NO_TARGET} (no target)"
            )
        last_n = job.prompt_logprobs_last_n
        if last_n is not None and not 1 <= last_n < len(prompt):
            raise EngineUserError(f"{where}: prompt_logprobs_last_n must be in [1, {len(prompt) - 1}]")
        stop_ids = self.default_stop_token_ids if job.stop_token_ids is None else job.stop_token_ids
        self._check_tokens(np.asarray(stop_ids, dtype=np.int64), f"{where} stop")
        if any(not s for s in job.stop_strings):
            raise EngineUserError(f"{where}: stop strings must not be empty")
        return replace(
            job,
            prompt_tokens=[int(t) for t in prompt],
            stop_token_ids=[int(t) for t in stop_ids],
            stop_strings=list(job.stop_strings),
        )

    def _sampler_adapter(self, weights_dir: Path) -> str:
        """A cached read-only adapter holding the sampler weights saved in `weights_dir`."""
        weights_file = weights_dir / ADAPTER_WEIGHTS_FILE
        if not (weights_dir / ADAPTER_CONFIG_FILE).is_file() or not weights_file.is_file():
            raise EngineUserError(f"no sampler weights at {weights_dir}")
        try:
            key = f"{weights_dir.resolve()}@{weights_file.stat().st_mtime_ns}"
            cached = self._sampler_adapters.get(key)
            if cached is not None:
                self._sampler_adapters.move_to_end(key)
                return cached
            config = LoraConfig.from_pretrained(str(weights_dir))
            peft_name = self._recycled_sampler_adapter(weights_dir, config) or self._load_peft_adapter(
                weights_dir, config
            )
        except (OSError, ValueError):
            # Their owner may delete them (a restore, DeleteModel) between the check above and the read.
            if weights_file.is_file():
                raise
            raise EngineUserError(f"no sampler weights at {weights_dir}: they were deleted") from None
        self._sampler_adapters[key] = peft_name
        if len(self._sampler_adapters) > SAMPLER_CACHE_SIZE:
            _, evicted = self._sampler_adapters.popitem(last=False)
            if self._last_decoder is not None and self._last_decoder[0] == evicted:
                self._last_decoder = None
            self._remove_peft_adapter(evicted)
        self._restore_trainability()
        return peft_name

    def _recycled_sampler_adapter(self, weights_dir: Path, config: LoraConfig) -> str | None:
        """With the cache full, the least recently sampled adapter, its weights overwritten by those in
        `weights_dir` where their layouts agree (an RL run's every version past the cache's size): it
        leaves the cache under its old key. None otherwise."""
        if len(self._sampler_adapters) < SAMPLER_CACHE_SIZE:
            return None
        oldest, peft_name = next(iter(self._sampler_adapters.items()))
        if not self._overwrite_peft_adapter(peft_name, weights_dir, config):
            return None
        del self._sampler_adapters[oldest]
        if self._last_decoder is not None and self._last_decoder[0] == peft_name:
            self._last_decoder = None  # its merged copy holds the old weights
        return peft_name

    def _default_stop_token_ids(self) -> list[int]:
        ids = set()
        if self.tokenizer.eos_token_id is not None:
            ids.add(int(self.tokenizer.eos_token_id))
        vocab = self.tokenizer.get_vocab()
        for marker in ("<|im_end|>", "<|endoftext|>"):
            if marker in vocab:
                ids.add(int(vocab[marker]))
        return sorted(ids)
