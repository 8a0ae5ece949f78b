"""ART 0.5.23's PipelineTrainer through tinkerrpc.art, run outside CI (issue 42): `python -m
bench.art_0_5_23 [--wheel PATH] [--out bench/results-art-0.5.23.json]`.

ART 0.5.20+ requires Python 3.12, which these machines cannot install, and the venv keeps 0.5.18 (what
`tinkerrpc[art]` pins and CI runs). So this: downloads openpipe-art==0.5.23 (`pip download --no-deps`) into
a cache directory, or takes the wheel given; unpacks it into its own directory beside the venv's
site-packages, never into them; rewrites what it uses of 3.12 to 3.11 (bench/py311_syntax.py: the syntax,
and typing's 3.12 names); adds the dependencies 0.5.23 needs that the venv lacks (EXTRA_DEPENDENCIES,
small and pure Python) into that directory; then starts `tinkerrpc serve --sidecar-port` on its embedded
engine and runs bench/art_0_5_23_flow.py in a subprocess whose PYTHONPATH puts that directory ahead of the
venv, so `import art` is 0.5.23. The flow prints a line per policy version (the rewards of its rollouts and
of its eval) while it runs; its summary, with each trained step from ART's history of the model, is
written to --out with a plot beside it.
"""

from __future__ import annotations

import argparse
import json
import os
import shutil
import subprocess
import sys
import time
import zipfile
from pathlib import Path
from typing import Any

from bench.py311_syntax import rewrite_source
from tinkerrpc_server.local.stack import LocalStack

ART_VERSION = "0.5.23"
# What 0.5.23 imports at `import art` and the venv lacks (anthropic's types, in art.trajectories).
EXTRA_DEPENDENCIES = ("anthropic==2.17.0", "docstring-parser==0.17.0")
FLOW = Path(__file__).with_name("art_0_5_23_flow.py")
FLOW_TIMEOUT_SECONDS = 3600.0
DEFAULT_CACHE = Path.home() / ".cache" / "tinkerrpc" / f"art-{ART_VERSION}"


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", *args], check=True, stdout=subprocess.DEVNULL)


def download_wheel(cache: Path) -> Path:
    wheels = cache / "wheels"
    found = sorted(wheels.glob(f"openpipe_art-{ART_VERSION}-*.whl"))
    if not found:
        _pip(
            "download",
            "--no-deps",
            "--only-binary=:all:",
            "--python-version",
            "3.12",
            "-d",
            str(wheels),
            f"openpipe-art=={ART_VERSION}",
        )
        found = sorted(wheels.glob(f"openpipe_art-{ART_VERSION}-*.whl"))
    return found[0]


def prepare(wheel: Path, cache: Path) -> tuple[Path, list[str]]:
    """The wheel unpacked into cache/site with its 3.12-only files rewritten, and the extra dependencies
    installed there; returns that directory and the files rewritten (relative paths)."""
    site = cache / "site"
    if site.exists():
        shutil.rmtree(site)
    with zipfile.ZipFile(wheel) as archive:
        archive.extractall(site)
    rewritten = []
    for path in sorted(site.rglob("*.py")):
        source = path.read_text(encoding="utf-8")
        if (text := rewrite_source(source, str(path))) != source:
            path.write_text(text, encoding="utf-8")
            rewritten.append(str(path.relative_to(site)))
    _pip("install", "--no-deps", "--target", str(site), "--no-compile", *EXTRA_DEPENDENCIES)
    return site, rewritten


def run_flow(site: Path, work: Path, target: str, kl_penalty_coef: float) -> dict[str, Any]:
    env = {**os.environ, "PYTHONPATH": os.pathsep.join([str(site), os.environ.get("PYTHONPATH", "")])}
    env["PYTHONUNBUFFERED"] = "1"
    process = subprocess.Popen(
        [sys.executable, str(FLOW), str(work / ".art"), target, str(kl_penalty_coef)],
        stdout=subprocess.PIPE,
        text=True,
        env=env,
    )
    assert process.stdout is not None
    last = ""
    for line in process.stdout:
        print(line, end="", flush=True)
        last = line
    if process.wait(timeout=FLOW_TIMEOUT_SECONDS) != 0:
        raise RuntimeError(f"the ART {ART_VERSION} flow failed (exit {process.returncode})")
    result: dict[str, Any] = json.loads(last)
    return result


def trained_steps(art_path: Path) -> list[dict[str, float]]:
    """Each RL step as PipelineTrainer logged it in the model's history: the mean reward of the rollouts it
    trained on, the KL to the reference, the tokens the server had to score, the rollouts' policy age."""
    logged = {
        "train/reward": "train_reward",
        "loss/kl_policy_ref": "kl_policy_ref",
        "data/step_scored_tokens": "scored_tokens",
        "offpolicy/token_weighted_policy_age_steps": "policy_age_steps",
    }
    (history,) = art_path.glob("*/models/*/history.jsonl")
    rows = [json.loads(line) for line in history.read_text().splitlines()]
    return [
        {"produced_version": row["step"], **{name: row[key] for key, name in logged.items() if key in row}}
        for row in rows
        if "train/reward" in row
    ]


def plot(result: dict[str, Any], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    figure, axis = plt.subplots(figsize=(7, 4))
    steps = result["steps"]
    axis.plot(
        [s["version"] for s in steps if s["rollout_reward"] is not None],
        [s["rollout_reward"] for s in steps if s["rollout_reward"] is not None],
        "o-",
        label="rollouts sampled by the version",
    )
    evals = [s for s in steps if s["eval_reward"] is not None]
    axis.plot(
        [s["version"] for s in evals], [s["eval_reward"] for s in evals], "s--", label="eval (exact lease)"
    )
    trained = result["trained_steps"]
    axis.plot(
        [s["produced_version"] for s in trained],
        [s["train_reward"] for s in trained],
        "^:",
        label="rollouts each step trained on, at the version it made",
    )
    axis.axhline(result["target_reward"], color="grey", linestyle=":", label="target")
    axis.axvline(result["sft_steps"], color="lightgrey", linestyle="-", label="end of SFT warm-up")
    axis.set_xlabel("policy version")
    axis.set_ylabel("mean reward")
    axis.set_title(f"ART {ART_VERSION} PipelineTrainer through tinkerrpc.art ({result['base_model']})")
    axis.legend(loc="upper left", fontsize="small")
    figure.tight_layout()
    figure.savefig(path, dpi=100)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--wheel", type=Path, help=f"an openpipe_art-{ART_VERSION} wheel (else downloaded)")
    parser.add_argument("--cache", type=Path, default=DEFAULT_CACHE)
    parser.add_argument("--work", type=Path, default=Path("/tmp") / f"art-{ART_VERSION}-run")
    parser.add_argument(
        "--out", type=Path, default=Path(__file__).with_name(f"results-art-{ART_VERSION}.json")
    )
    parser.add_argument(
        "--kl-penalty-coef", type=float, default=0.0, help="PipelineTrainer's (0: no KL, as its default)"
    )
    arguments = parser.parse_args()

    wheel = arguments.wheel or download_wheel(arguments.cache)
    site, rewritten = prepare(wheel, arguments.cache)
    print(f"ART {ART_VERSION} unpacked in {site}; rewritten for 3.11: {len(rewritten)} files", flush=True)
    work = arguments.work
    if work.exists():
        shutil.rmtree(work)
    work.mkdir(parents=True)
    started = time.perf_counter()
    args = ("--model-dir", str(work / "models"))
    with LocalStack(work / "data", work / "serve.log", args, 240, with_sidecar=True) as stack:
        result = run_flow(site, work, stack.target, arguments.kl_penalty_coef)
    result["trained_steps"] = trained_steps(work / ".art")
    summary = {
        "art_version": ART_VERSION,
        "wheel": wheel.name,
        "rewritten_for_py311": rewritten,
        "extra_dependencies": list(EXTRA_DEPENDENCIES),
        "seconds_with_server_start": time.perf_counter() - started,
        **result,
    }
    arguments.out.write_text(json.dumps(summary, indent=2) + "\n")
    plot(summary, arguments.out.with_suffix(".png"))
    print(f"wrote {arguments.out} and {arguments.out.with_suffix('.png')}")
    if not result["reached_target"]:
        sys.exit(1)


if __name__ == "__main__":
    main()
