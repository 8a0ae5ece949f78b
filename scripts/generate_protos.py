"""Regenerate client/tinkerrpc/v1 from protos/ (messages, gRPC stubs and their .pyi stubs).

Usage: python scripts/generate_protos.py [--out DIR]   (DIR defaults to client/)
The drift test calls this with a temporary --out and compares the result with the committed files.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
PROTO_ROOT = ROOT / "protos"


def _plugins() -> dict[str, Path]:
    """mypy-protobuf's two plugins, taken from the interpreter's own environment (never from PATH, which
    need not contain an unactivated venv's bin/)."""
    bin_dir = Path(sys.executable).parent
    plugins = {name: bin_dir / name for name in ("protoc-gen-mypy", "protoc-gen-mypy_grpc")}
    missing = [name for name, path in plugins.items() if not path.exists()]
    if missing:
        sys.exit(f"{', '.join(missing)} not found in {bin_dir}: pip install -e '.[dev]'")
    return plugins


def generate(out_root: Path) -> list[Path]:
    """Write generated files for every proto under protos/ into out_root; return their paths."""
    import grpc_tools
    from grpc_tools import protoc

    protos = sorted(str(p.relative_to(PROTO_ROOT)) for p in PROTO_ROOT.rglob("*.proto"))
    well_known = Path(grpc_tools.__file__).parent / "_proto"
    package_dir = out_root / "tinkerrpc" / "v1"
    if package_dir.exists():
        for old in package_dir.glob("*_pb2*"):
            old.unlink()
    package_dir.mkdir(parents=True, exist_ok=True)
    args = [
        "grpc_tools.protoc",
        *(f"--plugin={name}={path}" for name, path in _plugins().items()),
        f"-I{PROTO_ROOT}",
        f"-I{well_known}",
        f"--python_out={out_root}",
        f"--grpc_python_out={out_root}",
        f"--mypy_out={out_root}",
        f"--mypy_grpc_out={out_root}",
        *protos,
    ]
    if protoc.main(args) != 0:
        raise SystemExit("protoc failed")
    init = package_dir / "__init__.py"
    init.write_text('"""Generated protobuf and gRPC code for tinkerrpc.v1 (do not edit)."""\n')
    return sorted(p for p in package_dir.iterdir() if p.is_file())


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__)
    parser.add_argument("--out", type=Path, default=ROOT / "client")
    args = parser.parse_args()
    for path in generate(args.out):
        print(path.relative_to(args.out))


if __name__ == "__main__":
    main()
