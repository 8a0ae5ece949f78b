"""Start a real engine process on 127.0.0.1 (shared by the engine test modules)."""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path

import httpx
import tinker

from procs import Proc, free_port, tinkerrpc_cmd

TINY = "tinkerrpc/tiny-chat"


@dataclass
class EngineProc:
    proc: Proc
    base_url: str
    data_dir: Path
    model_dir: Path

    def service_client(self) -> tinker.ServiceClient:
        return tinker.ServiceClient(base_url=self.base_url, api_key="tml-local")

    def stats(self) -> dict[str, int]:
        return dict(httpx.get(f"{self.base_url}/api/v1/debug/stats", timeout=10).json())


def start_engine(data_dir: Path, model_dir: Path, log_path: Path) -> EngineProc:
    port = free_port()
    cmd = tinkerrpc_cmd(
        "engine", "--host", "127.0.0.1", "--port", str(port), "--data-dir", str(data_dir),
        "--model-dir", str(model_dir),
    )  # fmt: skip
    proc = Proc(cmd, log_path)
    base_url = f"http://127.0.0.1:{port}"
    proc.wait_ready(lambda: httpx.get(f"{base_url}/api/v1/healthz", timeout=2).status_code == 200)
    return EngineProc(proc, base_url, data_dir, model_dir)
