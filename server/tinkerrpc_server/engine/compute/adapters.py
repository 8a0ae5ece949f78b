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
from tinkerrpc_server.engine.compute.placement import resolve_placement
from tinkerrpc_server.engine.decoder import fuse_base_weights

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


@dataclass
class Adapter:
    peft_name: str
    spec: LoraSpec
    params: dict[str, torch.nn.Parameter]  # canonical (adapter-free) name -> parameter
    optimizer: torch.optim.AdamW
    # A forward_backward since the last optimizer step had a non-finite loss: the next step is refused.
    non_finite_loss: bool = False


class AdaptedModel:
    """A base model on `device` with its base weights in `dtype` (as in resolve_placement), and its
    adapters by model id. Whatever the base dtype, LoRA weights, their gradients and AdamW state are
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
        self.decoder_weights = fuse_base_weights(base)
        self.base = base
        self.peft: PeftModel | None = None
        self.vocab_size = int(base.get_output_embeddings().weight.shape[0])
        self.max_context_length = int(
            getattr(base.config, "max_position_embeddings", None) or self.tokenizer.model_max_length
        )
        self.adapters: dict[str, Adapter] = {}
        self.next_peft_id = 0
        log.info("base model %s on %s, base weights %s", self.base_model_path.name, self.device, self.dtype)

    def has_adapter(self, model_id: str) -> bool:
        return model_id in self.adapters

    def create_adapter(self, model_id: str, lora: LoraSpec) -> None:
        if model_id in self.adapters:
            raise EngineUserError(f"model {model_id!r} already exists")
        config = self._lora_config(lora)
        peft_name = self.add_peft_adapter(config, seed=lora.seed)
        self.adapters[model_id] = self.register(peft_name, lora)
        self.restore_trainability()

    def delete_adapter(self, model_id: str) -> None:
        adapter = self.require(model_id)
        self.remove_peft_adapter(adapter.peft_name)
        del self.adapters[model_id]

    def adapter_parameters(self, model_id: str) -> dict[str, torch.nn.Parameter]:
        """The live LoRA parameters of a model, by their adapter-independent PEFT names."""
        return dict(self.require(model_id).params)

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

    def add_peft_adapter(self, config: LoraConfig, seed: int) -> str:
        peft_name = f"adapter{self.next_peft_id}"
        self.next_peft_id += 1
        # Adapter init is a function of the seed alone (PEFT draws it on the CPU); the global RNG is left
        # untouched, CUDA's too (manual_seed seeds every device).
        cuda_devices = list(range(torch.cuda.device_count())) if self.device.type == "cuda" else []
        # autocast_adapter_dtype: PEFT gives new LoRA weights the base layer's dtype, then upcasts bf16
        # ones to float32 (so on bf16 base weights the initial A is bf16-rounded; B starts at zero).
        with torch.random.fork_rng(devices=cuda_devices):
            torch.manual_seed(seed)
            if self.peft is None:
                self.peft = get_peft_model(
                    self.base, config, adapter_name=peft_name, autocast_adapter_dtype=True
                )
            else:
                self.peft.add_adapter(peft_name, config, autocast_adapter_dtype=True)
        self.peft.to(self.device)
        return peft_name

    def remove_peft_adapter(self, peft_name: str) -> None:
        assert self.peft is not None
        with warnings.catch_warnings():
            # peft warns when the deleted adapter was the active one; every call sets its own.
            warnings.simplefilter("ignore", UserWarning)
            self.peft.delete_adapter(peft_name)

    def register(self, peft_name: str, spec: LoraSpec) -> Adapter:
        assert self.peft is not None
        marker = f".{peft_name}."
        params = {
            name.replace(marker, "."): param for name, param in self.peft.named_parameters() if marker in name
        }
        optimizer = torch.optim.AdamW(list(params.values()), lr=0.0)
        return Adapter(peft_name, spec, params, optimizer)

    def require(self, model_id: str) -> Adapter:
        adapter = self.adapters.get(model_id)
        if adapter is None:
            raise EngineUserError(f"unknown model {model_id!r}")
        return adapter

    @contextmanager
    def active(self, peft_name: str | None) -> Iterator[torch.nn.Module]:
        """Run with one adapter (or the bare base for None) active, restoring what was active."""
        if self.peft is None:
            assert peft_name is None
            yield self.base
            return
        previous = self.peft.active_adapter
        if previous == peft_name:
            # Already active: switching walks every module twice (~10 ms per call on tiny-chat).
            yield self.peft
            return
        if peft_name is None:
            with self.peft.disable_adapter():
                yield self.peft
            return
        self.peft.set_adapter(peft_name)
        self.restore_trainability()
        try:
            yield self.peft
        finally:
            if previous in self.peft.peft_config:
                self.peft.set_adapter(previous)
                self.restore_trainability()

    def restore_trainability(self) -> None:
        """peft's set_adapter freezes inactive adapters; every training adapter keeps its grads on."""
        assert self.peft is not None
        training = {id(p) for adapter in self.adapters.values() for p in adapter.params.values()}
        for param in self.peft.parameters():
            param.requires_grad_(id(param) in training)

    def check_tokens(self, tokens: np.ndarray, what: str) -> np.ndarray:
        if tokens.ndim != 1:
            raise EngineUserError(f"{what} tokens must be one-dimensional, got shape {tokens.shape}")
        if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
            raise EngineUserError(f"{what} tokens must be integers, got {tokens.dtype}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            bad = int(tokens[(tokens < 0) | (tokens >= self.vocab_size)][0])
            raise EngineUserError(f"{what} token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return tokens.astype(np.int64)
