"""The light client install (`pip install tinkerrpc`, no extras), simulated by an import blocker: the
server extra's and openai's packages fail to import, as they would when absent."""

from __future__ import annotations

import subprocess
import sys
import textwrap
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

BLOCKER = textwrap.dedent(
    """
    import importlib.abc, sys
    BLOCKED = {"tinker", "tinker_cookbook", "torch", "transformers", "peft", "fastapi", "uvicorn",
               "httpx", "safetensors", "tokenizers", "numpy", "grpc_reflection", "grpc_status",
               "prometheus_client", "openai"}

    class Absent(importlib.abc.MetaPathFinder):
        def find_spec(self, name, path=None, target=None):
            if name.split(".")[0] in BLOCKED:
                raise ModuleNotFoundError(f"No module named {name!r}", name=name)
            return None

    sys.meta_path.insert(0, Absent())
    """
)


def run_light(code: str, *args: str) -> subprocess.CompletedProcess[str]:
    return subprocess.run(
        [sys.executable, "-c", BLOCKER + textwrap.dedent(code), *args],
        capture_output=True,
        text=True,
        timeout=120,
    )


def test_serve_without_the_server_extra_names_the_extra(tmp_path: Path) -> None:
    done = run_light(
        "from tinkerrpc_server.cli import main\nsys.exit(main(sys.argv[1:]))\n",
        "serve",
        "--data-dir",
        str(tmp_path),
    )
    assert done.returncode == 1
    assert "pip install 'tinkerrpc[server]'" in done.stderr
    assert "Traceback" not in done.stderr
    assert list(tmp_path.iterdir()) == []


def test_openai_client_without_openai_names_the_extra() -> None:
    done = run_light(
        """
        import tinkerrpc
        client = tinkerrpc.Client("127.0.0.1:1", check_health=False)
        try:
            client.model("m").openai_client(sidecar_url="http://127.0.0.1:1/v1")
        except ImportError as err:
            print(err)
        """
    )
    assert done.returncode == 0, done.stderr
    assert "pip install 'tinkerrpc[openai]'" in done.stdout


def test_the_examples_shared_module_imports_with_the_client_install() -> None:
    """The examples talk to a running server with the client alone: what they share (the toy task from
    the yes / no / maybe task, the model name) imports without the server extra's packages."""
    examples = Path(__file__).resolve().parents[2] / "examples"
    done = run_light(
        f"sys.path.insert(0, {str(examples)!r})\nimport example_support\nprint(example_support.TASKS)\n"
    )
    assert done.returncode == 0, done.stderr
    assert "'respond with maybe': 'maybe'" in done.stdout
