"""`python -m bench.sdk_probe [-k TEXT] [--json PATH]`: every public call of the installed tinker SDK, with its
options, against a fresh `tinkerrpc engine` on tiny-chat, made as a user makes it (issue 41's check).

Prints one line per call that does not work, then the counts: works / refused (documented, a clear error
naming what it refuses) / fails / silently wrong (answered, but not with Tinker's semantics). Exits 1 when
a call fails or is silently wrong. The calls live in sdk_probe_{training,sampling,rest,async}.py; what a verdict
means in sdk_probe_core.py.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import tempfile
import time
import warnings
from collections import Counter
from pathlib import Path

import tinker

from bench import (  # noqa: F401 - they register the calls
    sdk_probe_async,
    sdk_probe_rest,
    sdk_probe_sampling,
    sdk_probe_training,
)
from bench.sdk_probe_core import CALLS, VERDICTS, Call, Probe, run_all
from tinkerrpc_server.local.stack import LocalEngine


def probe(engine: LocalEngine, calls: list[Call]) -> list[tuple[str, str, str]]:
    """(call, verdict, detail) for each call, against a running engine."""
    with engine.service_client() as service:
        return [
            (one.name, verdict, detail) for one, verdict, detail in run_all(Probe(engine, service), calls)
        ]


def report(results: list[tuple[str, str, str]], seconds: float) -> str:
    lines = [f"  {verdict:<14} {name}: {detail}" for name, verdict, detail in results if verdict != "works"]
    counts = Counter(verdict for _, verdict, _ in results)
    summary = ", ".join(f"{counts[v]} {v}" for v in VERDICTS)
    lines.append(
        f"tinker {tinker.__version__}: {len(results)} calls in {seconds:.0f} s against tinkerrpc engine "
        f"on tiny-chat: {summary}"
    )
    return "\n".join(lines)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("-k", default="", help="only the calls whose name contains this text")
    parser.add_argument("--json", type=Path, help="also write the verdicts here")
    args = parser.parse_args()
    calls = [c for c in CALLS if args.k in c.name]
    os.environ.setdefault("TINKER_TELEMETRY", "0")
    # The probe calls the SDK's deprecated and experimental methods on purpose, and makes requests the
    # engine must refuse: the SDK's warnings and its log line per refused request are expected here.
    warnings.simplefilter("ignore")
    logging.getLogger("tinker").setLevel(logging.CRITICAL)
    with tempfile.TemporaryDirectory(prefix="sdk-probe-") as work:
        # The engine lays tiny-chat out in this hub cache; the SDK's get_tokenizer reads it from there.
        os.environ["HF_HUB_CACHE"] = str(Path(work) / "hf-hub")
        os.environ["HF_HUB_OFFLINE"] = "1"
        engine = LocalEngine(Path(work) / "data", Path(work) / "models", Path(work) / "engine.log")
        engine.start()
        started = time.monotonic()
        try:
            results = probe(engine, calls)
        finally:
            engine.stop()
        print(report(results, time.monotonic() - started))
    if args.json:
        args.json.write_text(
            json.dumps([dict(zip(("call", "verdict", "detail"), r, strict=True)) for r in results], indent=1)
        )
    return 1 if any(v in ("fails", "silently wrong") for _, v, _ in results) else 0


if __name__ == "__main__":
    sys.exit(main())
