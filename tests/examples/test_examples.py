"""Every example, run as a user would (`python examples/X.py --short --target ...`), against ONE
shared `tinkerrpc serve` and sidecar."""

from __future__ import annotations

import re
import subprocess
import sys
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tinkerrpc_server.local.stack import LocalStack

EXAMPLES = Path(__file__).resolve().parents[2] / "examples"
sys.path.insert(0, str(EXAMPLES))
from example_support import local_sidecar  # noqa: E402

pytestmark = pytest.mark.process

API_KEY = "sk-examples-test"
EXAMPLE_TIMEOUT = 240


@dataclass
class Stack:
    target: str
    sidecar_url: str


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[Stack]:
    work = tmp_path_factory.mktemp("examples")
    server = LocalStack(
        work / "data", work / "serve.log", ("--model-dir", str(work / "models")), startup_timeout=240
    )
    with server, local_sidecar(server.target, work / "sidecar.log", api_key=API_KEY) as sidecar_url:
        yield Stack(server.target, sidecar_url)


def run_example(script: str, *args: str) -> list[str]:
    """Run one example to completion; its stdout lines (the failure message carries all its output)."""
    done = subprocess.run(
        [sys.executable, str(EXAMPLES / script), "--short", *args],
        capture_output=True,
        text=True,
        timeout=EXAMPLE_TIMEOUT,
    )
    assert done.returncode == 0, f"{script} exited {done.returncode}:\n{done.stdout}\n{done.stderr[-3000:]}"
    return done.stdout.splitlines()


def step_versions(lines: list[str]) -> list[int]:
    return [int(m.group(1)) for line in lines if (m := re.match(r"step \d+: .*policy_version=(\d+)", line))]


def test_sft(stack: Stack) -> None:
    lines = run_example("sft.py", "--target", stack.target)
    assert step_versions(lines) == [1, 2]
    assert lines[-1] == "done: policy_version=2"


def test_rl_through_model_sample(stack: Stack) -> None:
    lines = run_example("rl_sample.py", "--target", stack.target)
    assert step_versions(lines) == [1, 2]
    used = [int(m.group(1)) for line in lines if (m := re.search(r"\(used (\d+),", line))]
    assert len(used) == 2 and all(0 < u <= 24 for u in used), (
        "3 prompts x 8 samples, zero-variance groups dropped"
    )
    assert lines[-1] == "done: policy_version=2"


def test_rl_through_the_openai_client_and_sidecar(stack: Stack) -> None:
    lines = run_example(
        "rl_openai_sidecar.py",
        "--target",
        stack.target,
        "--sidecar-url",
        stack.sidecar_url,
        "--api-key",
        API_KEY,
    )
    # Each step's rollouts were sampled by the policy the previous step produced.
    assert [line.split(",")[0].split(": ")[1] for line in lines if line.startswith("step ")] == [
        "sampled at v[0]",
        "sampled at v[1]",
    ]
    assert step_versions(lines) == [1, 2] and lines[-1] == "done: policy_version=2"


def test_checkpoints(stack: Stack) -> None:
    lines = run_example("checkpoints.py", "--target", stack.target)
    text = "\n".join(lines)
    assert "saved 'milestone' at policy_version=1" in text
    assert "pinned=1 -> sampled by v1" in text and "pinned=None -> sampled by v2" in text
    assert "restored 'milestone': policy_version 2 -> 1" in text
    assert "deleted state checkpoint 'step_000002'" in text
    assert "restore of a deleted checkpoint fails: NOT_FOUND" in text
    exported = next(line for line in lines if line.startswith("exported "))
    assert exported.startswith("exported v1: ") and "adapter_model.safetensors" in exported
    assert lines[-1] == "done: policy_version=1"
