"""Per-request limits of `tinkerrpc serve`, and their command-line flags. Light imports only: the CLI
reads these flags before it imports the heavy service modules.

A value over a per-field limit (Sample's n and max_tokens) is INVALID_ARGUMENT naming the field; a Train
batch over the size limits is RESOURCE_EXHAUSTED naming the flag, so a client knows to split the batch.
"""

from __future__ import annotations

import argparse
from dataclasses import dataclass


@dataclass(frozen=True)
class Limits:
    # Trajectories (RL) or examples (SFT) in one Train request.
    max_train_trajectories: int = 4096
    # Tokens of all datums of one Train step (prompt and completion, after rendering).
    max_train_tokens: int = 1_048_576
    # Completions per Sample request.
    max_sample_n: int = 128
    # max_tokens of one Sample request (the model's context bounds prompt + max_tokens as well).
    max_sample_tokens: int = 16_384
    # Seconds a call without a gRPC deadline may wait on the backend (see service/deadlines.py).
    backend_timeout: int = 3600
    # Retention per model, unless its CreateModel asked otherwise (see service/retention.py): the latest
    # versions kept sampleable, and the latest automatic state checkpoints kept.
    keep_sampler_versions: int = 16
    keep_state_checkpoints: int = 4


# Fixed bounds of what a Train stores with its step (the idempotency record, the run history's metrics):
# no flag sets them, a field over one is INVALID_ARGUMENT naming it and stating the bound. A key is a
# client's retry token (a UUID is 36 bytes); metrics are an environment's few figures per trajectory.
MAX_IDEMPOTENCY_KEY_BYTES = 256
MAX_TRAJECTORY_METRICS = 64
MAX_METRIC_NAME_BYTES = 128
# Distinct metric names over one Train's trajectories: each becomes a stored "env/<name>" mean.
MAX_TRAIN_METRIC_NAMES = 256
# The LoRA rank of a model: at most its base model's hidden size (a rank past the width of the layers
# it adapts adds parameters, not expressiveness) and never over this cap, whose adapter and Adam state
# on a mid-size model are already gigabytes.
MAX_LORA_RANK = 512


# (flag, attribute, help) for each limit: the flag names appear in the error messages.
LIMIT_FLAGS = (
    ("--max-train-trajectories", "max_train_trajectories", "trajectories or examples per Train"),
    ("--max-train-tokens", "max_train_tokens", "tokens per Train step, prompts and completions"),
    ("--max-sample-n", "max_sample_n", "completions per Sample (n)"),
    ("--max-sample-tokens", "max_sample_tokens", "max_tokens per Sample"),
    ("--backend-timeout", "backend_timeout", "seconds a call without a deadline waits on the backend"),
    ("--keep-sampler-versions", "keep_sampler_versions", "latest versions kept sampleable per model"),
    ("--keep-state-checkpoints", "keep_state_checkpoints", "latest automatic state checkpoints per model"),
)


def flag_of(attribute: str) -> str:
    return next(flag for flag, name, _ in LIMIT_FLAGS if name == attribute)


def _positive_int(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{text!r} is not an integer") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1, got {value}")
    return value


def add_limit_arguments(parser: argparse.ArgumentParser) -> None:
    defaults = Limits()
    for flag, attribute, description in LIMIT_FLAGS:
        default = getattr(defaults, attribute)
        parser.add_argument(
            flag, type=_positive_int, default=default, help=f"limit: {description} (default {default})"
        )


def limits_from_args(args: argparse.Namespace) -> Limits:
    return Limits(**{attribute: getattr(args, attribute) for _, attribute, _ in LIMIT_FLAGS})
