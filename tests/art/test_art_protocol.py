"""ART 0.5.20+ (Python 3.12 only: not installable here) through the requests and Backend calls it makes,
recorded from its source in art_0_5_2x_corpus.json and replayed by art_protocol.py against `tinkerrpc
serve --sidecar-port` (in its own process, as test_art.py runs ART 0.5.18's flows): its chat extras are
ignored and named, every train() keyword set PipelineTrainer and LocalBackend callers pass is trained or
refused by name, captured exchanges and Choices train token-exact, and adapter leases pin inference."""

from __future__ import annotations

import json
import subprocess
import sys
from collections.abc import Iterator
from pathlib import Path

import pytest

from tinkerrpc_server.local.stack import LocalStack

pytestmark = pytest.mark.ecosystem

REPLAY = Path(__file__).with_name("art_protocol.py")
CORPUS = json.loads(Path(__file__).with_name("art_0_5_2x_corpus.json").read_text())


@pytest.fixture(scope="module")
def stack(tmp_path_factory: pytest.TempPathFactory) -> Iterator[LocalStack]:
    tmp = tmp_path_factory.mktemp("art-protocol")
    with LocalStack(
        tmp / "data", tmp / "serve.log", ("--model-dir", str(tmp / "models")), 240, with_sidecar=True
    ) as running:
        yield running


def test_art_0_5_2x_corpus_replays_through_the_sidecar_and_backend(stack: LocalStack, tmp_path: Path) -> None:
    done = subprocess.run(
        [sys.executable, str(REPLAY), str(tmp_path / ".art"), stack.target],
        capture_output=True,
        text=True,
        timeout=540,
    )
    assert done.returncode == 0, done.stderr[-4000:]
    result = json.loads(done.stdout.strip().splitlines()[-1])
    calls = result["train_calls"]
    assert [c["label"] for c in calls] == [c["label"] for c in CORPUS["train_calls"]]
    trained = [c for c in calls if "step" in c]
    assert len(trained) == sum(c["expect"] == "trains" for c in CORPUS["train_calls"])
    assert [c["step"] for c in trained] == list(range(1, len(trained) + 1)), "refused calls train nothing"
    assert result["leases"] == {"pinned": 1, "latest": len(trained)}
