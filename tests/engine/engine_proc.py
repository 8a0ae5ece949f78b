"""Start a real engine process on 127.0.0.1 (shared by the engine test modules)."""

from __future__ import annotations

from pathlib import Path

from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.model_store import TINY_CHAT

TINY = TINY_CHAT


def start_engine(data_dir: Path, model_dir: Path, log_path: Path) -> LocalEngine:
    return LocalEngine(data_dir, model_dir, log_path, startup_timeout=90.0).start()


def seq_gaps(engine: LocalEngine, model_id: str) -> list[str]:
    """The engine's log lines of a seq_id that never arrived for `model_id`: the compute worker ran a
    later request only after waiting out its gap timeout. A request the engine rejects or refuses keeps
    its turn, so a test of that expects none, whatever the machine's speed."""
    return [
        line
        for line in engine.log().splitlines()
        if f"model {model_id}: seq " in line and "never arrived" in line
    ]
