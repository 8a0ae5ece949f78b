"""Merged multi-turn datums train exactly as one datum per turn: the same reported loss (`loss:sum`), the
same learner logprobs on every sampled token and the same LoRA gradients, for every loss whose turns merge
(importance sampling with and without normalize_std, PPO, CISPO; cross-entropy for supervised examples).
The datums of datums.rl_batch / sft_batch go straight into the engine's runtime, on twin adapters.

Tolerance: the two forms differ only in float32 summation order (longer sequences, other micro-batches
and thread scheduling of CPU reductions): the loss, a sum over ~50 sampled tokens whose terms cancel
across the group, agrees to 1e-4 absolute (seen: at most 6e-6), and every entry of each gradient tensor
to within 1e-4 of that tensor's largest entry (seen: at most 1.2e-6). A misplaced span or advantage
moves both by orders of magnitude more.
"""

from __future__ import annotations

import itertools
from dataclasses import dataclass
from pathlib import Path
from typing import cast

import numpy as np
import pytest
import tinker
import torch
from svc import TINY

from tinkerrpc.v1 import trainer_service_pb2 as pb
from tinkerrpc.v1 import types_pb2
from tinkerrpc_server.engine.runtime import BaseModelRuntime, DatumArrays, LoraSpec
from tinkerrpc_server.model_store import resolve_base_model
from tinkerrpc_server.service.datums import rl_batch, sft_batch
from tinkerrpc_server.service.rendering import ChatCodec, ChatCodecs

pytestmark = pytest.mark.unit

VERSION = 2
LOSS_TOLERANCE = 1e-4
GRAD_TOLERANCE = 1e-4
REWARDS = [1.0, 0.0, 0.25]
TURNS = 3
COMPLETION = 6
TOOL_RESULT = 5
# Added to the learner's own logprobs to make the sampler's: ratios r = exp(lp − q) below, inside and
# above the clip range, so that PPO's and CISPO's clipping matters.
LOGPROB_OFFSETS = [-0.5, 0.3, -0.05, 0.15, 0.6, -0.6, 0.02]
CLIP = {"clip_low_threshold": 0.9, "clip_high_threshold": 1.1}
LOSSES = {
    "importance_sampling": types_pb2.LOSS_FUNCTION_IMPORTANCE_SAMPLING,
    "ppo": types_pb2.LOSS_FUNCTION_PPO,
    "cispo": types_pb2.LOSS_FUNCTION_CISPO,
}
_ids = itertools.count()


@pytest.fixture(scope="module")
def codec(service_model_dir: Path) -> ChatCodec:
    return ChatCodecs(service_model_dir, allow_remote_tokenizers=False).get(TINY)


@pytest.fixture(scope="module")
def runtime(service_model_dir: Path) -> BaseModelRuntime:
    return BaseModelRuntime(resolve_base_model(TINY, service_model_dir), device="cpu")


def _arrays(datum: tinker.types.Datum) -> DatumArrays:
    inputs = {
        name: np.asarray(tensor.data, dtype=np.int64 if name == "target_tokens" else np.float32)
        for name, tensor in datum.loss_fn_inputs.items()
    }
    return DatumArrays(np.asarray(datum.model_input.to_ints(), dtype=np.int64), inputs)


@dataclass
class Step:
    loss: float
    logprobs: list[np.ndarray]  # per datum, every target position
    grads: dict[str, torch.Tensor]


def _step(runtime: BaseModelRuntime, datums: list[tinker.types.Datum], loss_fn: str) -> Step:
    """forward_backward on a fresh adapter with non-zero lora_B (so every factor gets a gradient)."""
    model_id = f"merged-{next(_ids)}"
    runtime.create_adapter(model_id, LoraSpec(rank=4, seed=7))
    generator = torch.Generator().manual_seed(3)
    with torch.no_grad():
        for param in runtime.adapter_parameters(model_id).values():
            param.copy_(torch.randn(param.shape, generator=generator) * 0.05)
    config = CLIP if loss_fn in ("ppo", "cispo") else None
    result = runtime.forward_backward(model_id, [_arrays(d) for d in datums], loss_fn, config, backward=True)
    grads = {
        name: cast(torch.Tensor, p.grad).clone() for name, p in runtime.adapter_parameters(model_id).items()
    }
    runtime.delete_adapter(model_id)
    return Step(result.metrics["loss:sum"], result.logprobs, grads)


def _trained(datums: list[tinker.types.Datum], logprobs: list[np.ndarray], column: str) -> list[float]:
    """The learner logprobs of the positions that carry loss, in datum order (turn order)."""
    out: list[float] = []
    for datum, lp in zip(datums, logprobs, strict=True):
        out += [float(v) for v, w in zip(lp, datum.loss_fn_inputs[column].data, strict=True) if w != 0]
    return out


def _assert_same_training(merged: Step, separate: Step) -> None:
    assert merged.loss == pytest.approx(separate.loss, abs=LOSS_TOLERANCE)
    assert merged.grads.keys() == separate.grads.keys()
    for name, grad in merged.grads.items():
        scale = float(separate.grads[name].abs().max())
        torch.testing.assert_close(
            grad,
            separate.grads[name],
            atol=GRAD_TOLERANCE * scale,
            rtol=0.0,
            msg=lambda m, name=name: f"{name}: {m}",
        )
    assert any(bool(g.abs().max() > 1e-4) for g in merged.grads.values()), "the step must move something"


def _tool_conversation(
    codec: ChatCodec, rng: np.random.Generator, broken_at: int | None
) -> list[tuple[list[int], list[int]]]:
    """Per turn, prompt then completion: each prompt is the previous turn's prompt and completion, then a
    tool result and the next assistant header (random tokens). At `broken_at` the prompt drops the
    previous completion, as a renderer that strips earlier thinking does."""
    prompt = list(
        codec.renderer.build_generation_prompt([{"role": "user", "content": "use the tool"}]).to_ints()
    )
    turns: list[tuple[list[int], list[int]]] = []
    for k in range(TURNS):
        completion = rng.integers(10, codec.tokenizer.vocab_size, COMPLETION).tolist()
        turns.append((prompt, completion))
        between = rng.integers(10, codec.tokenizer.vocab_size, TOOL_RESULT).tolist()
        prompt = prompt + ([] if k + 1 == broken_at else completion) + between
    return turns


def _request(codec: ChatCodec, runtime: BaseModelRuntime, broken_at: int | None) -> pb.TrainRequest:
    """A group of trajectories of TURNS tool-using turns; the last one's prompts break at `broken_at`.
    The sampler logprobs are the base model's own plus LOGPROB_OFFSETS."""
    rng = np.random.default_rng(11)
    request = pb.TrainRequest(model="m")
    group = request.groups.add()
    for t, reward in enumerate(REWARDS):
        trajectory = group.trajectories.add(reward=reward)
        last = t == len(REWARDS) - 1
        for prompt, completion in _tool_conversation(codec, rng, broken_at if last else None):
            trajectory.turns.add(
                prompt_token_ids=prompt,
                completion_token_ids=completion,
                completion_logprobs=[0.0] * len(completion),  # replaced below
                policy_version=VERSION,
            )
    per_turn = rl_batch(request, VERSION, codec, merge_turns=False)
    probe = runtime.forward_backward(
        _base_adapter(runtime), [_arrays(d) for d in per_turn.datums], "importance_sampling", None, False
    )
    turns = [turn for trajectory in group.trajectories for turn in trajectory.turns]
    for i, (turn, lp) in enumerate(zip(turns, probe.logprobs, strict=True)):
        own = lp[len(turn.prompt_token_ids) - 1 :]
        offsets = np.resize(np.roll(LOGPROB_OFFSETS, i), len(own))
        turn.completion_logprobs[:] = (own + offsets).tolist()
    return request


def _base_adapter(runtime: BaseModelRuntime) -> str:
    if not runtime.has_adapter("merged-probe"):
        runtime.create_adapter("merged-probe", LoraSpec(rank=4, seed=7))
    return "merged-probe"


@pytest.mark.parametrize(
    ("loss_fn", "normalize_std"),
    [("importance_sampling", False), ("importance_sampling", True), ("ppo", False), ("cispo", False)],
)
def test_merged_turns_train_exactly_as_one_datum_per_turn(
    codec: ChatCodec, runtime: BaseModelRuntime, loss_fn: str, normalize_std: bool
) -> None:
    request = _request(codec, runtime, broken_at=None)
    request.loss.function = LOSSES[loss_fn]
    request.advantages.normalize_std = normalize_std

    merged_batch = rl_batch(request, VERSION, codec)
    separate_batch = rl_batch(request, VERSION, codec, merge_turns=False)

    assert len(merged_batch.datums) == len(REWARDS) and len(separate_batch.datums) == len(REWARDS) * TURNS
    assert merged_batch.trained_tokens == separate_batch.trained_tokens
    assert merged_batch.total_tokens < separate_batch.total_tokens / 2
    merged = _step(runtime, merged_batch.datums, loss_fn)
    separate = _step(runtime, separate_batch.datums, loss_fn)
    _assert_same_training(merged, separate)
    np.testing.assert_allclose(
        _trained(merged_batch.datums, merged.logprobs, "advantages"),
        _trained(separate_batch.datums, separate.logprobs, "advantages"),
        atol=1e-5,
    )


def test_a_prompt_that_drops_the_previous_completion_breaks_the_merge_and_still_trains_the_same(
    codec: ChatCodec, runtime: BaseModelRuntime
) -> None:
    """The last trajectory's turn 2 prompt lacks turn 1's completion: turn 1 is a datum of its own and
    turns 2–3 merge (4 datums in all); the step equals the per-turn one."""
    request = _request(codec, runtime, broken_at=1)
    request.loss.function = types_pb2.LOSS_FUNCTION_PPO

    merged_batch = rl_batch(request, VERSION, codec)
    separate_batch = rl_batch(request, VERSION, codec, merge_turns=False)

    assert len(merged_batch.datums) == len(REWARDS) + 1
    broken = request.groups[0].trajectories[-1].turns
    assert (
        merged_batch.datums[-2].model_input.to_ints()
        == (list(broken[0].prompt_token_ids) + list(broken[0].completion_token_ids))[:-1]
    )
    _assert_same_training(
        _step(runtime, merged_batch.datums, "ppo"), _step(runtime, separate_batch.datums, "ppo")
    )


def test_dro_could_not_merge_its_drift_term_counts_the_shared_history_once_per_turn(
    codec: ChatCodec, runtime: BaseModelRuntime
) -> None:
    """Why DRO keeps one datum per turn: the same merged datums, trained with DRO, give another loss."""
    request = _request(codec, runtime, broken_at=None)
    merged = rl_batch(request, VERSION, codec).datums
    separate = rl_batch(request, VERSION, codec, merge_turns=False).datums
    arrays = [[_arrays(d) for d in datums] for datums in (merged, separate)]
    adapter = _base_adapter(runtime)
    losses = [
        runtime.forward_backward(adapter, data, "dro", {"beta": 0.5}, backward=False).metrics["loss:sum"]
        for data in arrays
    ]
    assert abs(losses[0] - losses[1]) > 1.0

    request.loss.function = types_pb2.LOSS_FUNCTION_DRO
    assert len(rl_batch(request, VERSION, codec).datums) == len(separate)


class _ContinuingExamples:
    """A codec whose renderer makes one example per assistant message, each the conversation up to it
    and training that message only (a renderer without the extension property). With `strip_at`, the
    example for that message renders the history before it differently, so it continues nothing."""

    max_context_length = 4096

    def __init__(self, rng: np.random.Generator, strip_at: int | None) -> None:
        self.examples: list[tuple[list[int], list[float]]] = []
        tokens: list[int] = []
        for k in range(TURNS):
            context = rng.integers(10, 400, TOOL_RESULT).tolist()
            message = rng.integers(10, 400, COMPLETION).tolist()
            history = [5, *tokens[1:]] if k == strip_at else tokens
            self.examples.append(
                (history + context + message, [0.0] * len(history + context) + [1.0] * len(message))
            )
            tokens = tokens + context + message

    def supervised_examples(self, *_: object) -> list[tuple[list[int], list[float]]]:
        return self.examples


@pytest.mark.parametrize("strip_at", [None, 2])
def test_supervised_examples_that_continue_one_another_train_as_one_datum(
    runtime: BaseModelRuntime, strip_at: int | None
) -> None:
    codec = cast(ChatCodec, _ContinuingExamples(np.random.default_rng(4), strip_at))
    request = pb.TrainRequest(model="m")
    request.examples.add(messages=[types_pb2.Message(role=types_pb2.ROLE_USER, content="x")])

    merged_batch = sft_batch(request, codec)
    separate_batch = sft_batch(request, codec, merge_turns=False)

    assert len(merged_batch.datums) == (1 if strip_at is None else 2) and len(separate_batch.datums) == TURNS
    assert merged_batch.trained_tokens == separate_batch.trained_tokens == TURNS * COMPLETION
    _assert_same_training(
        _step(runtime, merged_batch.datums, "cross_entropy"),
        _step(runtime, separate_batch.datums, "cross_entropy"),
    )
