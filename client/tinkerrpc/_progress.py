"""A one-line progress bar on a text stream (stderr by default), redrawn in place: the SDK's long
operations (gathering rollouts, downloading an export) show how far they are."""

from __future__ import annotations

import sys
from typing import TextIO


class ProgressBar:
    WIDTH = 24

    def __init__(self, total: float, desc: str, stream: TextIO | None = None) -> None:
        self.total = total
        self.desc = desc
        self.stream = stream or sys.stderr

    def draw(self, done: float, counter: str, postfix: str = "") -> None:
        """`counter` says how far in words (e.g. "3/8", "1.2/4.0 MiB"); `postfix` follows the bar."""
        filled = int(self.WIDTH * done / self.total) if self.total else self.WIDTH
        bar = "#" * filled + "-" * (self.WIDTH - filled)
        self.stream.write(f"\r{self.desc}: {counter} [{bar}]{postfix}")
        self.stream.flush()

    def close(self) -> None:
        self.stream.write("\n")
        self.stream.flush()
