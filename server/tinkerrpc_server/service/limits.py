"""Per-request limits of `tinkerrpc serve`, and their command-line flags (names and defaults are the
contract's `SERVER_FLAGS`; the fixed bounds no flag changes are in `tinkerrpc.contract.limits`). Light
imports only: the CLI reads these flags before it imports the heavy service modules.

A value over a per-field limit (Sample's n and max_tokens) is INVALID_ARGUMENT naming the field; a Train
batch over the size limits is RESOURCE_EXHAUSTED naming the flag, so a client knows to split the batch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass

from tinkerrpc.contract.limits import SERVER_FLAGS, server_flag


def _default(attribute: str) -> int:
    return server_flag(attribute).default


@dataclass(frozen=True)
class Limits:
    max_train_trajectories: int = _default("max_train_trajectories")
    max_train_tokens: int = _default("max_train_tokens")
    max_sample_n: int = _default("max_sample_n")
    # The model's context bounds prompt + max_tokens as well.
    max_sample_tokens: int = _default("max_sample_tokens")
    # Seconds (see service/deadlines.py).
    backend_timeout: int = _default("backend_timeout")
    # Retention per model, unless its CreateModel asked otherwise (see service/retention.py).
    keep_sampler_versions: int = _default("keep_sampler_versions")
    keep_state_checkpoints: int = _default("keep_state_checkpoints")


def flag_of(attribute: str) -> str:
    return server_flag(attribute).flag


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    for limit in SERVER_FLAGS:
        parser.add_argument(
            limit.flag,
            type=_positive_int,
            default=limit.default,
            help=f"limit: {limit.help} (default {limit.default})",
        )


def limits_from_args(args: argparse.Namespace) -> Limits:
    return Limits(**{limit.attribute: getattr(args, limit.attribute) for limit in SERVER_FLAGS})
