"""verifiers' training client (verifiers 0.4.0's `TrainClient`, unmodified, as prime-rl runs it) rolls out
through /inference/v1/generate of a real `tinkerrpc serve --sidecar-port` with a sidecar key, and the
token ids and logprobs it keeps train token-exact through the SDK.

verifiers pins openai<3 and mcp==2.0.0, which the suite's .venv is past, so it runs in its own venv
(made here once, kept in .venv/verifiers-0.4.0 and removed with .venv) and its rollouts in their own
process (verifiers_flow.py), which prints them as JSON.
"""

from __future__ import annotations

import fcntl
import json
import os
import shutil
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest

import tinkerrpc
from tinkerrpc_server.local.stack import LocalStack
from tinkerrpc_server.settings import SIDECAR_API_KEY_ENV

pytestmark = pytest.mark.ecosystem

# The two packages whose code runs the client: verifiers' TrainClient and the renderers client it calls.
REQUIREMENTS = ("verifiers==0.4.0", "renderers==0.1.12")
VENV = Path(__file__).resolve().parents[2] / ".venv" / "verifiers-0.4.0"
FLOW = Path(__file__).with_name("verifiers_flow.py")
SIDECAR_KEY = "sk-verifiers-test"
# ~1 minute on 2 cores from the registry; the flow itself takes seconds.
INSTALL_TIMEOUT_S = 600
FLOW_TIMEOUT_S = 300
SEEDS = (1, 2)


def _run(*command: str | Path, timeout: float, env: dict[str, str] | None = None) -> str:
    done = subprocess.run([str(c) for c in command], capture_output=True, text=True, timeout=timeout, env=env)
    assert done.returncode == 0, f"{command[:4]} failed:\n{done.stdout[-3000:]}\n{done.stderr[-3000:]}"
    return done.stdout


@pytest.fixture(scope="module")
def verifiers_python() -> Path:
    """The Python of verifiers' own venv, installed from the registry on first use; a lock keeps two
    test runs from building it at once, and a stamp written last marks it complete."""
    python = VENV / "bin" / "python"
    stamp = VENV / ".tinkerrpc-installed"
    wanted = " ".join(REQUIREMENTS)
    VENV.parent.mkdir(exist_ok=True)
    with open(VENV.parent / "verifiers-venv.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if python.exists() and stamp.is_file() and stamp.read_text() == wanted:
            return python
        shutil.rmtree(VENV, ignore_errors=True)
        _run(sys.executable, "-m", "venv", VENV, timeout=INSTALL_TIMEOUT_S)
        _run(python, "-m", "pip", "install", "-q", *REQUIREMENTS, timeout=INSTALL_TIMEOUT_S)
        stamp.write_text(wanted)
    return python


@pytest.fixture(scope="module")
def hosted(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    """`tinkerrpc serve --sidecar-port` with a sidecar key; the built-in tiny model it lays out in the
    Hugging Face cache is where verifiers' renderer loads the tokenizer from, by name."""
    work = tmp_path_factory.mktemp("verifiers")
    env = {SIDECAR_API_KEY_ENV: SIDECAR_KEY}
    with LocalStack(work / "data", work / "serve.log", (), 180, env, with_sidecar=True) as stack:
        yield stack


def run_flow(python: Path, sidecar_url: str, model: str) -> dict[str, Any]:
    env = {**os.environ, "SIDECAR_KEY": SIDECAR_KEY, "HF_HUB_OFFLINE": "1", "TRANSFORMERS_VERBOSITY": "error"}
    out = _run(python, FLOW, sidecar_url, model, *map(str, SEEDS), timeout=FLOW_TIMEOUT_S, env=env)
    result: dict[str, Any] = json.loads(out.strip().splitlines()[-1])
    return result


def test_verifiers_train_client_rollouts_train_token_exact(
    hosted: LocalStack, verifiers_python: Path
) -> None:
    assert hosted.sidecar_url is not None
    client = tinkerrpc.Client(hosted.target)
    model = client.create_model("verifiers", base_model="tinkerrpc/tiny-chat", lora_rank=8)
    result = run_flow(verifiers_python, hosted.sidecar_url, "verifiers@0")
    max_tokens = result["max_tokens"]
    # renderers' overflow check read the pinned version's context from GET /v1/models, under the key.
    assert result["max_prompt_len"] == model.info().max_context_length > 0

    rollouts = result["rollouts"]
    assert len(rollouts) == len(SEEDS) and all(len(turns) == 2 for turns in rollouts)
    for seed, turns in zip(SEEDS, rollouts, strict=True):
        for turn in turns:
            prompt, completion, logprobs = (
                turn["prompt_ids"],
                turn["completion_ids"],
                turn["completion_logprobs"],
            )
            assert 1 <= len(completion) <= max_tokens and len(logprobs) == len(completion)
            assert turn["usage"] == [len(prompt), len(completion)]
            assert turn["request_id"].startswith("gen-")
            assert turn["finish_reason"] in ("stop", "length")
            # verifiers sent its seed and sampling on: the Sample RPC draws the same tokens from the same
            # prompt, with the same logprobs (to float32 rounding: two calls need not batch alike).
            (sample,) = model.sample(
                prompt, max_tokens=max_tokens, temperature=1.0, seed=seed, policy_version=0
            )
            assert completion == list(sample.tokens)
            assert logprobs == pytest.approx(sample.logprobs, abs=1e-5)
        # The second turn's prompt holds the first exchange: a multi-turn rollout, rendered by verifiers.
        assert len(turns[1]["prompt_ids"]) > len(turns[0]["prompt_ids"]) + 1

    # What verifiers keeps is what trains: each turn's tokens and its own logprobs, nothing re-scored.
    trajectories = [
        tinkerrpc.Trajectory(
            turns=[
                tinkerrpc.SampledTurn(t["prompt_ids"], t["completion_ids"], t["completion_logprobs"], 0)
                for t in turns
            ],
            reward=float(index),
        )
        for index, turns in enumerate(rollouts)
    ]
    trained = model.train([tinkerrpc.TrajectoryGroup(trajectories)], learning_rate=1e-3)
    assert trained.policy_version == 1 and trained.metrics.trajectories_used == len(SEEDS)
    assert trained.metrics.scored_tokens == 0
    assert trained.metrics.trained_tokens == sum(
        len(t["completion_ids"]) for turns in rollouts for t in turns
    )
    assert model.info().policy_version == 1
    client.close()
