"""Training passes: a batch of datums through the active adapter in micro-batches of similar length,
their per-token learner logprobs and the loss's gradients accumulated into the adapter.

A datum's `target_tokens` are one per position (`[N]`), or K per position (`[N, K]`, soft targets) for a
loss that takes them (the contract's `Loss.soft_targets`); its other loss inputs have the same shape, and
so do the logprobs it gets back."""

from __future__ import annotations

import math
from dataclasses import dataclass

import numpy as np
import torch

from tinkerrpc.contract.limits import MAX_ENGINE_SOFT_TARGETS
from tinkerrpc_server.engine.compute.adapters import AdaptedModel
from tinkerrpc_server.engine.compute.decoder import FusedTrainingForward
from tinkerrpc_server.engine.compute.errors import EngineUserError
from tinkerrpc_server.engine.compute.heap import returns_freed_memory
from tinkerrpc_server.engine.compute.unembedding import saved_logits_positions, target_logprobs
from tinkerrpc_server.engine.losses import LOSSES, resolve_config

# Padded tokens per micro-batch; bounds activation memory while keeping batches large. At a wide
# vocabulary the logits kept for backward bound it lower (unembedding.saved_logits_positions).
MICRO_BATCH_TOKENS = 8192
# A datum joins the current micro-batch if padding it wastes at most this share of the batch
# width, or at most the fixed cost of one more forward/backward (in token equivalents): short sequences
# are cheaper padded together than run as separate micro-batches. Padding costs attention (and its
# scatter) only, no matmul (decoder.FusedTrainingForward), yet one batch of all of 16-128 tokens was
# still ~10% slower than two here.
MAX_PADDING_FRACTION = 0.25
MICRO_BATCH_OVERHEAD_TOKENS = 64


@dataclass
class DatumArrays:
    input_tokens: np.ndarray
    loss_fn_inputs: dict[str, np.ndarray]


@dataclass
class ForwardResult:
    logprobs: list[np.ndarray]
    metrics: dict[str, float]


class Training(AdaptedModel):
    """Forward and backward passes of datums through an adapter."""

    @returns_freed_memory  # a step's activations: GBs, transient
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
        self, model: torch.nn.Module, forward: FusedTrainingForward | None, batch: list[PreparedDatum]
    ) -> list[torch.Tensor]:
        """Right-padded forward of one micro-batch (through `forward` when the model has one, else
        transformers); the learner logprob of every target token, in its datum's target shape (the logits
        of padding positions are never computed). Datums with fewer targets per position than the batch's
        most are padded with token 0, whose logprobs are dropped and so get no gradient."""
        width = max(len(item.tokens) for item in batch)
        most_targets = max(item.targets_per_position for item in batch)
        tokens = torch.zeros((len(batch), width), dtype=torch.long, device=self.device)
        targets = torch.zeros((len(batch), width, most_targets), dtype=torch.long, device=self.device)
        mask = torch.zeros_like(tokens)
        for row, item in enumerate(batch):
            n = len(item.tokens)
            tokens[row, :n] = item.tokens
            targets[row, :n, : item.targets_per_position] = item.targets.reshape(n, -1)
            mask[row, :n] = 1
        lp = target_logprobs(
            model, tokens, mask, targets[mask.bool()], forward.hidden_states if forward is not None else None
        )
        ends = np.cumsum([len(item.tokens) for item in batch]).tolist()
        return [
            lp[end - len(item.tokens) : end, : item.targets_per_position].reshape(item.targets.shape)
            for item, end in zip(batch, ends, strict=True)
        ]

    def _validate_batch(
        self, data: list[DatumArrays], loss_fn: str, loss_fn_config: dict[str, float] | None
    ) -> tuple[dict[str, float], list[PreparedDatum]]:
        if loss_fn not in LOSSES:
            raise EngineUserError(f"unknown loss_fn {loss_fn!r}; expected one of {', '.join(LOSSES)}")
        try:
            config = resolve_config(loss_fn, loss_fn_config)
        except ValueError as error:
            raise EngineUserError(str(error)) from None
        if not data:
            raise EngineUserError("data is empty: forward_backward needs at least one datum")
        spec = LOSSES[loss_fn]
        required = {"target_tokens", *spec.float_inputs}
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
            target_shape = np.asarray(datum.loss_fn_inputs["target_tokens"]).shape
            self._check_target_shape(target_shape, len(tokens), loss_fn, spec.soft_targets, where)
            for key, values in datum.loss_fn_inputs.items():
                if np.asarray(values).shape != target_shape:
                    raise EngineUserError(
                        f"{where}: loss_fn_inputs[{key!r}] has shape {list(np.asarray(values).shape)}, "
                        f"target_tokens has {list(target_shape)}"
                    )
            targets = self._check_tokens(
                np.asarray(datum.loss_fn_inputs["target_tokens"]).reshape(-1), f"{where} target"
            ).reshape(target_shape)
            inputs = {}
            for key in spec.float_inputs:
                values = np.asarray(datum.loss_fn_inputs[key], dtype=np.float64)
                if not np.all(np.isfinite(values)):
                    raise EngineUserError(f"{where}: loss_fn_inputs[{key!r}] has non-finite values")
                inputs[key] = torch.tensor(values, dtype=torch.float32, device=self.device)
            check = spec.check_inputs
            if check is not None and (problem := check(datum.loss_fn_inputs)):
                raise EngineUserError(f"{where}: {problem}")
            prepared.append(
                PreparedDatum(
                    torch.tensor(tokens, dtype=torch.long, device=self.device),
                    torch.tensor(targets, dtype=torch.long, device=self.device),
                    inputs,
                )
            )
        return config, prepared

    @staticmethod
    def _check_target_shape(
        shape: tuple[int, ...], positions: int, loss_fn: str, soft_targets: bool, where: str
    ) -> None:
        """`[N]`, or `[N, K]` with K in [1, MAX_ENGINE_SOFT_TARGETS] for a loss that takes soft targets."""
        if len(shape) == 2 and soft_targets:
            if shape[0] == positions and 1 <= shape[1] <= MAX_ENGINE_SOFT_TARGETS:
                return
            raise EngineUserError(
                f"{where}: loss_fn_inputs['target_tokens'] has shape {list(shape)}; soft targets are "
                f"[N, K] with N = {positions} (the model_input's tokens) and K in [1, {MAX_ENGINE_SOFT_TARGETS}]"
            )
        if shape == (positions,):
            return
        soft = [name for name, loss in LOSSES.items() if loss.soft_targets]
        raise EngineUserError(
            f"{where}: loss_fn_inputs['target_tokens'] has shape {list(shape)}, model_input has {positions} "
            f"tokens: give [{positions}]"
            + (
                f" ({loss_fn} takes one target per position; [N, K] soft targets are for {', '.join(soft)})"
                if len(shape) == 2
                else ""
            )
        )


@dataclass
class PreparedDatum:
    tokens: torch.Tensor
    targets: torch.Tensor  # [N], or [N, K] soft targets
    inputs: dict[str, torch.Tensor]

    @property
    def targets_per_position(self) -> int:
        return 1 if self.targets.dim() == 1 else int(self.targets.shape[1])


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
