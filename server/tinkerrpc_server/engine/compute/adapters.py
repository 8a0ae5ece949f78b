"""The base model and its LoRA adapters: PEFT named adapters on a single PeftModel, trained side by side
and never merged into the base; which one is active for a forward pass; token ids checked against it.

Synchronous and not thread-safe: the engine runs every call on its one compute thread.
"""

from __future__ import annotations

import logging
import warnings
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from transformers import AutoModelForCausalLM, AutoTokenizer

from tinkerrpc_server.engine.compute.errors import EngineUserError
from tinkerrpc_server.engine.compute.fused_weights import fuse_base_weights
from tinkerrpc_server.engine.compute.optimizer_families import ADAMW, new_optimizer
from tinkerrpc_server.engine.compute.placement import resolve_placement

log = logging.getLogger("tinkerrpc.engine")

ATTN_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_MODULES = ["gate_proj", "up_proj", "down_proj"]
UNEMBED_MODULES = ["lm_head"]
# Tinker's parametrization (docs/tinker_parity.md): a fixed alpha, so the LoRA scale is alpha / rank and
# a learning rate carries over between ranks (and from Tinker); PEFT's default init (A Kaiming-uniform, B zero).
LORA_ALPHA = 32


@dataclass
class LoraSpec:
    rank: int
    seed: int
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True
    # The optimizer family it trains with (optimizer_families), fixed for its life as in Tinker.
    optimizer: str = ADAMW


@dataclass
class Adapter:
    peft_name: str
    spec: LoraSpec
    params: dict[str, torch.nn.Parameter]  # canonical (adapter-free) name -> parameter
    optimizer: torch.optim.Optimizer  # of spec.optimizer's family
    # A forward_backward since the last optimizer step had a non-finite loss: the next step is refused.
    non_finite_loss: bool = False


class AdaptedModel:
    """A base model on `device` with its base weights in `dtype` (as in resolve_placement), and its
    adapters by model id. Whatever the base dtype, LoRA weights, their gradients and optimizer state are
    float32: PEFT runs each LoRA branch in its weights' dtype (it casts the activations in, and the sum
    back to the base layer's dtype), and logprobs and losses are taken from float32 logits."""

    def __init__(self, model_path: Path, device: str | None = None, dtype: str | None = None) -> None:
        self.base_model_path = Path(model_path)
        self.device, self.dtype = resolve_placement(device, dtype)
        self.tokenizer = AutoTokenizer.from_pretrained(self.base_model_path)
        base = AutoModelForCausalLM.from_pretrained(
            self.base_model_path, dtype=self.dtype, attn_implementation="sdpa"
        )
        base.to(self.device)
        base.eval()  # no dropout anywhere: training steps are deterministic functions of the data
        for param in base.parameters():
            param.requires_grad_(False)
        self._decoder_weights = fuse_base_weights(base)
        self._base = base
        self._peft: PeftModel | None = None
        self.vocab_size = int(base.get_output_embeddings().weight.shape[0])
        self.max_context_length = int(
            getattr(base.config, "max_position_embeddings", None) or self.tokenizer.model_max_length
        )
        self._adapters: dict[str, Adapter] = {}
        self._next_peft_id = 0
        log.info("base model %s on %s, base weights %s", self.base_model_path.name, self.device, self.dtype)

    def has_adapter(self, model_id: str) -> bool:
        return model_id in self._adapters

    def create_adapter(self, model_id: str, lora: LoraSpec) -> None:
        if model_id in self._adapters:
            raise EngineUserError(f"model {model_id!r} already exists")
        config = self._lora_config(lora)
        peft_name = self._add_peft_adapter(config, seed=lora.seed)
        self._adapters[model_id] = self._register(peft_name, lora)
        self._restore_trainability()

    def delete_adapter(self, model_id: str) -> None:
        adapter = self._require_adapter(model_id)
        self._remove_peft_adapter(adapter.peft_name)
        del self._adapters[model_id]

    def _lora_config(self, lora: LoraSpec) -> LoraConfig:
        if lora.rank < 1:
            raise EngineUserError(f"LoRA rank must be at least 1, got {lora.rank}")
        targets = (
            (ATTN_MODULES if lora.train_attn else [])
            + (MLP_MODULES if lora.train_mlp else [])
            + (UNEMBED_MODULES if lora.train_unembed else [])
        )
        if not targets:
            raise EngineUserError("at least one of train_attn, train_mlp, train_unembed must be true")
        return LoraConfig(
            r=lora.rank,
            lora_alpha=LORA_ALPHA,
            lora_dropout=0.0,
            target_modules=targets,
            base_model_name_or_path=str(self.base_model_path),
        )

    def _add_peft_adapter(self, config: LoraConfig, seed: int) -> str:
        peft_name = f"adapter{self._next_peft_id}"
        self._next_peft_id += 1
        # Adapter init is a function of the seed alone (PEFT draws it on the CPU); the global RNG is left
        # untouched, CUDA's too (manual_seed seeds every device).
        cuda_devices = list(range(torch.cuda.device_count())) if self.device.type == "cuda" else []
        # autocast_adapter_dtype: PEFT gives new LoRA weights the base layer's dtype, then upcasts bf16
        # ones to float32 (so on bf16 base weights the initial A is bf16-rounded; B starts at zero).
        with torch.random.fork_rng(devices=cuda_devices):
            torch.manual_seed(seed)
            if self._peft is None:
                self._peft = get_peft_model(
                    self._base, config, adapter_name=peft_name, autocast_adapter_dtype=True
                )
            else:
                self._peft.add_adapter(peft_name, config, autocast_adapter_dtype=True)
        self._peft.to(self.device)
        return peft_name

    def _remove_peft_adapter(self, peft_name: str) -> None:
        assert self._peft is not None
        with warnings.catch_warnings():
            # peft warns when the deleted adapter was the active one; every call sets its own.
            warnings.simplefilter("ignore", UserWarning)
            self._peft.delete_adapter(peft_name)

    def _register(self, peft_name: str, spec: LoraSpec) -> Adapter:
        params = self._peft_parameters(peft_name)
        return Adapter(peft_name, spec, params, new_optimizer(spec.optimizer, list(params.values())))

    def _peft_parameters(self, peft_name: str) -> dict[str, torch.nn.Parameter]:
        """The loaded adapter's parameters under their adapter-free names (those PEFT saves them under)."""
        assert self._peft is not None
        marker = f".{peft_name}."
        return {
            name.replace(marker, "."): param
            for name, param in self._peft.named_parameters()
            if marker in name
        }

    def _require_adapter(self, model_id: str) -> Adapter:
        adapter = self._adapters.get(model_id)
        if adapter is None:
            raise EngineUserError(f"unknown model {model_id!r}")
        return adapter

    @contextmanager
    def _active(self, peft_name: str | None) -> Iterator[torch.nn.Module]:
        """Run with one adapter (or the bare base for None) active, restoring what was active."""
        if self._peft is None:
            assert peft_name is None
            yield self._base
            return
        previous = self._peft.active_adapter
        if previous == peft_name:
            # Already active: switching walks every module twice, a cost every call would pay.
            yield self._peft
            return
        if peft_name is None:
            with self._peft.disable_adapter():
                yield self._peft
            return
        self._peft.set_adapter(peft_name)
        self._restore_trainability()
        try:
            yield self._peft
        finally:
            if previous in self._peft.peft_config:
                self._peft.set_adapter(previous)
                self._restore_trainability()

    def _restore_trainability(self) -> None:
        """peft's set_adapter freezes inactive adapters; every training adapter keeps its grads on."""
        assert self._peft is not None
        training = {id(p) for adapter in self._adapters.values() for p in adapter.params.values()}
        for param in self._peft.parameters():
            param.requires_grad_(id(param) in training)

    def adapter_parameters(self, model_id: str) -> dict[str, torch.nn.Parameter]:
        """The live LoRA parameters of a model, by their adapter-independent PEFT names."""
        return dict(self._require_adapter(model_id).params)

    def _check_tokens(self, tokens: np.ndarray, what: str) -> np.ndarray:
        if tokens.ndim != 1:
            raise EngineUserError(f"{what} tokens must be one-dimensional, got shape {tokens.shape}")
        if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
            raise EngineUserError(f"{what} tokens must be integers, got {tokens.dtype}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            bad = int(tokens[(tokens < 0) | (tokens >= self.vocab_size)][0])
            raise EngineUserError(f"{what} token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return tokens.astype(np.int64)
