"""SFT at the runtime level: the random tiny model learns to answer with exactly yes / no / maybe.

The qwen3 renderer frames each answer with an empty think block, so about six completion tokens
must become near-certain: measured ~100 steps at lr 1e-2 (140 at 3e-3; 2e-2 is unstable).
"""

from __future__ import annotations

import random
import time
from pathlib import Path

import numpy as np
import pytest
from tinker_cookbook.renderers import get_renderer
from tinker_cookbook.tokenizer_utils import get_tokenizer

from tinkerrpc_server.engine.runtime import BaseModelRuntime, DatumArrays, LoraSpec, SampleJob
from tinkerrpc_server.model_store import ANSWER_WORDS, answer_format_prompt

BATCH = 32
MAX_STEPS = 200
EVAL_EVERY = 10
EVAL_SAMPLES = 64
ADAM = {
    "learning_rate": 1e-2,
    "beta1": 0.9,
    "beta2": 0.95,
    "eps": 1e-8,
    "weight_decay": 0.0,
    "grad_clip_norm": 0.0,
}


@pytest.fixture(scope="module")
def runtime(tiny_model_path: Path) -> BaseModelRuntime:
    return BaseModelRuntime(tiny_model_path, device="cpu")


def answer_of(tokenizer: object, tokens: list[int], stop_reason: str, im_end: int) -> str | None:
    """The answer text if the completion is a well-formed single turn, else None."""
    if stop_reason != "stop" or tokens[-1] != im_end:
        return None
    text: str = tokenizer.decode(tokens[:-1])  # type: ignore[attr-defined]
    return text.replace("<think>", "").replace("</think>", "").strip()


def test_sft_teaches_the_answer_format(
    runtime: BaseModelRuntime, tiny_model_path: Path, tmp_path: Path
) -> None:
    tokenizer = get_tokenizer(str(tiny_model_path))
    renderer = get_renderer("qwen3", tokenizer)
    im_end = tokenizer.convert_tokens_to_ids("<|im_end|>")
    rng = random.Random(0)

    def training_datum() -> DatumArrays:
        messages = [
            {"role": "user", "content": answer_format_prompt(rng)},
            {"role": "assistant", "content": rng.choice(ANSWER_WORDS)},
        ]
        model_input, weights = renderer.build_supervised_example(messages)
        tokens = np.array(model_input.to_ints(), dtype=np.int64)
        weights = np.asarray(weights, dtype=np.float32)
        return DatumArrays(tokens[:-1], {"target_tokens": tokens[1:], "weights": weights[1:]})

    def valid_fraction(step: int) -> float:
        weights_dir = tmp_path / f"sampler-{step}"
        runtime.save_state("sft", weights_dir, include_optimizer=False)
        jobs = [
            SampleJob(
                renderer.build_generation_prompt(
                    [{"role": "user", "content": answer_format_prompt(rng)}]
                ).to_ints(),
                num_samples=1,
                max_tokens=12,
                temperature=1.0,
                seed=step * 1000 + i,
            )
            for i in range(EVAL_SAMPLES)
        ]
        outputs = runtime.sample(weights_dir, jobs)
        answers = [
            answer_of(tokenizer, o.sequences[0].tokens, o.sequences[0].stop_reason, im_end) for o in outputs
        ]
        return sum(a in ANSWER_WORDS for a in answers) / len(answers)

    runtime.create_adapter("sft", LoraSpec(rank=8, seed=0))
    assert valid_fraction(0) < 0.2  # the random model does not already know the format
    started = time.perf_counter()
    history = []
    reached_at = None
    for step in range(1, MAX_STEPS + 1):
        result = runtime.forward_backward(
            "sft", [training_datum() for _ in range(BATCH)], "cross_entropy", None, True
        )
        runtime.optim_step("sft", **ADAM)
        if step % EVAL_EVERY == 0:
            fraction = valid_fraction(step)
            history.append((step, round(result.metrics["loss:sum"], 2), fraction))
            if fraction >= 0.95:
                reached_at = step
                break
    seconds = time.perf_counter() - started
    print(f"\nSFT: {reached_at} steps, {seconds:.1f} s (incl. evals); (step, loss:sum, valid) {history}")
    assert reached_at is not None, f"never reached 95% valid answers: {history}"
