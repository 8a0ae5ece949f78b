"""The light client stays light, and the committed generated code matches protos/."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import pytest

pytestmark = pytest.mark.process

ROOT = Path(__file__).resolve().parents[2]


def test_importing_tinkerrpc_pulls_no_heavy_dependencies() -> None:
    code = (
        "import sys, tinkerrpc, tinkerrpc.v1.trainer_service_pb2_grpc\n"
        "heavy = ('torch', 'tinker', 'tinker_cookbook', 'fastapi', 'transformers', 'numpy', 'tqdm', 'openai', 'art')\n"
        "print(','.join(sorted(m for m in heavy if m in sys.modules)))\n"
        "print(len(tinkerrpc.__all__), all(hasattr(tinkerrpc, n) for n in tinkerrpc.__all__))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded, exported = out.stdout.splitlines()
    assert loaded == ""
    assert exported.endswith(" True")


def test_importing_the_contract_imports_nothing_else_of_ours_nor_grpc() -> None:
    """The CLI, the engine and the docs read tinkerrpc.contract: the package's public names load on
    first use, so importing the contract loads it alone, without grpc, protobuf or the SDK's modules."""
    code = (
        "import sys, tinkerrpc.contract\n"
        "print(sorted(m for m in sys.modules if m.split('.')[0] in ('tinkerrpc', 'grpc', 'google')))\n"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, check=True)
    loaded = ast.literal_eval(out.stdout.strip())
    assert "tinkerrpc.contract.limits" in loaded
    assert [m for m in loaded if m != "tinkerrpc" and not m.startswith("tinkerrpc.contract.")] == [
        "tinkerrpc.contract"
    ]


def test_generated_code_matches_protos(tmp_path: Path) -> None:
    subprocess.run(
        [sys.executable, str(ROOT / "scripts" / "generate_protos.py"), "--out", str(tmp_path)],
        check=True,
        capture_output=True,
    )
    committed_dir = ROOT / "client" / "tinkerrpc" / "v1"
    fresh_dir = tmp_path / "tinkerrpc" / "v1"
    fresh = {p.name: p.read_bytes() for p in fresh_dir.iterdir() if p.is_file()}
    committed = {p.name: p.read_bytes() for p in committed_dir.iterdir() if p.is_file()}
    assert sorted(fresh) == sorted(committed), "generated file set differs: run scripts/generate_protos.py"
    stale = [name for name in fresh if fresh[name] != committed[name]]
    assert not stale, f"committed generated code is stale: {stale}; run scripts/generate_protos.py"
