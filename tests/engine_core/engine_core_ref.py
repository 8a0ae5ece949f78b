"""Independent plain-torch references for the engine core tests.

LoRA is re-implemented here with forward hooks on a freshly loaded transformers model (no peft),
and the losses are re-derived from Tinker's definitions, so agreement means the engine is right.
"""

from __future__ import annotations

from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

import numpy as np
import torch
from transformers import AutoModelForCausalLM

from tinkerrpc_server.engine.runtime import BaseModelRuntime, DatumArrays


def load_plain_model(path: Path) -> torch.nn.Module:
    model = AutoModelForCausalLM.from_pretrained(path, dtype=torch.float32)
    model.eval()
    for param in model.parameters():
        param.requires_grad_(False)
    return model


def lora_leaves(runtime: BaseModelRuntime, model_id: str) -> dict[str, torch.Tensor]:
    """Detached copies of an adapter's factors that the reference differentiates against."""
    return {
        name: param.detach().clone().requires_grad_(True)
        for name, param in runtime.adapter_parameters(model_id).items()
    }


@contextmanager
def hand_lora(
    model: torch.nn.Module, factors: dict[str, torch.Tensor], scaling: float = 1.0
) -> Iterator[None]:
    """Add x·Aᵀ·Bᵀ·scaling to every adapted Linear's output (PEFT's LoRA, by hand)."""
    modules = dict(model.named_modules())
    handles = []
    for name, a_factor in factors.items():
        if ".lora_A." not in name:
            continue
        module_path = name.removeprefix("base_model.model.").removesuffix(".lora_A.weight")
        b_factor = factors[name.replace(".lora_A.", ".lora_B.")]

        def hook(
            module: torch.nn.Module,
            args: tuple[torch.Tensor, ...],
            output: torch.Tensor,
            a: torch.Tensor = a_factor,
            b: torch.Tensor = b_factor,
        ) -> torch.Tensor:
            return output + (args[0] @ a.T @ b.T) * scaling

        handles.append(modules[module_path].register_forward_hook(hook))
    try:
        yield
    finally:
        for handle in handles:
            handle.remove()


def reference_logprobs(model: torch.nn.Module, datum: DatumArrays) -> torch.Tensor:
    """Learner logprob of each target token, one unpadded sequence at a time."""
    tokens = torch.tensor(datum.input_tokens, dtype=torch.long).unsqueeze(0)
    targets = torch.tensor(datum.loss_fn_inputs["target_tokens"], dtype=torch.long)
    logits = model(input_ids=tokens).logits[0].float()
    return torch.log_softmax(logits, dim=-1)[torch.arange(len(targets)), targets]


def reference_loss(
    loss_fn: str, lp: torch.Tensor, datum: DatumArrays, config: dict[str, float]
) -> torch.Tensor:
    """Tinker's per-token losses, summed, written out token by token."""
    inputs = {
        k: torch.tensor(np.asarray(v, dtype=np.float64)).float() for k, v in datum.loss_fn_inputs.items()
    }
    terms = []
    for t in range(len(lp)):
        if loss_fn == "cross_entropy":
            terms.append(-lp[t] * inputs["weights"][t])
            continue
        q, adv = inputs["logprobs"][t], inputs["advantages"][t]
        ratio = torch.exp(lp[t] - q)
        low, high = config.get("clip_low_threshold", 0.8), config.get("clip_high_threshold", 1.2)
        if loss_fn == "importance_sampling":
            terms.append(-ratio * adv)
        elif loss_fn == "ppo":
            clipped = ratio.clamp(low, high)
            terms.append(-torch.minimum(ratio * adv, clipped * adv))
        elif loss_fn == "cispo":
            terms.append(-ratio.detach().clamp(low, high) * lp[t] * adv)
        elif loss_fn == "dro":
            terms.append(-(lp[t] * adv - 0.5 * config["beta"] * (lp[t] - q) ** 2))
        else:
            raise AssertionError(loss_fn)
    return torch.stack(terms).sum()
