"""Sidecar processes for the tests: the real FastAPI app under uvicorn on 127.0.0.1."""

from __future__ import annotations

import sys
from pathlib import Path

import httpx

from procs import Proc, free_port

API_KEY = "sk-sidecar-test"


class Sidecar:
    def __init__(self, proc: Proc, port: int) -> None:
        self.proc = proc
        self.base_url = f"http://127.0.0.1:{port}"

    @property
    def openai_base_url(self) -> str:
        return f"{self.base_url}/v1"

    def metrics(self) -> str:
        return httpx.get(f"{self.base_url}/metrics", timeout=10).text


def start_sidecar(grpc_target: str, log_path: Path, api_key: str | None = API_KEY) -> Sidecar:
    port = free_port()
    # The key travels in the environment, not argv, so it never shows in process listings.
    code = (
        "import os, sys; from tinkerrpc_server.sidecar.app import run_sidecar; "
        f"run_sidecar({grpc_target!r}, '127.0.0.1', {port}, os.environ.get('SIDECAR_API_KEY') or None)"
    )
    proc = Proc([sys.executable, "-c", code], log_path, env={"SIDECAR_API_KEY": api_key or ""})
    sidecar = Sidecar(proc, port)
    proc.wait_ready(
        lambda: httpx.get(f"{sidecar.base_url}/metrics", timeout=1).status_code == 200, timeout=60
    )
    return sidecar
