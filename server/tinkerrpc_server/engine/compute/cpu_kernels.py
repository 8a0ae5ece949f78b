"""The sampler's fused CPU kernels (cpu_kernels.cpp, decode_attention.cpp, panel_matmul.cpp,
decode_step.cpp, token_choice.cpp): built once per machine with the system's g++ against the installed
torch into one library, loaded as torch ops, and used for float32 CPU passes outside autograd.

A decode step of SmolLM2 at 16 rows spent ~27 ms of ~97 ms outside its matmuls, in ~30 small torch ops
per layer; these kernels do those stretches in four ops per layer (tests/engine_core/test_cpu_kernels.py
checks each against the torch ops it replaces, and the decoder's logits against transformers').

The build is cached in the settings' kernels dir ($TINKERRPC_KERNELS_DIR, default
~/.cache/tinkerrpc/cpu-kernels), keyed by the source, torch's version and the CPU's vector width;
scripts/setup.sh builds it. Where it cannot be built (no compiler), the engine logs why once and runs the
torch ops. TINKERRPC_CPU_KERNELS=0 turns the kernels off (to measure what they change). Whether a pass
runs on them is the execution plan's choice (execution_plan.py).
"""

from __future__ import annotations

import functools
import hashlib
import logging
import os
import subprocess
import sys
import tempfile
from pathlib import Path

import torch

from tinkerrpc_server.settings import KernelSettings, settings_of

log = logging.getLogger(__name__)

_SOURCES = [
    Path(__file__).with_name(name)
    for name in (
        "cpu_kernels.cpp",
        "decode_attention.cpp",
        "panel_matmul.cpp",
        "decode_step.cpp",
        "token_choice.cpp",
    )
]
_HEADER = Path(__file__).with_name("cpu_kernels.h")
# torch's own vectorized code paths: AVX2's serves AVX-512 CPUs too (the panel matmul's AVX-512 build adds
# -mavx512f); elsewhere the portable one.
_VECTOR_FLAGS = {
    "AVX2": ["-mavx2", "-mfma", "-mf16c", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
    "AVX512": ["-mavx2", "-mfma", "-mf16c", "-mavx512f", "-DCPU_CAPABILITY=AVX2", "-DCPU_CAPABILITY_AVX2"],
}
# -ffp-contract=off: a·b + c stays a multiply and an add, as torch's element-wise ops compute it.
_FLAGS = ["-O3", "-std=c++17", "-shared", "-fPIC", "-fopenmp", "-ffp-contract=off", "-w"]
_BUILD_SECONDS = 600


def _command(compiler: str, output: Path) -> list[str]:
    torch_dir = Path(torch.__file__).parent
    capability = torch.backends.cpu.get_cpu_capability()
    abi = int(torch._C._GLIBCXX_USE_CXX11_ABI)
    return [
        compiler,
        *_FLAGS,
        *_VECTOR_FLAGS.get(capability, []),
        f"-D_GLIBCXX_USE_CXX11_ABI={abi}",
        # ATen's and torch/library.h's headers (torch.utils.cpp_extension knows them too, but importing it
        # costs the engine ~4 MiB of setuptools).
        f"-I{torch_dir / 'include'}",
        *(str(source) for source in _SOURCES),
        "-o",
        str(output),
        f"-L{torch_dir / 'lib'}",
        "-lc10",
        "-ltorch_cpu",
        f"-Wl,-rpath,{torch_dir / 'lib'}",
    ]


def _library_path(settings: KernelSettings) -> Path:
    key = hashlib.sha256()
    for source in (*_SOURCES, _HEADER):
        key.update(source.read_bytes())
    key.update(" ".join(_command(settings.compiler, Path("out"))).encode())
    key.update(f"{torch.__version__} {sys.version}".encode())
    return settings.build_dir / f"cpu_kernels-{key.hexdigest()[:16]}.so"


def build(settings: KernelSettings) -> Path:
    """The kernels' shared library, compiled unless already there (written aside, then renamed into place,
    so processes building at once never load a half-written file)."""
    library = _library_path(settings)
    if library.is_file():
        return library
    library.parent.mkdir(parents=True, exist_ok=True)
    with tempfile.TemporaryDirectory(dir=library.parent) as work:
        built = Path(work) / library.name
        command = _command(settings.compiler, built)
        subprocess.run(command, check=True, capture_output=True, text=True, timeout=_BUILD_SECONDS)
        os.replace(built, library)
    return library


@functools.cache
def load(settings: KernelSettings) -> bool:
    """Whether the kernels are loaded into this process (built first where needed); False when the
    settings turn them off."""
    if not settings.enabled:
        return False
    try:
        torch.ops.load_library(str(build(settings)))  # type: ignore[no-untyped-call]
    except (OSError, subprocess.SubprocessError) as err:
        detail = getattr(err, "stderr", "") or ""
        log.warning("CPU kernels unavailable, running torch ops instead: %s %s", err, detail[-2000:])
        return False
    return True


def has_packed_linear() -> bool:
    """Whether the kernels, once loaded, hold the panel matmul (`pack_linear_weight`, `packed_linear`):
    their builds for AVX2 and AVX-512 CPUs."""
    return torch.backends.cpu.get_cpu_capability() in ("AVX2", "AVX512")


def pack_linear_weight(weight: torch.Tensor) -> torch.Tensor:
    """An (out, in) float32 weight as column panels for `packed_linear` (another copy in memory)."""
    packed: torch.Tensor = torch.ops.tinkerrpc_cpu.pack_linear_weight(weight)
    return packed


def packed_weight_shape(out_features: int, in_features: int) -> list[int]:
    """The shape of `pack_linear_weight`'s layout of an (out_features, in_features) weight."""
    shape: list[int] = torch.ops.tinkerrpc_cpu.packed_weight_shape(out_features, in_features)
    return shape


def pack_linear_weight_into(weight: torch.Tensor, packed: torch.Tensor) -> None:
    """`pack_linear_weight(weight)` written into `packed` (contiguous, of `packed_weight_shape`)."""
    torch.ops.tinkerrpc_cpu.pack_linear_weight_into(weight, packed)


def packed_linear(x: torch.Tensor, packed: torch.Tensor, out_features: int) -> torch.Tensor:
    """x (rows, in) · weightᵀ for the weight `pack_linear_weight` packed: (rows, out_features)."""
    out: torch.Tensor = torch.ops.tinkerrpc_cpu.packed_linear(x, packed, out_features)
    return out


def decoder_qkv(
    x: torch.Tensor,
    delta: torch.Tensor | None,
    norm_weight: torch.Tensor,
    eps: float,
    qkv: tuple[torch.Tensor, int],
) -> torch.Tensor:
    """A decoder layer's q/k/v projection on a weight `pack_linear_weight` packed, given with its out
    features, in one call: x += delta (when given) in place, then x's RMSNorm times qkvᵀ. The same ops as
    residual_rms_norm and packed_linear in turn."""
    out: torch.Tensor = torch.ops.tinkerrpc_cpu.decoder_qkv(x, delta, norm_weight, eps, *qkv)
    return out


def decoder_mlp(
    x: torch.Tensor,
    attended: torch.Tensor,
    o: tuple[torch.Tensor, int],
    norm_weight: torch.Tensor,
    eps: float,
    gate_up: tuple[torch.Tensor, int],
    down: tuple[torch.Tensor, int],
) -> torch.Tensor:
    """A decoder layer's second half on weights `pack_linear_weight` packed, each given with its out
    features, in one call: x += attended · oᵀ in place, then down(silu(gate) · up) of x's RMSNorm,
    returned. The same ops as packed_linear, residual_rms_norm and silu_and_multiply in turn."""
    out: torch.Tensor = torch.ops.tinkerrpc_cpu.decoder_mlp(
        x, attended, *o, norm_weight, eps, *gate_up, *down
    )
    return out


def residual_rms_norm(
    x: torch.Tensor, delta: torch.Tensor | None, weight: torch.Tensor, eps: float
) -> torch.Tensor:
    """x += delta (when given), in place; returns rms_norm(x) · weight. x (tokens, hidden), contiguous."""
    out: torch.Tensor = torch.ops.tinkerrpc_cpu.residual_rms_norm(x, delta, weight, eps)
    return out


def silu_and_multiply(gate_up: torch.Tensor) -> torch.Tensor:
    """silu(gate) · up for gate_up (tokens, 2 · width), the gate first."""
    out: torch.Tensor = torch.ops.tinkerrpc_cpu.silu_and_multiply(gate_up)
    return out


def rotary_qk(
    qk: torch.Tensor,
    cos: torch.Tensor,
    signed_sin: torch.Tensor,
    norm_weight: torch.Tensor | None,
    eps: float,
) -> torch.Tensor:
    """qk (tokens, heads, dim) each head optionally RMS-normalized by its row of `norm_weight`, then
    rotated: x·cos + roll(x, dim/2)·signed_sin, for cos and signed_sin (tokens, dim). Contiguous."""
    out: torch.Tensor = torch.ops.tinkerrpc_cpu.rotary_qk(qk, cos, signed_sin, norm_weight, eps)
    return out


def decode_attention(
    q: torch.Tensor,
    k: torch.Tensor,
    v: torch.Tensor,
    bias: torch.Tensor,
    scale: float,
    shared: tuple[int, int] | None,
) -> torch.Tensor:
    """softmax(q·kᵀ·scale + bias)·v for one query per row: q (rows, heads, dim) over grouped k, v (rows,
    kv heads, columns, dim), bias (rows, columns) 0 or -inf (padding, not read). Columns `shared` (start,
    end), the same in every row, are read from row 0. Returns (rows, heads · dim)."""
    begin, end = shared if shared is not None else (0, 0)
    out: torch.Tensor = torch.ops.tinkerrpc_cpu.decode_attention(q, k, v, bias, scale, begin, end)
    return out


def decode_layers(
    x: torch.Tensor,
    weights: list[torch.Tensor],
    qk_norms: list[torch.Tensor],
    features: list[int],
    rotary: tuple[torch.Tensor, torch.Tensor],
    cache: tuple[list[torch.Tensor], list[torch.Tensor]],
    bias: torch.Tensor,
    scale: float,
    shared: tuple[int, int] | None,
    heads: int,
    eps: float,
) -> torch.Tensor:
    """A decode step's decoder layers in one call, on weights `pack_linear_weight` packed: per layer
    decoder_qkv, rotary_qk (its q/k norm weight from `qk_norms`, empty without), the new key and value
    into the last column of that layer's (keys, values) views of `cache`, decode_attention and decoder_mlp,
    as the separate calls compute them. `weights` per layer: input norm, q/k/v, o, post-attention norm,
    gate/up, down; `features`: the four projections' out features. Returns x plus the last layer's MLP."""
    begin, end = shared if shared is not None else (0, 0)
    out: torch.Tensor = torch.ops.tinkerrpc_cpu.decode_layers(
        x, weights, qk_norms, features, *rotary, *cache, bias, scale, begin, end, heads, eps
    )
    return out


def grown_views(
    views: list[torch.Tensor], buffers: list[torch.Tensor], rows: int, heads: int
) -> list[torch.Tensor]:
    """Each view (rows', kv heads, columns, dim) grown to `rows` rows and one more column inside its
    buffer, `buffer[:rows, :, :columns + 1]`; empty unless every view is its buffer's leading part and
    every buffer has `heads` heads and that room."""
    grown: list[torch.Tensor] = torch.ops.tinkerrpc_cpu.grown_views(views, buffers, rows, heads)
    return grown


def choose_tokens(
    logits: torch.Tensor, scales: torch.Tensor, greedy: torch.Tensor, uniforms: torch.Tensor, block: int
) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """Per row of logits (rows, vocab): the token its uniform draws from softmax(logits / scale) (found
    `block` vocabulary positions at a time), or its first argmax where `greedy`; that token's logprob;
    the peak of logits / scale and the log of its softmax normalizer. token_choice.choose defines it."""
    tokens, logprobs, peaks, log_totals = torch.ops.tinkerrpc_cpu.choose_tokens(
        logits, scales, greedy, uniforms, block
    )
    return tokens, logprobs, peaks, log_totals


if __name__ == "__main__":
    # scripts/setup.sh: build now rather than at the first engine start.
    settings = settings_of("cpu_kernels")
    if settings is None:
        sys.exit(2)
    print(build(settings.kernels))
