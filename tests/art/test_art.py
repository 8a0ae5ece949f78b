"""ART's own code through tinkerrpc.art against `tinkerrpc serve --sidecar-port`, and ART's own
TinkerNativeBackend (the seed, unmodified) against `tinkerrpc engine` (art_flows.py).

The flows run in their own process: `import art` patches transformers' attention-mask preprocessing
in its process (art/transformers/patches.py, with a signature transformers 5 does not call it with),
so a test that loads a transformers model in the pytest process would break once art were imported
there. The server is separate either way.
"""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

from tinkerrpc_server.local.stack import LocalEngine, LocalStack

pytestmark = pytest.mark.ecosystem

FLOWS = Path(__file__).with_name("art_flows.py")
TARGET_REWARD = 0.9
MAX_RL_STEPS = 30
# Below the 24-example warm-up of the sft-split flow, above any 4 of its examples.
SMALL_TRAIN_TOKENS = 300


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("art")
    args = ("--model-dir", str(tmp / "models"))
    with LocalStack(tmp / "data", tmp / "serve.log", args, 240, with_sidecar=True) as running:
        yield running


@pytest.fixture(scope="module")
def engine(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalEngine]:
    tmp = tmp_path_factory.mktemp("art-engine")
    with pytest.MonkeyPatch.context() as patch:
        # The engine lays the built-in models out in this hub cache; the seed's tokenizer loads from it.
        patch.setenv("HF_HUB_CACHE", str(tmp / "hf-hub"))
        running = LocalEngine(tmp / "data", tmp / "models", tmp / "engine.log", startup_timeout=240.0)
    with running:
        yield running


def run_flow(name: str, art_path: Path, *args: str, env: dict[str, str] | None = None) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(FLOWS), name, str(art_path), *args],
        capture_output=True,
        text=True,
        timeout=540,
        env=env,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_art_yes_no_maybe_reaches_the_target_reward(stack: LocalStack, tmp_path: Path) -> None:
    result = run_flow("yes-no-maybe", tmp_path / ".art", stack.target)
    rewards = result["rewards"]
    assert rewards[-1] >= TARGET_REWARD, rewards
    assert rewards[-1] > rewards[0], rewards
    assert result["inference_base_url"] == f"{stack.sidecar_url}/v1", "the hosted sidecar"


def test_art_sft_past_the_servers_tokens_per_train_goes_as_smaller_trains(
    tmp_path_factory: pytest.TempPathFactory,
) -> None:
    tmp = tmp_path_factory.mktemp("art-small-trains")
    args = ("--model-dir", str(tmp / "models"), "--max-train-tokens", str(SMALL_TRAIN_TOKENS))
    with LocalStack(tmp / "data", tmp / "serve.log", args, 240, with_sidecar=True) as small:
        result = run_flow("sft-split", tmp / ".art", small.target)
    assert result["trains"] > 1, result


def test_art_sft_batches_train_as_the_minibatches_of_one_version(stack: LocalStack, tmp_path: Path) -> None:
    """tinkerrpc.art trains ART's SFT batches, each at its scheduled rate, as one Train's minibatches."""
    assert run_flow("sft-schedule", tmp_path / ".art", stack.target)["minibatches"] == 6


def test_art_register_is_get_or_create_and_choices_without_logprobs_carry_their_sample_key(
    stack: LocalStack, tmp_path: Path
) -> None:
    """After the test above: registering again gets its model (another shape is refused), a Choice
    without logprobs carries the sample key of the sidecar's own logprobs, a flat group takes no step, and ART's
    delete_checkpoints leaves the latest version's files only."""
    assert run_flow("reregister", tmp_path / ".art", stack.target)["step"] > 0


def test_art_training_past_a_restore_replaces_the_discarded_timeline_s_checkpoint(
    stack: LocalStack, tmp_path: Path
) -> None:
    """A model restored to an earlier version trains to a version whose art-step state the restore
    discarded: the step succeeds and its state replaces the old one (the flow checks the listing)."""
    assert run_flow("retrain-after-restore", tmp_path / ".art", stack.target)["step"] == 2


def test_art_tinker_native_backend_on_the_engine_reaches_the_target_reward(
    engine: LocalEngine, tmp_path: Path
) -> None:
    """ART's TinkerNativeBackend, unmodified, told of the engine by TINKER_BASE_URL / TINKER_API_KEY only:
    it registers, resumes from the state its raw training client warmed up, serves ART's rollouts from its
    own OpenAI server and trains to the target; the checkpoints it recorded are the engine's list, and
    the ones deleted through the tinker SDK leave that list (the flow checks both)."""
    result = run_flow("seed-yes-no-maybe", tmp_path / ".art", env=engine.sdk_user_env())
    rewards = result["rewards"]
    assert rewards[-1] >= TARGET_REWARD, rewards
    assert rewards[-1] > rewards[0], rewards
    assert len(result["train_seconds"]) <= MAX_RL_STEPS
    assert result["seconds_to_target"] is not None
    assert result["inference_base_url"] != engine.base_url, "the backend's own OpenAI server"
    assert result["deleted"] >= len(result["train_seconds"]), "every sampler but the current step's"
