"""An unusable --data-dir stops `tinkerrpc serve` at start with one readable line and a non-zero exit,
before the engine child starts and before any state is written.

What is tested, and how (tests may run as root, which ignores permission bits):
- a data dir below a regular file (mkdir fails: not a directory), on every machine;
- a read-only data dir: a tmpfs mounted read-only where mounting works (root with CAP_SYS_ADMIN),
  else a chmod 0o500 directory (only meaningful, and only used, when not root);
- a full data dir: a 256 KiB tmpfs filled to the last byte where mounting works, else a server whose
  RLIMIT_FSIZE lets it write at most 1 KiB per file (writes then fail with EFBIG, as on a full disk).
"""

from __future__ import annotations

import os
import resource
import signal
import subprocess
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from tinkerrpc_server.local.stack import tinkerrpc_command

pytestmark = pytest.mark.process

START_TIMEOUT = 120.0


def _mount_tmpfs(path: Path, options: str) -> bool:
    path.mkdir(parents=True, exist_ok=True)
    result = subprocess.run(["mount", "-t", "tmpfs", "-o", options, "tmpfs", str(path)], capture_output=True)
    return result.returncode == 0


def _fill(directory: Path) -> None:
    fd = os.open(directory / "filler", os.O_WRONLY | os.O_CREAT)
    try:
        while os.write(fd, bytes(4096)) > 0:
            pass
    except OSError:
        pass  # full
    finally:
        os.close(fd)


def _limit_file_size() -> None:
    """In the server child: writes past 1 KiB fail with EFBIG instead of killing it with SIGXFSZ."""
    signal.signal(signal.SIGXFSZ, signal.SIG_IGN)
    resource.setrlimit(resource.RLIMIT_FSIZE, (1024, 1024))


@dataclass
class Case:
    name: str
    data_dir: Path
    reason: str
    limit_file_size: bool = False


@pytest.fixture
def cases(tmp_path: Path) -> Iterator[list[Case]]:
    mounts: list[Path] = []
    try:
        yield _make_cases(tmp_path, mounts)
    finally:
        for mount in mounts:
            subprocess.run(["umount", str(mount)], check=True)
        (tmp_path / "read-only").chmod(0o700)


def _make_cases(tmp_path: Path, mounts: list[Path]) -> list[Case]:
    regular_file = tmp_path / "a-file"
    regular_file.write_text("not a directory")
    found = [Case("below a regular file", regular_file / "data", "Not a directory")]

    read_only = tmp_path / "read-only"
    if _mount_tmpfs(read_only, "ro,size=64k"):
        mounts.append(read_only)
        found.append(Case("read-only mount", read_only, "Read-only file system"))
    else:
        assert os.geteuid() != 0, "as root the read-only case needs mount(8)"
        read_only.mkdir(exist_ok=True)
        read_only.chmod(0o500)
        found.append(Case("chmod 0o500", read_only, "Permission denied"))

    full = tmp_path / "full"
    if _mount_tmpfs(full, "size=256k"):
        mounts.append(full)
        _fill(full)
        found.append(Case("full tmpfs", full, "No space left on device"))
    else:
        full.mkdir(exist_ok=True)
        found.append(Case("file size limit", full, "File too large", limit_file_size=True))
    return found


def test_unusable_data_dir_fails_at_start_with_one_line(cases: list[Case], tmp_path: Path) -> None:
    model_dir = tmp_path / "models"
    env = {**os.environ, "TINKER_TELEMETRY": "0"}
    # All at once: each pays the server's import time.
    running = [
        (
            case,
            subprocess.Popen(
                tinkerrpc_command(
                    "serve", "--port", "0", "--data-dir", str(case.data_dir),
                    "--model-dir", str(model_dir),
                ),
                stdout=subprocess.PIPE,
                stderr=subprocess.STDOUT,
                env=env,
                preexec_fn=_limit_file_size if case.limit_file_size else None,
            ),
        )
        for case in cases
    ]  # fmt: skip
    for case, proc in running:
        output, _ = proc.communicate(timeout=START_TIMEOUT)
        text = output.decode(errors="replace")
        lines = [line for line in text.splitlines() if line.strip()]
        assert proc.returncode != 0, f"{case.name}: {text}"
        assert "Traceback" not in text, f"{case.name}: {text}"
        assert len(lines) == 1, f"{case.name}: one line expected:\n{text}"
        assert "cannot start" in lines[0] and str(case.data_dir) in lines[0], lines[0]
        assert case.reason in lines[0], f"{case.name}: {lines[0]}"
        print(f"\n{case.name}: exit {proc.returncode}: {lines[0]}")
    assert not (tmp_path / "a-file" / "data").exists()
