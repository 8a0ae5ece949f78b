"""`python -m bench.matmul_kernels`: MKL's sgemm (torch's float32 CPU matmul) against oneDNN's inner
product in the same torch build, for the sampler's matmul shapes at decode-step row counts; the
measurement behind the decoder's choice of kernels (engine/compute/decoder.py, engine/compute/packing.py).

For each model shape and row count it times, interleaved, the unembedding as the decoder stores it
((vocabulary, hidden), the transposed operand), by F.linear and by oneDNN, and one decoder layer's four
projections as stored ((in, out)) by a matmul, by oneDNN over the transposed view, and packed
(`PackedWeight`) for MKL's, oneDNN's and, on AVX2 and AVX-512 CPUs, the engine's own panel kernel. Every weight is larger than the caches or
read in a round over several copies, as a decode step reads it. The last line is the packing plan the
engine measures for itself on this machine.
"""

from __future__ import annotations

import argparse
import statistics
import time
from collections.abc import Callable

import torch
import torch.nn.functional as F

from tinkerrpc_server.engine.compute import cpu_kernels
from tinkerrpc_server.engine.compute.execution_plan import choose_execution_plan
from tinkerrpc_server.engine.compute.packing import Kernel, PackedWeight, usable_kernels
from tinkerrpc_server.settings import Settings

# (hidden, vocabulary, [(in, out) of q/k/v, o, gate/up, down])
SHAPES = {
    "Qwen3-0.6B width": (1024, 151_936, [(1024, 4096), (2048, 1024), (1024, 6144), (3072, 1024)]),
    "SmolLM2-135M": (576, 49_152, [(576, 960), (576, 576), (576, 3072), (1536, 576)]),
}
ROWS = (1, 2, 4, 8, 16, 32, 64, 128)
# Copies of a layer's weights read in turn, so the layer figure is not a cached one.
LAYER_COPIES = 8


def _onednn(x: torch.Tensor, weight: torch.Tensor) -> torch.Tensor:
    return torch.ops.mkldnn._linear_pointwise(x, weight, None, "none", [], "")


def _median_ms(run: Callable[[], object], repeats: int) -> float:
    run()
    times = []
    for _ in range(repeats):
        started = time.perf_counter()
        run()
        times.append(time.perf_counter() - started)
    return statistics.median(times) * 1e3


def _times(
    x: torch.Tensor,
    head: torch.Tensor,
    inputs: dict[int, torch.Tensor],
    layers: list[list[torch.Tensor]],
    packed: dict[Kernel, list[list[PackedWeight]]],
    repeats: int,
) -> tuple[float, ...]:
    """Milliseconds of the unembedding by MKL and by oneDNN, then of all layer copies by MKL, oneDNN,
    and each packed kernel of `packed`, in its order."""
    with torch.inference_mode():
        return (
            _median_ms(lambda: F.linear(x, head), repeats),
            _median_ms(lambda: _onednn(x, head), repeats),
            _median_ms(lambda: [inputs[w.shape[0]] @ w for layer in layers for w in layer], repeats),
            _median_ms(
                lambda: [_onednn(inputs[w.shape[0]], w.t()) for layer in layers for w in layer], repeats
            ),
            *(
                _median_ms(
                    lambda copies=copies: [
                        p.times(inputs[p.stand_in.shape[1]]) for layer in copies for p in layer
                    ],
                    repeats,
                )
                for copies in packed.values()
            ),
        )


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.matmul_kernels", description=__doc__)
    parser.add_argument("--repeats", type=int, default=7)
    parser.add_argument("--threads", type=int, default=torch.get_num_threads())
    args = parser.parse_args(argv)
    torch.set_num_threads(args.threads)
    plan = choose_execution_plan(Settings.from_environment().kernels)
    generator = torch.Generator().manual_seed(0)
    print(
        "| model | rows | unembedding MKL ms | oneDNN ms | MKL/oneDNN | layer MKL ms | oneDNN ms | MKL/oneDNN "
        "| MKL packed ms | oneDNN packed ms | MKL/oneDNN packed | panels ms | oneDNN packed/panels |"
    )
    print("|---|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|---:|")
    kernels: list[Kernel] = usable_kernels(panels=plan.cpu_kernels and cpu_kernels.has_packed_linear())
    for label, (hidden, vocabulary, projections) in SHAPES.items():
        head = torch.randn(vocabulary, hidden, generator=generator) * 0.02
        layers = [
            [torch.randn(size_in, size_out, generator=generator) * 0.02 for size_in, size_out in projections]
            for _ in range(LAYER_COPIES)
        ]
        packed: dict[Kernel, list[list[PackedWeight]]] = {
            kernel: [[_packed(w, kernel) for w in layer] for layer in layers] for kernel in kernels
        }
        for rows in ROWS:
            x = torch.randn(rows, hidden, generator=generator)
            inputs = {size_in: torch.randn(rows, size_in, generator=generator) for size_in, _ in projections}
            head_mkl, head_onednn, layer_mkl, layer_onednn, layer_mkl_packed, layer_onednn_packed, *panels = (
                _times(x, head, inputs, layers, packed, args.repeats)
            )
            panels_columns = (
                f" {panels[0] / LAYER_COPIES:.2f} | {layer_onednn_packed / panels[0]:.2f} |"
                if panels
                else " - | - |"
            )
            print(
                f"| {label} | {rows} | {head_mkl:.1f} | {head_onednn:.1f} | {head_mkl / head_onednn:.2f} "
                f"| {layer_mkl / LAYER_COPIES:.2f} | {layer_onednn / LAYER_COPIES:.2f} "
                f"| {layer_mkl / layer_onednn:.2f} | {layer_mkl_packed / LAYER_COPIES:.2f} "
                f"| {layer_onednn_packed / LAYER_COPIES:.2f} | {layer_mkl_packed / layer_onednn_packed:.2f} |"
                + panels_columns,
                flush=True,
            )
    print(f"\nthe engine's execution plan here: {plan}")


def _packed(weight_t: torch.Tensor, kernel: Kernel) -> PackedWeight:
    packed = PackedWeight.of(weight_t.t(), kernel)
    if packed is None:
        raise SystemExit("packed kernels multiply float32 CPU weights only")
    return packed


if __name__ == "__main__":
    main()
