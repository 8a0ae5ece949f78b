"""`python -m bench --device`: a device this machine lacks stops the run at once, before any figure."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from bench.__main__ import main

pytestmark = pytest.mark.unit


@pytest.mark.skipif(torch.cuda.is_available(), reason="this machine has CUDA")
def test_cuda_without_a_gpu_fails_at_once(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "results.json"
    with pytest.raises(SystemExit) as exited:
        main(["--device", "cuda", "--short", "--out", str(out)])
    assert exited.value.code == 2
    assert "no usable CUDA device" in capsys.readouterr().err
    assert not out.exists()
