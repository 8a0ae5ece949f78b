"""scripts/gpu_check.sh on a machine without a usable GPU: it refuses at once with one line and its own
exit code (3: no CUDA device, 4: a GPU that .venv's torch cannot use), before anything slow and without
writing under bench/. Each run uses a copy of the script in an empty tree (it works from the tree it sits
in), so the check cannot touch the repository's bench/ however it fails.

This machine has no GPU: the device a GPU machine would show is stood in for by a small `nvidia-smi`
that answers as the real one does (its no-driver message and exit status, or its `-L` line of a GPU)."""

from __future__ import annotations

import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.process

SCRIPT = Path(__file__).resolve().parents[2] / "scripts" / "gpu_check.sh"
BASH = shutil.which("bash") or "/bin/bash"
REFUSAL_SECONDS = 10  # a refusal is instant; this leaves room for a busy machine's torch import
NO_DRIVER = (
    "NVIDIA-SMI has failed because it couldn't communicate with the NVIDIA driver. "
    "Make sure that the latest NVIDIA driver is installed and running."
)


def tree(tmp_path: Path) -> Path:
    """An empty tree holding the script and an empty bench/."""
    root = tmp_path / "checkout"
    (root / "scripts").mkdir(parents=True)
    (root / "bench").mkdir()
    shutil.copy2(SCRIPT, root / "scripts" / "gpu_check.sh")
    return root


def nvidia_smi(tmp_path: Path, body: str) -> Path:
    """A directory holding an `nvidia-smi` that runs `body`."""
    directory = tmp_path / "nvidia-bin"
    directory.mkdir()
    tool = directory / "nvidia-smi"
    tool.write_text(f"#!{BASH}\n{body}\n")
    tool.chmod(0o755)
    return directory


def files_in(root: Path) -> set[str]:
    """Every path in the tree, not following links (the test's .venv link)."""
    found: set[str] = set()
    for directory, names, files in os.walk(root):
        found.update(str(Path(directory, name).relative_to(root)) for name in names + files)
    return found


def run_check(root: Path, path: str, *args: str) -> tuple[subprocess.CompletedProcess[str], float, set[str]]:
    """Run the copied script with this PATH: what it printed, how long it took, the paths it added."""
    before = files_in(root)
    started = time.monotonic()
    run = subprocess.run(
        [BASH, str(root / "scripts" / "gpu_check.sh"), *args],
        cwd=root,
        env={**os.environ, "PATH": path},
        capture_output=True,
        text=True,
        timeout=60,
    )
    return run, time.monotonic() - started, files_in(root) - before


def refusal_lines(checked: tuple[subprocess.CompletedProcess[str], float, set[str]], code: int) -> list[str]:
    """Asserts a refusal with `code` in seconds that wrote nothing; returns what it printed (stderr)."""
    run, seconds, added = checked
    assert run.returncode == code, run.stderr
    assert run.stdout == ""
    assert seconds < REFUSAL_SECONDS
    assert added == set()
    return run.stderr.splitlines()


def refusal(code: int, reason: str) -> str:
    return f'gpu_check: refused: {reason} (exit {code}; docs/devices.md, "Checking on a GPU")'


def test_without_nvidia_smi_it_refuses_at_once(tmp_path: Path) -> None:
    root = tree(tmp_path)
    empty = tmp_path / "no-tools"
    empty.mkdir()
    # Only bash builtins run before the refusal: a PATH with nothing on it is enough.
    assert refusal_lines(run_check(root, str(empty)), 3) == [
        refusal(3, "no CUDA device on this machine (nvidia-smi is not installed)")
    ]


def test_with_nvidia_smi_but_no_driver_it_refuses_at_once(tmp_path: Path) -> None:
    root = tree(tmp_path)
    tools = nvidia_smi(tmp_path, f'echo "{NO_DRIVER}"; exit 9')
    assert refusal_lines(run_check(root, str(tools)), 3) == [
        refusal(3, f"no CUDA device on this machine (nvidia-smi -L: {NO_DRIVER})")
    ]


@pytest.mark.skipif(torch.version.cuda is not None, reason="this test's torch is a CUDA build")
def test_a_gpu_with_a_cpu_build_of_torch_is_refused_before_any_test(tmp_path: Path) -> None:
    root = tree(tmp_path)
    (root / ".venv").symlink_to(sys.prefix)  # the torch of this test run: a CPU build here
    tools = nvidia_smi(tmp_path, 'echo "GPU 0: NVIDIA H100 80GB HBM3 (UUID: GPU-0)"')
    lines = refusal_lines(run_check(root, f"{tools}:{os.environ['PATH']}", "--no-setup"), 4)
    reason = (
        f"the GPU is here but .venv's torch cannot use it (torch {torch.__version__} in .venv is a CPU "
        "build: torch.cuda.is_available() is False); install a CUDA build of torch"
    )
    assert lines[-1] == refusal(4, reason)
    assert len(lines) == 2 and lines[0].endswith("] torch: can it use the GPU?")  # its progress line
