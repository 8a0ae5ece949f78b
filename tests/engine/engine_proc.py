"""Start a real engine process on 127.0.0.1 (shared by the engine test modules)."""

from __future__ import annotations

import os
from collections.abc import Iterator
from pathlib import Path

import pytest
from smollm2_support import smollm2_model_dir

from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.model_store import TINY_CHAT

TINY = TINY_CHAT


def start_engine(data_dir: Path, model_dir: Path, log_path: Path) -> LocalEngine:
    return LocalEngine(data_dir, model_dir, log_path, startup_timeout=90.0).start()


def smollm2_engine(tmp_path_factory: pytest.TempPathFactory, tag: str) -> Iterator[LocalEngine]:
    """A module's engine on SmolLM2 (a fixture's body: it yields the running engine, then stops it)."""
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    work = tmp_path_factory.mktemp(tag)
    running = start_engine(work / "data", smollm2_model_dir(tmp_path_factory), work / "engine.log")
    yield running
    assert running.stop() == 0, running.log()[-3000:]


def seq_gaps(engine: LocalEngine, model_id: str) -> list[str]:
    """The engine's log lines of a seq_id that never arrived for `model_id`: the compute worker ran a
    later request only after waiting out its gap timeout. A request the engine rejects or refuses keeps
    its turn, so a test of that expects none, whatever the machine's speed."""
    return [
        line
        for line in engine.log().splitlines()
        if f"model {model_id}: seq " in line and "never arrived" in line
    ]
