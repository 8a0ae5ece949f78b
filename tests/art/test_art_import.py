"""tinkerrpc.art is the only part of the client that imports ART, and says how to install it."""

from __future__ import annotations

import subprocess
import sys
import textwrap

import pytest

pytestmark = pytest.mark.ecosystem


def test_tinkerrpc_art_without_art_names_the_extra() -> None:
    code = textwrap.dedent(
        """
        import importlib.abc, sys

        class Absent(importlib.abc.MetaPathFinder):
            def find_spec(self, name, path=None, target=None):
                if name.split(".")[0] == "art":
                    raise ModuleNotFoundError(f"No module named {name!r}", name=name)
                return None

        sys.meta_path.insert(0, Absent())
        import tinkerrpc
        try:
            import tinkerrpc.art
        except ImportError as err:
            print(err)
        """
    )
    done = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120)
    assert done.returncode == 0, done.stderr
    assert done.stdout.strip() == "tinkerrpc.art needs ART: pip install 'tinkerrpc[art]'"
