"""The CPU kernels on CPUs with less than this one's vector width: a process whose torch runs its AVX2 code
(ATEN_CPU_CAPABILITY=avx2, as on an AVX2 CPU without AVX-512) builds the kernels' AVX2 panel matmul and it
multiplies as a plain matmul does, each row as it would alone; one on torch's portable code (no AVX2) builds the kernels without the
panel matmul, and the engine packs with another kernel there."""

from __future__ import annotations

import json
import os
import subprocess
import sys

import pytest
import torch

pytestmark = pytest.mark.process

# Run in a child process: the vector width is torch's choice at start, and the kernels build for it.
_CHILD = """
import json
import torch
from tinkerrpc_server.engine.compute import cpu_kernels
from tinkerrpc_server.engine.compute.packing import packing_plan
from tinkerrpc_server.settings import Settings

loaded = cpu_kernels.load(Settings.from_environment().kernels)
panels = loaded and cpu_kernels.has_packed_linear()
worst, invariant = 0.0, True
generator = torch.Generator().manual_seed(0)
with torch.inference_mode():
    if panels:
        for rows in range(1, 18):
            for in_features, out_features in ((37, 50), (576, 960)):
                weight = torch.randn(out_features, in_features, generator=generator)
                x = torch.randn(rows, in_features, generator=generator)
                packed = cpu_kernels.pack_linear_weight(weight)
                product = cpu_kernels.packed_linear(x, packed, out_features)
                error = (product - x @ weight.t()).abs()
                worst = max(worst, float((error / (1e-4 + 1e-5 * (x @ weight.t()).abs())).max()))
                invariant = invariant and torch.equal(product[-1:], cpu_kernels.packed_linear(x[-1:], packed, out_features))
    x = torch.randn(3, 37, generator=generator)
    weight = torch.randn(37, generator=generator)
    expected = weight * torch.nn.functional.rms_norm(x, (37,), eps=1e-6)
    norm_error = float((cpu_kernels.residual_rms_norm(x, None, weight, 1e-6) - expected).abs().max())
    plan = packing_plan(panels)
print(json.dumps({
    "capability": torch.backends.cpu.get_cpu_capability(),
    "loaded": loaded,
    "panels": panels,
    "worst": worst,
    "invariant": invariant,
    "norm_error": norm_error,
    "packing": plan.kernel if plan is not None else None,
}))
"""


def _run_child(capability: str) -> dict[str, object]:
    env = {**os.environ, "ATEN_CPU_CAPABILITY": capability}
    done = subprocess.run(
        [sys.executable, "-c", _CHILD], env=env, capture_output=True, text=True, timeout=900, check=True
    )
    result: dict[str, object] = json.loads(done.stdout.strip().splitlines()[-1])
    return result


def test_the_avx2_panel_matmul_multiplies_as_a_matmul() -> None:
    if torch.backends.cpu.get_cpu_capability() not in ("AVX2", "AVX512"):
        pytest.skip("this CPU runs no AVX2 code")
    result = _run_child("avx2")
    assert result["capability"] == "AVX2"
    assert result["loaded"] and result["panels"]
    assert isinstance(result["worst"], float) and result["worst"] <= 1.0  # within rtol 1e-5, atol 1e-4
    assert result["invariant"]  # a row's product alone equals its product among others, bit for bit
    assert isinstance(result["norm_error"], float) and result["norm_error"] <= 1e-5


def test_without_avx2_the_kernels_load_without_the_panel_matmul() -> None:
    result = _run_child("default")
    assert result["capability"] == "DEFAULT"
    assert result["loaded"] and not result["panels"]
    assert isinstance(result["norm_error"], float) and result["norm_error"] <= 1e-5
    assert result["packing"] != "panels"
