"""The engine's compute core: one base model, many named LoRA adapters trained side by side.

Synchronous and not thread-safe: the HTTP layer runs every call on one worker thread.
Adapters are PEFT named adapters on a single PeftModel and are never merged into the base.
"""

from __future__ import annotations

import json
import logging
import math
import os
import shutil
import tempfile
import warnings
from collections import OrderedDict
from collections.abc import Iterator
from contextlib import contextmanager
from dataclasses import asdict, dataclass, field
from pathlib import Path

import numpy as np
import torch
from peft import LoraConfig, PeftModel, get_peft_model, get_peft_model_state_dict, set_peft_model_state_dict
from safetensors.torch import load_file, save_file
from transformers import AutoModelForCausalLM, AutoTokenizer

from tinkerrpc_server.engine import sampler
from tinkerrpc_server.engine.compute.decoder import FusedDecoder, FusedTrainingForward, fuse_base_weights
from tinkerrpc_server.engine.compute.unembedding import saved_logits_positions, target_logprobs
from tinkerrpc_server.engine.losses import LOSSES, resolve_config
from tinkerrpc_server.settings import ENGINE_DEVICE_ENV, ENGINE_DTYPE_ENV, ENGINE_DTYPES

log = logging.getLogger("tinkerrpc.engine")

ATTN_MODULES = ["q_proj", "k_proj", "v_proj", "o_proj"]
MLP_MODULES = ["gate_proj", "up_proj", "down_proj"]
UNEMBED_MODULES = ["lm_head"]

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
LORA_SPEC_FILE = "tinkerrpc_lora.json"
# Tinker's parametrization (docs/tinker_parity.md): a fixed alpha, so the LoRA scale is alpha / rank and
# a learning rate carries over between ranks (and from Tinker); PEFT's default init (A Kaiming-uniform, B zero).
LORA_ALPHA = 32
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_META_FILE = "optimizer.json"

# Padded tokens per micro-batch; bounds activation memory while keeping batches large. At a wide
# vocabulary the logits kept for backward bound it lower (unembedding.saved_logits_positions).
MICRO_BATCH_TOKENS = 8192
# A datum joins the current micro-batch if padding it wastes at most this share of the batch
# width, or at most the fixed cost of one more forward/backward (in token equivalents, measured
# on CPU: short sequences are cheaper padded together than run as separate micro-batches).
MAX_PADDING_FRACTION = 0.25
MICRO_BATCH_OVERHEAD_TOKENS = 64
SAMPLER_CACHE_SIZE = 8


class EngineUserError(ValueError):
    """Bad input. The message is shown to the SDK user and no state was changed."""


# The server maps a failed optim_step whose message starts with "NON_FINITE_UPDATE:" to its ErrorReason
# of that name (errors.proto), knowing that the model's weights and optimizer state did not change.
NON_FINITE_UPDATE = "NON_FINITE_UPDATE"


class NonFiniteUpdateError(EngineUserError):
    """An optimizer step refused because the loss or gradients since the last step, or the updated
    weights or optimizer state, were not finite: the adapter is as before the step, gradients cleared."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"{NON_FINITE_UPDATE}: {detail}")


@dataclass
class LoraSpec:
    rank: int
    seed: int
    train_mlp: bool = True
    train_attn: bool = True
    train_unembed: bool = True


@dataclass
class DatumArrays:
    input_tokens: np.ndarray
    loss_fn_inputs: dict[str, np.ndarray]


@dataclass
class ForwardResult:
    logprobs: list[np.ndarray]
    metrics: dict[str, float]


@dataclass
class SampleJob:
    prompt_tokens: list[int]
    num_samples: int
    max_tokens: int
    temperature: float = 1.0
    top_k: int = -1
    top_p: float = 1.0
    stop_token_ids: list[int] | None = None
    stop_strings: list[str] = field(default_factory=list)
    seed: int | None = None
    include_prompt_logprobs: bool = False
    topk_prompt_logprobs: int = 0


@dataclass
class SampledSeq:
    tokens: list[int]
    logprobs: list[float]
    stop_reason: str


@dataclass
class SampleOutput:
    sequences: list[SampledSeq]
    prompt_logprobs: list[float | None] | None
    topk_prompt_logprobs: list[list[tuple[int, float]] | None] | None


@dataclass
class _Adapter:
    peft_name: str
    spec: LoraSpec
    params: dict[str, torch.nn.Parameter]  # canonical (adapter-free) name -> parameter
    optimizer: torch.optim.AdamW
    # A forward_backward since the last optimizer step had a non-finite loss: the next step is refused.
    non_finite_loss: bool = False


class PlacementError(ValueError):
    """An engine device or base-weight dtype this machine cannot run; the message says which and why."""


def resolve_placement(
    device: str | None = None, dtype: str | None = None
) -> tuple[torch.device, torch.dtype]:
    """The device and base-weight dtype of the engine: the arguments, else $TINKERRPC_ENGINE_DEVICE and
    $TINKERRPC_ENGINE_DTYPE (settings.py), else CUDA when there is one, bfloat16 on CUDA, float32 elsewhere.

    bfloat16 halves the base model's memory and runs on the GPU's tensor cores; float32 stays the CPU
    default, where bfloat16 matmuls are no faster and the reference tests compare float32 numerics.
    """
    device = device or os.environ.get(ENGINE_DEVICE_ENV) or None
    dtype = dtype or os.environ.get(ENGINE_DTYPE_ENV) or None
    try:
        resolved = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    except RuntimeError as error:
        raise PlacementError(f"engine device {device!r} is not a torch device: {error}") from None
    if resolved.type == "cuda":
        if not torch.cuda.is_available():
            raise PlacementError(
                f"engine device {device!r}: this machine has no usable CUDA device "
                f"(torch {torch.__version__}, torch.cuda.is_available() is False)"
            )
        if resolved.index is not None and resolved.index >= torch.cuda.device_count():
            raise PlacementError(
                f"engine device {device!r}: this machine has {torch.cuda.device_count()} CUDA device(s)"
            )
    elif resolved.type != "cpu":
        raise PlacementError(f"engine device {device!r}: the engine runs on cpu or cuda")
    if dtype is None:
        return resolved, torch.bfloat16 if resolved.type == "cuda" else torch.float32
    if dtype not in ENGINE_DTYPES:
        raise PlacementError(f"engine dtype {dtype!r}: expected one of {', '.join(ENGINE_DTYPES)}")
    return resolved, getattr(torch, dtype)


class BaseModelRuntime:
    """`device` and `dtype` (of the base weights) as in resolve_placement. Whatever the base dtype, LoRA
    weights, their gradients and AdamW state are float32: PEFT runs each LoRA branch in its weights'
    dtype (it casts the activations in, and the sum back to the base layer's dtype), and logprobs and
    losses are taken from float32 logits."""

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
        self._adapters: dict[str, _Adapter] = {}
        self._sampler_adapters: OrderedDict[str, str] = OrderedDict()  # weights key -> peft name
        # The decoder of the sampler weights sampled last (its merged copy of the adapted layers costs
        # ~40 ms to build on the bench model, every sample batch otherwise). Sampler adapters never
        # change under their name; one is kept, so at most one merged copy exists.
        self._last_decoder: tuple[str | None, FusedDecoder | None] | None = None
        self._next_peft_id = 0
        self.default_stop_token_ids = self._default_stop_token_ids()
        log.info("base model %s on %s, base weights %s", self.base_model_path.name, self.device, self.dtype)

    # ---------------------------------------------------------------- adapters

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

    def _register(self, peft_name: str, spec: LoraSpec) -> _Adapter:
        assert self._peft is not None
        marker = f".{peft_name}."
        params = {
            name.replace(marker, "."): param
            for name, param in self._peft.named_parameters()
            if marker in name
        }
        optimizer = torch.optim.AdamW(list(params.values()), lr=0.0)
        return _Adapter(peft_name, spec, params, optimizer)

    def _require_adapter(self, model_id: str) -> _Adapter:
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
            # Already active: switching walks every module twice (~10 ms per call on tiny-chat).
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

    # ---------------------------------------------------------------- training

    def forward_backward(
        self,
        model_id: str,
        data: list[DatumArrays],
        loss_fn: str,
        loss_fn_config: dict[str, float] | None,
        backward: bool,
    ) -> ForwardResult:
        adapter = self._require_adapter(model_id)
        config, prepared = self._validate_batch(data, loss_fn, loss_fn_config)
        spec = LOSSES[loss_fn]
        logprobs: list[np.ndarray] = [np.zeros(0, dtype=np.float32)] * len(data)
        loss_total = 0.0
        forward = FusedTrainingForward.build(self._decoder_weights, adapter.peft_name)
        with self._active(adapter.peft_name) as model, torch.set_grad_enabled(backward):
            micro_batch_tokens = min(MICRO_BATCH_TOKENS, saved_logits_positions(self.vocab_size))
            for batch in bucket_by_length([len(d.input_tokens) for d in data], micro_batch_tokens):
                token_lp = self._target_logprobs(model, forward, [prepared[i] for i in batch])
                losses = [
                    spec.fn(lp, prepared[i].inputs, config) for i, lp in zip(batch, token_lp, strict=True)
                ]
                batch_loss = torch.stack(losses).sum()
                if backward:
                    batch_loss.backward()
                loss_total += float(batch_loss.detach())
                for i, lp in zip(batch, token_lp, strict=True):
                    logprobs[i] = lp.detach().to("cpu", torch.float32).numpy()
        if backward and not math.isfinite(loss_total):
            adapter.non_finite_loss = True
        return ForwardResult(logprobs=logprobs, metrics={"loss:sum": loss_total})

    def _target_logprobs(
        self, model: torch.nn.Module, forward: FusedTrainingForward | None, batch: list[_Prepared]
    ) -> list[torch.Tensor]:
        """Right-padded forward of one micro-batch (through `forward` when the model has one, else
        transformers); the learner logprob of every target token (the logits of padding positions are
        never computed)."""
        width = max(len(item.tokens) for item in batch)
        tokens = torch.zeros((len(batch), width), dtype=torch.long, device=self.device)
        targets = torch.zeros_like(tokens)
        mask = torch.zeros_like(tokens)
        for row, item in enumerate(batch):
            n = len(item.tokens)
            tokens[row, :n] = item.tokens
            targets[row, :n] = item.targets
            mask[row, :n] = 1
        lp = target_logprobs(
            model, tokens, mask, targets[mask.bool()], forward.hidden_states if forward is not None else None
        )
        ends = np.cumsum([len(item.tokens) for item in batch]).tolist()
        return [lp[end - len(item.tokens) : end] for item, end in zip(batch, ends, strict=True)]

    def _validate_batch(
        self, data: list[DatumArrays], loss_fn: str, loss_fn_config: dict[str, float] | None
    ) -> tuple[dict[str, float], list[_Prepared]]:
        if loss_fn not in LOSSES:
            raise EngineUserError(f"unknown loss_fn {loss_fn!r}; expected one of {', '.join(LOSSES)}")
        try:
            config = resolve_config(loss_fn, loss_fn_config)
        except ValueError as error:
            raise EngineUserError(str(error)) from None
        if not data:
            raise EngineUserError("data is empty: forward_backward needs at least one datum")
        required = {"target_tokens", *LOSSES[loss_fn].float_inputs}
        prepared = []
        for index, datum in enumerate(data):
            where = f"datum {index}"
            tokens = self._check_tokens(np.asarray(datum.input_tokens), f"{where} model_input")
            if len(tokens) == 0:
                raise EngineUserError(f"{where} has no input tokens")
            if len(tokens) > self.max_context_length:
                raise EngineUserError(
                    f"{where} has {len(tokens)} tokens, more than the model's context of "
                    f"{self.max_context_length}"
                )
            missing = sorted(required - set(datum.loss_fn_inputs))
            if missing:
                raise EngineUserError(f"{where}: {loss_fn} needs loss_fn_inputs {missing}")
            unexpected = sorted(set(datum.loss_fn_inputs) - required)
            if unexpected:
                raise EngineUserError(f"{where}: loss_fn_inputs {unexpected} are not used by {loss_fn}")
            for key, values in datum.loss_fn_inputs.items():
                if np.asarray(values).shape != tokens.shape:
                    raise EngineUserError(
                        f"{where}: loss_fn_inputs[{key!r}] has shape {np.asarray(values).shape}, "
                        f"model_input has {len(tokens)} tokens"
                    )
            targets = self._check_tokens(np.asarray(datum.loss_fn_inputs["target_tokens"]), f"{where} target")
            inputs = {}
            for key in LOSSES[loss_fn].float_inputs:
                values = np.asarray(datum.loss_fn_inputs[key], dtype=np.float64)
                if not np.all(np.isfinite(values)):
                    raise EngineUserError(f"{where}: loss_fn_inputs[{key!r}] has non-finite values")
                inputs[key] = torch.tensor(values, dtype=torch.float32, device=self.device)
            prepared.append(
                _Prepared(
                    torch.tensor(tokens, dtype=torch.long, device=self.device),
                    torch.tensor(targets, dtype=torch.long, device=self.device),
                    inputs,
                )
            )
        return config, prepared

    def _check_tokens(self, tokens: np.ndarray, what: str) -> np.ndarray:
        if tokens.ndim != 1:
            raise EngineUserError(f"{what} tokens must be one-dimensional, got shape {tokens.shape}")
        if tokens.size and not np.issubdtype(tokens.dtype, np.integer):
            raise EngineUserError(f"{what} tokens must be integers, got {tokens.dtype}")
        if tokens.size and (tokens.min() < 0 or tokens.max() >= self.vocab_size):
            bad = int(tokens[(tokens < 0) | (tokens >= self.vocab_size)][0])
            raise EngineUserError(f"{what} token id {bad} is outside the vocabulary [0, {self.vocab_size})")
        return tokens.astype(np.int64)

    def optim_step(
        self,
        model_id: str,
        learning_rate: float,
        beta1: float,
        beta2: float,
        eps: float,
        weight_decay: float,
        grad_clip_norm: float,
    ) -> dict[str, float]:
        adapter = self._require_adapter(model_id)
        checks = {
            "learning_rate": learning_rate >= 0,
            "beta1": 0 <= beta1 < 1,
            "beta2": 0 <= beta2 < 1,
            "eps": eps >= 0,
            "weight_decay": weight_decay >= 0,
            "grad_clip_norm": grad_clip_norm >= 0,
        }
        values = {
            "learning_rate": learning_rate,
            "beta1": beta1,
            "beta2": beta2,
            "eps": eps,
            "weight_decay": weight_decay,
            "grad_clip_norm": grad_clip_norm,
        }
        for name, ok in checks.items():
            if not (ok and math.isfinite(values[name])):
                raise EngineUserError(f"invalid AdamParams.{name}: {values[name]}")
        params = list(adapter.params.values())
        for param in params:
            # No forward_backward since the last step still makes a (decay-only) step.
            if param.grad is None:
                param.grad = torch.zeros_like(param)
        grad_norm = float(torch.nn.utils.get_total_norm([p.grad for p in params if p.grad is not None]))
        if adapter.non_finite_loss or not math.isfinite(grad_norm):
            self._discard_gradients(adapter)
            raise NonFiniteUpdateError(
                f"the loss or gradients since the last step are not finite (gradient norm {grad_norm})"
            )
        before = _snapshot(adapter)
        if grad_clip_norm > 0:
            torch.nn.utils.clip_grads_with_norm_(params, grad_clip_norm, torch.tensor(grad_norm))
        for group in adapter.optimizer.param_groups:
            group.update(lr=learning_rate, betas=(beta1, beta2), eps=eps, weight_decay=weight_decay)
        try:
            adapter.optimizer.step()
            finite = _all_finite(adapter)
        except RuntimeError as error:
            # torch stops mid-step when a scaled value overflows float (some parameters already moved).
            _restore(adapter, before)
            self._discard_gradients(adapter)
            if "overflow" not in str(error):
                raise
            raise NonFiniteUpdateError(f"the update overflows float32 ({error})") from None
        if not finite:
            _restore(adapter, before)
            self._discard_gradients(adapter)
            raise NonFiniteUpdateError("the updated weights or optimizer state are not finite")
        adapter.optimizer.zero_grad(set_to_none=True)
        return {"grad_norm:mean": grad_norm, "learning_rate:mean": learning_rate}

    @staticmethod
    def _discard_gradients(adapter: _Adapter) -> None:
        adapter.optimizer.zero_grad(set_to_none=True)
        adapter.non_finite_loss = False

    # ---------------------------------------------------------------- state

    def save_state(self, model_id: str, directory: Path, include_optimizer: bool) -> None:
        adapter = self._require_adapter(model_id)
        assert self._peft is not None
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
        try:
            self._peft.peft_config[adapter.peft_name].save_pretrained(str(staging))
            # The base lm_head stays in the base model: only LoRA factors go into the file.
            weights = get_peft_model_state_dict(
                self._peft, adapter_name=adapter.peft_name, save_embedding_layers=False
            )
            save_file(
                {k: v.detach().cpu().contiguous() for k, v in weights.items()},
                str(staging / ADAPTER_WEIGHTS_FILE),
                metadata={"format": "pt"},
            )
            (staging / LORA_SPEC_FILE).write_text(json.dumps(asdict(adapter.spec)))
            if include_optimizer:
                self._save_optimizer(adapter, staging)
            _publish_directory(staging, directory)
        finally:
            if staging.exists():
                shutil.rmtree(staging, ignore_errors=True)

    def _save_optimizer(self, adapter: _Adapter, directory: Path) -> None:
        tensors: dict[str, torch.Tensor] = {}
        steps: dict[str, float] = {}
        for name, param in adapter.params.items():
            state = adapter.optimizer.state.get(param)
            if not state:
                continue
            tensors[f"{name}.exp_avg"] = state["exp_avg"].detach().cpu().contiguous()
            tensors[f"{name}.exp_avg_sq"] = state["exp_avg_sq"].detach().cpu().contiguous()
            steps[name] = float(state["step"])
        save_file(tensors, str(directory / OPTIMIZER_FILE))
        (directory / OPTIMIZER_META_FILE).write_text(json.dumps({"steps": steps}))

    def load_state(self, model_id: str, directory: Path, include_optimizer: bool) -> LoraSpec:
        directory = Path(directory)
        if (
            not (directory / ADAPTER_CONFIG_FILE).is_file()
            or not (directory / ADAPTER_WEIGHTS_FILE).is_file()
        ):
            raise EngineUserError(f"no saved adapter at {directory}")
        if include_optimizer and not (directory / OPTIMIZER_FILE).is_file():
            raise EngineUserError(f"checkpoint {directory} has no optimizer state (saved for sampling only)")
        config = LoraConfig.from_pretrained(str(directory))
        spec = self._read_lora_spec(directory, config)
        peft_name = self._load_peft_adapter(directory, config)
        try:
            adapter = self._register(peft_name, spec)
            if include_optimizer:
                self._load_optimizer(adapter, directory)
        except Exception:
            self._remove_peft_adapter(peft_name)
            raise
        previous = self._adapters.get(model_id)
        if previous is not None:
            self._remove_peft_adapter(previous.peft_name)
        self._adapters[model_id] = adapter
        self._restore_trainability()
        return spec

    def _read_lora_spec(self, directory: Path, config: LoraConfig) -> LoraSpec:
        spec_file = directory / LORA_SPEC_FILE
        if spec_file.is_file():
            return LoraSpec(**json.loads(spec_file.read_text()))
        # A plain PEFT adapter saved elsewhere: recover what its config says.
        targets = set(config.target_modules or [])
        return LoraSpec(
            rank=int(config.r),
            seed=0,
            train_mlp=bool(targets & set(MLP_MODULES)),
            train_attn=bool(targets & set(ATTN_MODULES)),
            train_unembed=bool(targets & set(UNEMBED_MODULES)),
        )

    def _load_peft_adapter(self, directory: Path, config: LoraConfig) -> str:
        config.inference_mode = False
        peft_name = self._add_peft_adapter(config, seed=0)
        assert self._peft is not None
        try:
            weights = load_file(str(directory / ADAPTER_WEIGHTS_FILE), device=str(self.device))
            result = set_peft_model_state_dict(self._peft, weights, adapter_name=peft_name)
            # peft annotates its return as `namedtuple` (a function, not a type); it is torch's
            # load_state_dict result, which has missing_keys.
            missing = [k for k in result.missing_keys if f".{peft_name}." in k]  # type: ignore[attr-defined]
            if missing:
                raise EngineUserError(f"adapter at {directory} lacks weights for {missing[:3]}")
        except EngineUserError:
            self._remove_peft_adapter(peft_name)
            raise
        except (RuntimeError, ValueError) as error:
            self._remove_peft_adapter(peft_name)
            raise EngineUserError(f"adapter at {directory} does not fit this base model: {error}") from None
        return peft_name

    def _load_optimizer(self, adapter: _Adapter, directory: Path) -> None:
        tensors = load_file(str(directory / OPTIMIZER_FILE), device=str(self.device))
        steps = json.loads((directory / OPTIMIZER_META_FILE).read_text())["steps"]
        for name, param in adapter.params.items():
            if name not in steps:
                continue
            adapter.optimizer.state[param] = {
                "step": torch.tensor(float(steps[name]), dtype=torch.float32),
                "exp_avg": tensors[f"{name}.exp_avg"].to(param.dtype),
                "exp_avg_sq": tensors[f"{name}.exp_avg_sq"].to(param.dtype),
            }

    # ---------------------------------------------------------------- sampling

    def sample(
        self, weights_dir: Path | None, jobs: list[SampleJob], policy: sampler.BatchPolicy | None = None
    ) -> list[SampleOutput]:
        """Sample `jobs` together (continuously batched under `policy`, by default the environment's);
        a bad job raises before anything runs."""
        requests = [self._validate_job(index, job) for index, job in enumerate(jobs)]
        if not requests:
            raise EngineUserError("no sampling jobs given")
        results = sampler.generate(
            self._sampling_model(weights_dir),
            requests,
            self.tokenizer,
            self.device,
            policy or sampler.BatchPolicy.from_environment(),
        )
        return [_sample_output(result) for result in results]

    def serve_samples(
        self,
        weights_dir: Path | None,
        feed: sampler.RequestFeed[SampleJob, SampleOutput | EngineUserError],
        policy: sampler.BatchPolicy | None = None,
    ) -> None:
        """Sample the jobs `feed` brings, as they come, in one continuously batched decode (under
        `policy`, by default the environment's); a bad job is answered with its EngineUserError
        without running."""

        def validated(key: int, job: SampleJob) -> sampler.SampleRequest | None:
            try:
                return self._validate_job(key, job)
            except EngineUserError as exc:
                feed.deliver(key, exc)
                return None

        def output(key: int, result: sampler.RequestResult) -> SampleOutput | EngineUserError:
            return _sample_output(result)

        sampler.decode(
            self._sampling_model(weights_dir),
            sampler.MappedFeed(feed, validated, output),
            self.tokenizer,
            self.device,
            policy or sampler.BatchPolicy.from_environment(),
        )

    def _sampling_model(self, weights_dir: Path | None) -> sampler.ModelContext:
        peft_name = None if weights_dir is None else self._sampler_adapter(Path(weights_dir))
        decoder = self._decoder(peft_name)

        @contextmanager
        def sampling_model() -> Iterator[sampler.SamplingModel]:
            # inference_mode, not no_grad: decoding never feeds autograd, so skip version counters too.
            if decoder is not None:
                with torch.inference_mode():
                    yield decoder
                return
            with self._active(peft_name) as model, torch.inference_mode():
                yield model

        return sampling_model

    def _decoder(self, peft_name: str | None) -> FusedDecoder | None:
        """The engine's own decoder for a sampler adapter (None: the bare base), built once per adapter
        sampled in a row; None when it cannot express the model or adapter."""
        if self._last_decoder is not None and self._last_decoder[0] == peft_name:
            return self._last_decoder[1]
        self._last_decoder = None  # its merged copy goes before the next one is built
        decoder = FusedDecoder.build(self._decoder_weights, peft_name)
        self._last_decoder = (peft_name, decoder)
        return decoder

    def _validate_job(self, index: int, job: SampleJob) -> sampler.SampleRequest:
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
        if job.top_k < -1:
            raise EngineUserError(f"{where}: top_k must be -1 (off) or positive, got {job.top_k}")
        if job.topk_prompt_logprobs < 0:
            raise EngineUserError(f"{where}: topk_prompt_logprobs must be >= 0")
        stop_ids = self.default_stop_token_ids if job.stop_token_ids is None else job.stop_token_ids
        self._check_tokens(np.asarray(stop_ids, dtype=np.int64), f"{where} stop")
        if any(not s for s in job.stop_strings):
            raise EngineUserError(f"{where}: stop strings must not be empty")
        return sampler.SampleRequest(
            prompt=[int(t) for t in prompt],
            num_samples=job.num_samples,
            max_tokens=job.max_tokens,
            temperature=job.temperature,
            top_k=job.top_k if job.top_k > 0 else 0,
            top_p=job.top_p,
            stop_token_ids=frozenset(int(t) for t in stop_ids),
            stop_strings=list(job.stop_strings),
            seed=job.seed,
            include_prompt_logprobs=job.include_prompt_logprobs,
            topk_prompt_logprobs=job.topk_prompt_logprobs,
        )

    def _sampler_adapter(self, weights_dir: Path) -> str:
        """A cached read-only adapter holding the sampler weights saved in `weights_dir`."""
        weights_file = weights_dir / ADAPTER_WEIGHTS_FILE
        if not (weights_dir / ADAPTER_CONFIG_FILE).is_file() or not weights_file.is_file():
            raise EngineUserError(f"no sampler weights at {weights_dir}")
        key = f"{weights_dir.resolve()}@{weights_file.stat().st_mtime_ns}"
        cached = self._sampler_adapters.get(key)
        if cached is not None:
            self._sampler_adapters.move_to_end(key)
            return cached
        peft_name = self._load_peft_adapter(weights_dir, LoraConfig.from_pretrained(str(weights_dir)))
        self._sampler_adapters[key] = peft_name
        if len(self._sampler_adapters) > SAMPLER_CACHE_SIZE:
            _, evicted = self._sampler_adapters.popitem(last=False)
            if self._last_decoder is not None and self._last_decoder[0] == evicted:
                self._last_decoder = None
            self._remove_peft_adapter(evicted)
        self._restore_trainability()
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


def _sample_output(result: sampler.RequestResult) -> SampleOutput:
    return SampleOutput(
        sequences=[SampledSeq(s.tokens, s.logprobs, s.stop_reason) for s in result.sequences],
        prompt_logprobs=result.prompt_logprobs,
        topk_prompt_logprobs=result.topk_prompt_logprobs,
    )


# What an optimizer step changes, per parameter: its value and its AdamW state (None before its first step).
_Snapshot = list[tuple[torch.nn.Parameter, torch.Tensor, dict[str, torch.Tensor] | None]]


def _snapshot(adapter: _Adapter) -> _Snapshot:
    """A copy of the LoRA weights and optimizer state (small beside the base model) to undo a step."""
    saved: _Snapshot = []
    for param in adapter.params.values():
        state = adapter.optimizer.state.get(param)
        state_copy = {key: value.clone() for key, value in state.items()} if state else None
        saved.append((param, param.detach().clone(), state_copy))
    return saved


def _restore(adapter: _Adapter, saved: _Snapshot) -> None:
    with torch.no_grad():
        for param, value, state in saved:
            param.copy_(value)
            if state is None:
                adapter.optimizer.state.pop(param, None)
            else:
                adapter.optimizer.state[param] = state


def _all_finite(adapter: _Adapter) -> bool:
    tensors = [p.detach() for p in adapter.params.values()]
    for state in adapter.optimizer.state.values():
        tensors.extend(v for key, v in state.items() if key != "step")
    # One device sync for all of them.
    return bool(torch.stack([torch.isfinite(t).all() for t in tensors]).all())


@dataclass
class _Prepared:
    tokens: torch.Tensor
    targets: torch.Tensor
    inputs: dict[str, torch.Tensor]


def bucket_by_length(lengths: list[int], max_tokens: int = MICRO_BATCH_TOKENS) -> list[list[int]]:
    """Group datum indices into micro-batches of similar length (longest first).

    Right padding to the longest member wastes little when members are alike, and the loss is
    a sum, so per-micro-batch results add up exactly to the whole batch. A micro-batch holds at most
    `max_tokens` padded tokens (a longer datum is one alone).
    """
    order = sorted(range(len(lengths)), key=lambda i: -lengths[i])
    batches: list[list[int]] = []
    for index in order:
        if batches:
            current = batches[-1]
            width = lengths[current[0]]
            fits_budget = (len(current) + 1) * width <= max_tokens
            padding = width - lengths[index]
            little_padding = padding <= max(MAX_PADDING_FRACTION * width, MICRO_BATCH_OVERHEAD_TOKENS)
            if fits_budget and little_padding:
                current.append(index)
                continue
        batches.append([index])
    return batches


def _publish_directory(staging: Path, final: Path) -> None:
    """Durably move a fully written directory into place, replacing any previous one."""
    for file in staging.iterdir():
        with open(file, "rb") as handle:
            os.fsync(handle.fileno())
    _fsync_dir(staging)
    retired: Path | None = None
    if final.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.rename(final, retired / final.name)
    os.rename(staging, final)
    _fsync_dir(final.parent)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)


def _fsync_dir(path: Path) -> None:
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)
