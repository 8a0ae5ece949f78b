"""MkDocs hook: the Benchmarks pages come from bench/ itself, never from copies that could drift.

bench/README.md (how to reproduce each comparison, the committed run's tables) becomes the page
`benchmarks/index.md`, and the charts `python -m bench` writes (bench/results*.png) sit beside it, so
the README's `![...](results.png)` images resolve on the site as they do in the repository.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

from mkdocs.structure.files import File, Files

BENCH_DIR = Path(__file__).resolve().parents[2] / "bench"
SITE_DIR = "benchmarks"


def on_files(files: Files, config: Any) -> Files:
    files.append(File.generated(config, f"{SITE_DIR}/index.md", abs_src_path=str(BENCH_DIR / "README.md")))
    for chart in sorted(BENCH_DIR.glob("results*.png")):
        files.append(File.generated(config, f"{SITE_DIR}/{chart.name}", abs_src_path=str(chart)))
    return files


def on_serve(server: Any, config: Any, builder: Any) -> Any:
    """`mkdocs serve` rebuilds when bench/README.md or a chart changes."""
    server.watch(str(BENCH_DIR / "README.md"))
    return server
