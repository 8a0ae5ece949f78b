"""ART's own code through tinkerrpc.art against `tinkerrpc serve --sidecar-port` (art_flows.py).

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

from tinkerrpc_server.local.stack import LocalStack

FLOWS = Path(__file__).with_name("art_flows.py")
TARGET_REWARD = 0.9


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("art")
    args = ("--model-dir", str(tmp / "models"))
    with LocalStack(tmp / "data", tmp / "serve.log", args, 240, with_sidecar=True) as running:
        yield running


def run_flow(name: str, stack: LocalStack, art_path: Path) -> dict[str, Any]:
    done = subprocess.run(
        [sys.executable, str(FLOWS), name, stack.target, str(art_path)],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result: dict[str, Any] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_art_yes_no_maybe_reaches_the_target_reward(stack: LocalStack, tmp_path: Path) -> None:
    result = run_flow("yes-no-maybe", stack, tmp_path / ".art")
    rewards = result["rewards"]
    assert rewards[-1] >= TARGET_REWARD, rewards
    assert rewards[-1] > rewards[0], rewards
    assert result["inference_base_url"] == f"{stack.sidecar_url}/v1", "the hosted sidecar"


def test_art_register_is_get_or_create_and_choices_without_logprobs_carry_their_sample_key(
    stack: LocalStack, tmp_path: Path
) -> None:
    """After the test above: registering again gets its model (another shape is refused), a Choice
    without logprobs carries the sample key of the sidecar's own logprobs, a flat group takes no step, and ART's
    delete_checkpoints leaves the latest version's files only."""
    assert run_flow("reregister", stack, tmp_path / ".art")["step"] > 0
