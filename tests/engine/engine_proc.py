"""Start a real engine process on 127.0.0.1 (shared by the engine test modules)."""

from __future__ import annotations

from pathlib import Path

from tinkerrpc_server.local.stack import LocalEngine
from tinkerrpc_server.model_store import TINY_CHAT

TINY = TINY_CHAT


def start_engine(data_dir: Path, model_dir: Path, log_path: Path) -> LocalEngine:
    return LocalEngine(data_dir, model_dir, log_path, startup_timeout=90.0).start()
