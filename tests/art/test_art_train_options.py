"""Every train() keyword ART's callers pass (tinkerrpc/art/_train_options.py), row by row: implemented,
of no effect, or refused by name at any value that would change what trains; never a TypeError.

The module imports nothing of ART; it is loaded from its file so that this test does not `import art`
(which patches transformers in its process, see test_art.py)."""

from __future__ import annotations

import importlib.util
import sys
from pathlib import Path
from types import ModuleType
from typing import Any

import pytest

import tinkerrpc

pytestmark = pytest.mark.unit


def _load() -> ModuleType:
    path = Path(tinkerrpc.__file__).parent / "art" / "_train_options.py"
    spec = importlib.util.spec_from_file_location("art_train_options_under_test", path)
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    sys.modules[spec.name] = module  # dataclasses look their module up there
    spec.loader.exec_module(module)
    return module


OPTIONS = _load()
# What PipelineTrainer passes on every step (art/pipeline_trainer/trainer.py, 0.5.23).
PIPELINE: dict[str, Any] = {
    "optimizer_save_interval": 5,
    "grad_accumulation_sequences": None,
    "kl_penalty_coef": 0.0,
    "kl_penalty_reference_step": None,
    "kl_penalty_source": "sample",
}


def resolve(trajectories: int = 8, **changes: Any) -> Any:
    own = ("scale_rewards", "truncated_importance_sampling")
    named = {k: changes.pop(k) for k in list(changes) if k in PIPELINE or k in own}
    arguments = {**PIPELINE, "scale_rewards": True, "truncated_importance_sampling": None, **named}
    return OPTIONS.resolve_train_options(
        trajectories=trajectories, normalize_advantages=True, others=changes, **arguments
    )


def test_pipeline_trainers_arguments_are_taken_and_implemented() -> None:
    assert "art" not in sys.modules, "loaded without importing ART"
    options = resolve()
    assert options.normalize_std and options.optimizer_save_interval == 5
    assert [v for v in range(1, 16) if options.saves_state_at(v)] == [5, 10, 15]
    assert not resolve(optimizer_save_interval=None).saves_state_at(5)
    assert not resolve(scale_rewards=False).normalize_std
    # One optimizer step per call: an accumulation covering the batch changes nothing.
    assert resolve(8, grad_accumulation_sequences=8).optimizer_save_interval == 5
    assert options.kl_penalty is None and options.importance_ratio_cap is None


def test_kl_penalty_and_truncated_importance_sampling_become_the_sdks_options() -> None:
    # PipelineTrainer: the reference is the version kl_penalty_step_lag behind (0 without a lag).
    lagged = resolve(kl_penalty_coef=0.1, kl_penalty_reference_step=3).kl_penalty
    assert lagged == tinkerrpc.KLPenalty(0.1, tinkerrpc.PolicyRef.version(3))
    # ART's Tinker backend without a reference step: the base model (KLPenalty's default).
    assert resolve(kl_penalty_coef=0.1).kl_penalty == tinkerrpc.KLPenalty(0.1)
    # PipelineTrainer without a lag sends step 0, ART's identity/base reference: the base model too, not
    # version 0, which the server prunes (ART 0.5.23's PipelineTrainer with a KL coefficient failed its
    # first step after a 20-step warm-up: "no sampleable version 0").
    assert resolve(kl_penalty_coef=0.1, kl_penalty_reference_step=0).kl_penalty == tinkerrpc.KLPenalty(0.1)
    assert resolve(truncated_importance_sampling=2.0).importance_ratio_cap == 2.0


@pytest.mark.parametrize(
    ("changes", "named"),
    [
        ({"grad_accumulation_sequences": 7}, "grad_accumulation_sequences=7"),
        ({"grad_accumulation_sequences": True}, "grad_accumulation_sequences"),
        ({"optimizer_save_interval": 0}, "optimizer_save_interval"),
        ({"optimizer_save_interval": 2.5}, "optimizer_save_interval"),
        ({"kl_penalty_coef": -1.0}, "coefficient"),
        ({"kl_penalty_coef": True}, "kl_penalty_coef"),
        ({"kl_penalty_source": "current_learner"}, "kl_penalty_source='current_learner'"),
        ({"kl_penalty_reference_step": -1}, "kl_penalty_reference_step"),
    ],
)
def test_values_this_backend_cannot_honour_are_refused_by_name(changes: dict[str, Any], named: str) -> None:
    with pytest.raises(ValueError, match=named):
        resolve(**changes)


def test_every_local_backend_knob_is_neutral_or_of_no_effect() -> None:
    neutral = {name: value for name, (value, _) in OPTIONS.NEUTRAL_ONLY.items()}
    odd = {name: object() for name in OPTIONS.NO_EFFECT}
    assert resolve(**neutral, **odd).normalize_std
    for name, (value, why) in OPTIONS.NEUTRAL_ONLY.items():
        other = "sequence" if isinstance(value, str) else 0.5
        with pytest.raises(ValueError, match=f"{name}={other!r} is not supported") as caught:
            resolve(**{name: other})
        assert why in str(caught.value)


def test_a_keyword_no_art_backend_takes_stays_a_type_error() -> None:
    with pytest.raises(TypeError, match="learning_rat"):
        resolve(learning_rat=1e-5)
