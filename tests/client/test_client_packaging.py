"""The SDK stays a light, fully typed client."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]


def test_import_pulls_no_server_or_heavy_packages() -> None:
    code = (
        "import sys, tinkerrpc\n"
        "heavy = ('torch', 'tinker', 'tinker_cookbook', 'fastapi', 'transformers', 'numpy', 'tqdm', 'openai')\n"
        "print(','.join(sorted(m for m in heavy if m in sys.modules)))\n"
        "print(len(tinkerrpc.__all__), all(hasattr(tinkerrpc, n) for n in tinkerrpc.__all__))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, exported = out.stdout.splitlines()
    assert loaded == ""
    assert exported.endswith(" True")


def test_mypy_strict_is_clean_on_the_sdk() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "client/tinkerrpc"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
