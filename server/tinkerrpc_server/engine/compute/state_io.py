"""An adapter's state on disk: its PEFT config and LoRA weights, its LoRA spec (with its optimizer family),
and optionally its optimizer state, written to a staging directory and published in one rename; and
adapters loaded back from one."""

from __future__ import annotations

import json
import os
import shutil
import tempfile
from concurrent.futures import ThreadPoolExecutor
from dataclasses import asdict, replace
from pathlib import Path

import torch
from peft import LoraConfig, set_peft_model_state_dict
from safetensors.torch import load_file, save_file

from tinkerrpc_server.engine.compute.adapters import (
    ATTN_MODULES,
    MLP_MODULES,
    UNEMBED_MODULES,
    AdaptedModel,
    Adapter,
    LoraSpec,
)
from tinkerrpc_server.engine.compute.errors import EngineUserError
from tinkerrpc_server.engine.compute.optimizer_families import ADAMW
from tinkerrpc_server.engine.storage import fsync_path

ADAPTER_CONFIG_FILE = "adapter_config.json"
ADAPTER_WEIGHTS_FILE = "adapter_model.safetensors"
LORA_SPEC_FILE = "tinkerrpc_lora.json"
OPTIMIZER_FILE = "optimizer.safetensors"
OPTIMIZER_META_FILE = "optimizer.json"
# A checkpoint directory holds at most 5 files.
_SYNCING = ThreadPoolExecutor(max_workers=6, thread_name_prefix="fsync")


class StateIO(AdaptedModel):
    """Adapters saved to and loaded from directories."""

    def save_state(self, model_id: str, directory: Path, include_optimizer: bool) -> None:
        adapter = self._require_adapter(model_id)
        assert self._peft is not None
        directory = Path(directory)
        directory.parent.mkdir(parents=True, exist_ok=True)
        staging = Path(tempfile.mkdtemp(prefix=f".{directory.name}.tmp-", dir=directory.parent))
        try:
            self._peft.peft_config[adapter.peft_name].save_pretrained(str(staging))
            # Only the LoRA factors go into the file (the base lm_head stays in the base model), under the
            # adapter-free names PEFT writes: the adapter's own parameters. PEFT's get_peft_model_state_dict
            # finds them by walking the whole model's state_dict, which took as long as a tiny-chat
            # forward_backward (test_training checks the file against it).
            save_file(
                {k: v.detach().cpu().contiguous() for k, v in adapter.params.items()},
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

    def _save_optimizer(self, adapter: Adapter, directory: Path) -> None:
        """Every state tensor of every parameter ("<name>.<key>": AdamW's exp_avg and exp_avg_sq,
        Dimuon's momentum_buffer) and each parameter's step count; the family that wrote them is the LoRA
        spec's (LORA_SPEC_FILE)."""
        tensors: dict[str, torch.Tensor] = {}
        steps: dict[str, float] = {}
        for name, param in adapter.params.items():
            state = adapter.optimizer.state.get(param)
            if not state:
                continue
            for key, value in state.items():
                if key != "step":
                    tensors[f"{name}.{key}"] = value.detach().cpu().contiguous()
            steps[name] = float(state["step"])
        save_file(tensors, str(directory / OPTIMIZER_FILE))
        (directory / OPTIMIZER_META_FILE).write_text(json.dumps({"steps": steps}))

    def load_state(
        self, model_id: str, directory: Path, include_optimizer: bool, optimizer: str | None = None
    ) -> LoraSpec:
        """Load the adapter at `directory` as `model_id` (replacing it if live). It trains with the optimizer
        family of its optimizer state if loaded, else of the live model, else `optimizer` (None: AdamW, the
        SDK's default), from a fresh state; an `optimizer` that is not that family is refused."""
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
        live = self._adapters.get(model_id)
        fixed = live.spec.optimizer if live is not None else None
        if include_optimizer:
            saved = spec.optimizer
            if fixed not in (None, saved) or optimizer not in (None, saved):
                raise EngineUserError(
                    f"optimizer_config: the optimizer state of {directory.name} is {saved!r}; it cannot be "
                    f"loaded as {fixed or optimizer!r}"
                )
            optimizer = saved
        elif fixed is not None:
            if optimizer not in (None, fixed):
                raise EngineUserError(
                    f"optimizer_config: model {model_id} trains with {fixed!r}; a load keeps it"
                )
            optimizer = fixed
        spec = replace(spec, optimizer=optimizer or ADAMW)
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

    def _overwrite_peft_adapter(self, peft_name: str, directory: Path, config: LoraConfig) -> bool:
        """Copy the LoRA weights saved in `directory` over those of the loaded adapter `peft_name` where
        both have one layout (the same LoRA config but for where it was saved from, the same tensors by
        name and shape); whether it did. A new adapter costs PEFT a walk of the model per adapted module:
        0.3-0.5 s on SmolLM2, more with every adapter loaded."""
        assert self._peft is not None
        if _layout(self._peft.peft_config[peft_name]) != _layout(config):
            return False
        params = self._peft_parameters(peft_name)
        weights = load_file(str(directory / ADAPTER_WEIGHTS_FILE), device=str(self.device))
        if weights.keys() != params.keys() or any(weights[k].shape != p.shape for k, p in params.items()):
            return False
        with torch.no_grad():
            for name, param in params.items():
                param.copy_(weights[name])
        return True

    def _load_optimizer(self, adapter: Adapter, directory: Path) -> None:
        tensors = load_file(str(directory / OPTIMIZER_FILE), device=str(self.device))
        steps = json.loads((directory / OPTIMIZER_META_FILE).read_text())["steps"]
        for name, param in adapter.params.items():
            if name not in steps:
                continue
            state: dict[str, torch.Tensor] = {"step": torch.tensor(float(steps[name]), dtype=torch.float32)}
            prefix = f"{name}."
            for key, value in tensors.items():
                if key.startswith(prefix) and "." not in key[len(prefix) :]:
                    state[key[len(prefix) :]] = value.to(param.dtype)
            adapter.optimizer.state[param] = state


def saved_optimizer(directory: Path) -> str:
    """The optimizer family of the run that saved the checkpoint at `directory` (AdamW where its LoRA spec
    names none: saved before families, or a plain PEFT adapter)."""
    spec_file = directory / LORA_SPEC_FILE
    family: str = json.loads(spec_file.read_text()).get("optimizer", ADAMW) if spec_file.is_file() else ADAMW
    return family


def _layout(config: LoraConfig) -> dict[str, object]:
    """What of a LoRA config shapes the adapter PEFT builds from it (all of it but where it came from)."""
    fields: dict[str, object] = dict(config.to_dict())  # type: ignore[no-untyped-call]
    for provenance in ("base_model_name_or_path", "revision", "inference_mode"):
        fields.pop(provenance, None)
    return fields


def _publish_directory(staging: Path, final: Path) -> None:
    """Durably move a fully written directory into place, replacing any previous one."""
    # Its files and its entries synced at once: the file system commits them together, where one after
    # another each waits for a journal commit of its own (5 small files on this machine's disk, under
    # load: 15 ms one by one, 2.8 ms at once; medians of 15).
    list(_SYNCING.map(fsync_path, [*staging.iterdir(), staging]))
    retired: Path | None = None
    if final.exists():
        retired = Path(tempfile.mkdtemp(prefix=f".{final.name}.old-", dir=final.parent))
        os.rename(final, retired / final.name)
    os.rename(staging, final)
    fsync_path(final.parent)
    if retired is not None:
        shutil.rmtree(retired, ignore_errors=True)
