"""Figures 1 and 7: LoRA training throughput of the engine (through the tinker SDK) vs a plain
transformers+PEFT loop on padded micro-batches, and the engine's model FLOPs utilisation."""

from __future__ import annotations

import statistics
import time
from collections.abc import Callable

import numpy as np
import tinker
import torch
from peft import LoraConfig, PeftModel, get_peft_model
from tinker import types
from transformers import AutoModelForCausalLM

from bench.machine import synchronize
from bench.report import Figure, rounds
from bench.workload import BenchModel, Settings, baseline_placement, token_sequences
from tinkerrpc_server.local.stack import LocalEngine

# Tinker's LoRA targets with train_mlp, train_attn and train_unembed on (its defaults).
LORA_TARGETS = ["q_proj", "k_proj", "v_proj", "o_proj", "gate_proj", "up_proj", "down_proj", "lm_head"]
ADAM = types.AdamParams(learning_rate=1e-4)
TRAINING_GOAL = 1.5
MFU_GOAL = 0.3


def load_lora_model(model: BenchModel, rank: int) -> PeftModel:
    """The baseline's model: the same base weights with the same (unmerged) LoRA the engine trains, where
    the engine computes (on CUDA: bf16 base, float32 LoRA, like the engine)."""
    device, dtype = baseline_placement()
    base = AutoModelForCausalLM.from_pretrained(model.path, dtype=dtype).to(device)
    base.eval()  # no dropout, as in the engine
    config = LoraConfig(r=rank, lora_alpha=rank, lora_dropout=0.0, target_modules=LORA_TARGETS)
    with torch.random.fork_rng(devices=[]):
        torch.manual_seed(0)
        return get_peft_model(base, config, autocast_adapter_dtype=True).to(device)


def _datum(sequence: np.ndarray) -> types.Datum:
    return types.Datum(
        model_input=types.ModelInput.from_ints(sequence[:-1].tolist()),
        loss_fn_inputs={
            "target_tokens": sequence[1:],
            "weights": np.ones(len(sequence) - 1, dtype=np.float32),
        },
    )


class EngineTrainer:
    """forward_backward + optim_step through the tinker SDK; both submitted before waiting, as Tinker allows."""

    def __init__(self, client: tinker.TrainingClient) -> None:
        self.client = client

    def step(self, sequences: list[np.ndarray]) -> None:
        data = [_datum(s) for s in sequences]
        forward_backward = self.client.forward_backward(data, "cross_entropy")
        optim = self.client.optim_step(ADAM)
        forward_backward.result()
        optim.result()


class PaddedLoopTrainer:
    """What a user writes by hand: micro-batches in data order, right-padded to their longest sequence,
    summed cross-entropy (the engine's loss), gradient accumulation, one AdamW step."""

    def __init__(self, model: PeftModel, micro_batch: int, pad_id: int) -> None:
        self.model = model
        self.micro_batch = micro_batch
        self.pad_id = pad_id
        trainable = [p for p in model.parameters() if p.requires_grad]
        self.optimizer = torch.optim.AdamW(
            trainable, lr=ADAM.learning_rate, betas=(ADAM.beta1, ADAM.beta2), eps=ADAM.eps, weight_decay=0.0
        )

    def step(self, sequences: list[np.ndarray]) -> None:
        for start in range(0, len(sequences), self.micro_batch):
            chunk = sequences[start : start + self.micro_batch]
            width = max(len(s) - 1 for s in chunk)
            inputs = torch.full((len(chunk), width), self.pad_id, dtype=torch.long)
            targets = torch.full((len(chunk), width), -100, dtype=torch.long)
            mask = torch.zeros((len(chunk), width), dtype=torch.long)
            for row, sequence in enumerate(chunk):
                n = len(sequence) - 1
                inputs[row, :n] = torch.from_numpy(sequence[:-1])
                targets[row, :n] = torch.from_numpy(sequence[1:])
                mask[row, :n] = 1
            device = self.model.device
            logits = self.model(
                input_ids=inputs.to(device), attention_mask=mask.to(device), use_cache=False
            ).logits.float()
            loss = torch.nn.functional.cross_entropy(
                logits.reshape(-1, logits.shape[-1]),
                targets.to(device).reshape(-1),
                ignore_index=-100,
                reduction="sum",
            )
            loss.backward()
        self.optimizer.step()
        self.optimizer.zero_grad(set_to_none=True)
        synchronize(self.model.device)


def _timed(step: Callable[[list[np.ndarray]], None], sequences: list[np.ndarray]) -> float:
    started = time.perf_counter()
    step(sequences)
    return time.perf_counter() - started


def measure(
    settings: Settings,
    engine: LocalEngine,
    model: BenchModel,
    measure_peak_matmul: Callable[[], tuple[float, int]],
) -> list[Figure]:
    baseline_model = load_lora_model(model, settings.lora_rank)
    vocab_size = int(baseline_model.get_output_embeddings().weight.shape[0])
    # The weights that multiply activations: the frozen base and the LoRA factors (PEFT's parameters(),
    # a tied matrix once), but not an input embedding of its own (a lookup, no matmul).
    embedding = baseline_model.get_input_embeddings().weight
    unembedding = baseline_model.get_output_embeddings().weight
    params = sum(p.numel() for p in baseline_model.parameters() if p is not embedding or p is unembedding)
    pad_id = int(baseline_model.config.pad_token_id or 0)
    sequences = token_sequences(
        settings.train_sequences,
        settings.train_min_tokens + 1,
        settings.train_max_tokens + 1,
        vocab_size,
        seed=1,
    )
    tokens = sum(len(s) - 1 for s in sequences)
    warmup = sorted(sequences, key=len)[:4]

    service = engine.service_client()
    training_client = service.create_lora_training_client(model.base_model, rank=settings.lora_rank, seed=0)
    ours = EngineTrainer(training_client.result())
    baseline = PaddedLoopTrainer(baseline_model, settings.baseline_micro_batch, pad_id)
    ours.step(warmup)
    baseline.step(warmup)
    measure_peak_matmul()
    # Interleaved, so a change in machine load during the run hits both sides alike.
    ours_seconds, baseline_seconds = [], []
    for _ in range(settings.train_timed_steps):
        ours_seconds.append(_timed(ours.step, sequences))
        baseline_seconds.append(_timed(baseline.step, sequences))
    # Measured before and after the steps: the best of both is the machine's peak during the figure.
    peak_flops, peak_size = measure_peak_matmul()
    ours_rate = tokens / statistics.median(ours_seconds)
    baseline_rate = tokens / statistics.median(baseline_seconds)
    ours_rates = [tokens / seconds for seconds in ours_seconds]
    padded = sum(
        max(len(s) - 1 for s in sequences[i : i + settings.baseline_micro_batch])
        * len(sequences[i : i + settings.baseline_micro_batch])
        for i in range(0, len(sequences), settings.baseline_micro_batch)
    )
    throughput = Figure(
        name="engine training throughput",
        ours=ours_rate,
        baseline=baseline_rate,
        unit="tokens/s",
        goal=TRAINING_GOAL,
        direction=">=",
        rounds=rounds(ours_rates, [tokens / seconds for seconds in baseline_seconds]),
        detail=(
            f"{len(sequences)} sequences, {tokens} tokens ({settings.train_min_tokens}-"
            f"{settings.train_max_tokens} each), LoRA r{settings.lora_rank} attn+mlp+unembed, "
            f"forward_backward + optim_step, median of {settings.train_timed_steps} steps; baseline pads "
            f"micro-batches of {settings.baseline_micro_batch} ({tokens / padded:.0%} of its positions real)"
        ),
    )
    mfu = Figure(
        name="training MFU (6·P·tokens/s ÷ matmul peak)",
        ours=6 * params * ours_rate / 1e9,
        baseline=peak_flops / 1e9,
        unit="GFLOP/s",
        goal=MFU_GOAL,
        direction=">=",
        rounds=rounds([6 * params * rate / 1e9 for rate in ours_rates], [peak_flops / 1e9]),
        detail=(
            f"P = {params / 1e6:.1f} M parameters that multiply activations (frozen base + LoRA; a tied "
            f"embedding once, an untied input embedding not), tokens/s of the engine from the "
            f"throughput figure; peak = fastest fp32 torch.mm of {peak_size}×{peak_size} matrices, "
            f"{torch.get_num_threads()} threads, measured before and after the steps. 6·P counts weight "
            f"gradients for frozen weights too, so it overstates LoRA work (≈ 4·P) by about 1.5×"
        ),
    )
    return [throughput, mfu]
