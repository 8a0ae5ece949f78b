"""What the examples share: the server arguments (`--target` or `--local`, `--short`), a local
`tinkerrpc serve` when asked for one, a local OpenAI sidecar, and the toy task they train on."""

from __future__ import annotations

import argparse
import difflib
import tempfile
import uuid
from collections.abc import Iterator
from contextlib import contextmanager
from pathlib import Path

# Both are the standard library alone at import (the client install has them), unlike the rest of the
# server package.
from tinkerrpc_server.model_store import TINY_CHAT
from tinkerrpc_server.recipes.yes_no_maybe.task import ANSWERS

# The toy task, the yes / no / maybe task's answers asked for one at a time: answer each prompt with
# exactly its word.
TASKS = {f"respond with {word}": word for word in ANSWERS}


def reward(prompt: str, answer: str) -> float:
    """Similarity of the answer to the expected word, in [0, 1]: dense enough for a random model to improve on."""
    return difflib.SequenceMatcher(None, answer.strip().lower(), TASKS[prompt]).ratio()


def parser(description: str) -> argparse.ArgumentParser:
    p = argparse.ArgumentParser(description=description)
    where = p.add_mutually_exclusive_group(required=True)
    where.add_argument("--target", help="HOST:PORT of a running `tinkerrpc serve`")
    where.add_argument(
        "--local", action="store_true", help="start a local `tinkerrpc serve` (embedded engine)"
    )
    p.add_argument("--short", action="store_true", help="a few steps only (CI)")
    p.add_argument("--base-model", default=TINY_CHAT)
    p.add_argument("--model", default=None, help="name of the model to create (default: a fresh unique name)")
    return p


def model_name(args: argparse.Namespace, prefix: str) -> str:
    return str(args.model) if args.model else f"{prefix}-{uuid.uuid4().hex[:8]}"


@contextmanager
def server_target(args: argparse.Namespace) -> Iterator[str]:
    """`args.target`, or with `--local` the target of a `tinkerrpc serve` started for the example."""
    if not args.local:
        yield str(args.target)
        return
    # Imported only here: the server package (torch, tinker) is not needed to talk to a remote server.
    from tinkerrpc_server.local.stack import LocalStack

    with tempfile.TemporaryDirectory(prefix="tinkerrpc-example-") as work:
        print(f"starting a local tinkerrpc serve (log: {work}/serve.log) ...", flush=True)
        with LocalStack(Path(work) / "data", Path(work) / "serve.log") as stack:
            yield stack.target


@contextmanager
def local_sidecar(grpc_target: str, log_path: Path, api_key: str | None = None) -> Iterator[str]:
    """Run the OpenAI-compatible sidecar for `grpc_target` on a free port; yields its `/v1` base URL."""
    from tinkerrpc_server.local.stack import LocalSidecar

    with LocalSidecar(grpc_target, log_path, api_key) as sidecar:
        yield sidecar.openai_base_url
