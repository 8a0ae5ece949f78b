"""`python -m bench.packed_pages`: a decode step's layers and unembedding on the panel kernel, with the
weights packed one buffer each on 4 KiB pages (as `pack_linear_weight` allocates them) against all of them
end to end in one buffer on huge pages (`packed_in_order`, how the engine's decoders pack): the
measurement behind packed_in_order (engine/compute/packing.py).

SmolLM2-135M's shapes with random weights, 48 cached columns per row, the two layouts timed in
alternating rounds in one process (a round's value the median of 5 steps); each layout's weights are
~0.54 GB, beyond any cache. Prints each row count's speedup, median and min-max over the rounds."""

from __future__ import annotations

import argparse
import statistics
import time

import torch

from tinkerrpc_server.engine.compute import cpu_kernels
from tinkerrpc_server.engine.compute.execution_plan import process_plan
from tinkerrpc_server.engine.compute.packing import packed_in_order

LAYERS, HIDDEN, HEADS, KV_HEADS, HEAD_DIM, INTERMEDIATE, VOCAB = 30, 576, 9, 3, 64, 1536, 49_152
COLUMNS = 48
# (out, in) of q/k/v, o, gate/up and down.
PROJECTIONS = [
    ((HEADS + 2 * KV_HEADS) * HEAD_DIM, HIDDEN),
    (HIDDEN, HIDDEN),
    (2 * INTERMEDIATE, HIDDEN),
    (HIDDEN, INTERMEDIATE),
]


def _step_arguments(weights: list[torch.Tensor]) -> tuple[list[torch.Tensor], torch.Tensor]:
    """decode_layers' per-layer tensors (norms and packed projections) and the packed unembedding."""
    generator = torch.Generator().manual_seed(1)
    norms = iter([torch.rand(HIDDEN, generator=generator) + 0.5 for _ in range(2 * LAYERS)])
    packed = iter(weights)
    step = []
    for _ in range(LAYERS):
        step += [next(norms), next(packed), next(packed), next(norms), next(packed), next(packed)]
    return step, next(packed)


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--rows", type=int, nargs="+", default=[1, 16])
    parser.add_argument("--rounds", type=int, default=16)
    args = parser.parse_args(argv)
    if not (process_plan().cpu_kernels and cpu_kernels.has_packed_linear()):
        raise SystemExit("the panel kernel needs the CPU kernels on an AVX2 or AVX-512 CPU")
    generator = torch.Generator().manual_seed(0)
    shapes = [shape for _ in range(LAYERS) for shape in PROJECTIONS] + [(VOCAB, HIDDEN)]
    plain = [torch.randn(*shape, generator=generator) * 0.05 for shape in shapes]
    layouts = {
        "a buffer each, 4 KiB pages": [cpu_kernels.pack_linear_weight(weight) for weight in plain],
        "one buffer, huge pages": [p.packed for p in packed_in_order(plain, "panels") if p is not None],
    }
    del plain
    for rows in args.rows:
        _compare(layouts, rows, args.rounds, generator)


def _compare(
    layouts: dict[str, list[torch.Tensor]], rows: int, rounds: int, generator: torch.Generator
) -> None:
    """Prints the second layout's speedup over the first at `rows` rows, over alternating rounds."""
    caches = [
        torch.randn(rows, KV_HEADS, COLUMNS + 8, HEAD_DIM, generator=generator)[:, :, :COLUMNS]
        for _ in range(2 * LAYERS)
    ]
    rotary = (
        torch.rand(rows, HEAD_DIM, generator=generator),
        torch.rand(rows, HEAD_DIM, generator=generator),
    )
    bias = torch.zeros(rows, COLUMNS)
    x = torch.randn(rows, HIDDEN, generator=generator)
    steps = {name: _step_arguments(weights) for name, weights in layouts.items()}

    def step(name: str) -> float:
        layer_weights, head = steps[name]
        started = time.perf_counter()
        hidden = cpu_kernels.decode_layers(
            x.clone(),
            layer_weights,
            [],
            [shape[0] for shape in PROJECTIONS],
            rotary,
            (caches[:LAYERS], caches[LAYERS:]),
            bias,
            HEAD_DIM**-0.5,
            None,
            HEADS,
            1e-5,
        )
        cpu_kernels.packed_linear(hidden, head, VOCAB)
        return time.perf_counter() - started

    names = list(layouts)
    for name in names:
        step(name)
    seconds: dict[str, list[float]] = {name: [] for name in names}
    for round_index in range(rounds):
        for name in names if round_index % 2 == 0 else names[::-1]:
            seconds[name].append(statistics.median(step(name) for _ in range(5)))
    speedups = [a / b for a, b in zip(seconds[names[0]], seconds[names[1]], strict=True)]
    print(
        f"{rows} row(s): {names[0]} {statistics.median(seconds[names[0]]) * 1e3:.2f} ms, "
        f"{names[1]} {statistics.median(seconds[names[1]]) * 1e3:.2f} ms a step: "
        f"{statistics.median(speedups):.3f}x [{min(speedups):.3f}-{max(speedups):.3f}]",
        flush=True,
    )


if __name__ == "__main__":
    main()
