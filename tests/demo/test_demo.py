"""`tinkerrpc demo` end to end: SFT then RL through the client, server and embedded engine."""

from __future__ import annotations

import json
import re
import subprocess
import sys
from pathlib import Path

import pytest

from tinkerrpc_server.recipes.yes_no_maybe.task import prompts as yes_no_maybe_prompts
from tinkerrpc_server.recipes.yes_no_maybe.task import reward_of

pytestmark = pytest.mark.process


def test_prompts_cover_every_ordering() -> None:
    prompts = yes_no_maybe_prompts()
    assert len(prompts) == len(set(prompts)) == 48
    assert "respond with yes, no or maybe" in prompts
    assert "just respond with 'maybe' or 'no'" in prompts


def test_reward_ranks_maybe_no_yes_and_nothing_else() -> None:
    assert [reward_of(r) for r in ("maybe", " No\n", "YES", "yes.", "maybe maybe", "")] == [
        1.0,
        0.75,
        0.5,
        0.0,
        0.0,
        0.0,
    ]


def test_demo_reaches_target_reward(tmp_path: Path) -> None:
    out = tmp_path / "out"
    proc = subprocess.run(
        [sys.executable, "-m", "tinkerrpc_server.cli", "demo", "--recipe", "yes-no-maybe", "--out", str(out)],
        capture_output=True,
        text=True,
        timeout=900,
    )
    assert proc.returncode == 0, proc.stdout[-3000:] + proc.stderr[-3000:]
    summary = json.loads((out / "summary.json").read_text())
    assert summary["passed"] is True
    assert summary["final_mean_reward"] >= 0.9
    assert summary["final_policy_version"] == summary["sft_steps"] + summary["rl_steps"]
    # Every rollout went through the sidecar with the openai client: at least one chat completion of
    # 8 prompts per RL step and per SFT evaluation, each choice at least one token.
    assert summary["chat_completions"] >= 8 * summary["rl_steps"]
    assert summary["completion_tokens"] >= 8 * summary["chat_completions"]
    rl_steps = [s for s in summary["steps"] if s["phase"] == "rl"]
    assert rl_steps, "the RL phase recorded no steps"
    # The policy got better during RL: the first RL batch scores below the final evaluation.
    assert rl_steps[0]["mean_reward"] < summary["final_mean_reward"]
    assert (out / "reward_curve.png").stat().st_size > 1000
    assert "PASSED" in proc.stdout and "rl step" in proc.stdout
    assert re.search(r"live run view: http://127\.0\.0\.1:\d+/runs/demo-", proc.stdout), proc.stdout[:2000]
