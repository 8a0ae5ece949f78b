"""The SDK stays fully typed (its import isolation is checked in tests/foundation/test_packaging.py)."""

from __future__ import annotations

import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]


def test_mypy_strict_is_clean_on_the_sdk() -> None:
    out = subprocess.run(
        [sys.executable, "-m", "mypy", "--strict", "client/tinkerrpc"],
        cwd=ROOT,
        capture_output=True,
        text=True,
    )
    assert out.returncode == 0, out.stdout + out.stderr
