"""Logprobs of given token ids at prompt positions (the SDK's `target_prompt_logprobs`).

A request names ids as a `[len(prompt) - 1, K]` grid: cell `[i, j]` is scored at prompt position
`i + 1`, and -1 asks for nothing (its answer is 0.0). A sparse request lists only some cells; its
answer lists the same cells. The ids are scored in the prefill, from the same log-softmax as the
prompt logprobs (prefill.py).
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

# A cell that asks for nothing.
NO_TARGET = -1


@dataclass(frozen=True)
class CsrLayout:
    """Which cells of a sparse grid are listed: CSR row pointers and column indices."""

    crow_indices: np.ndarray  # int64, rows + 1
    col_indices: np.ndarray  # int64, listed cells

    def rows(self) -> np.ndarray:
        """The row of each listed cell."""
        return np.repeat(np.arange(len(self.crow_indices) - 1), np.diff(self.crow_indices))


@dataclass(frozen=True)
class PromptTargets:
    """The ids a request asks about, dense (NO_TARGET where nothing is asked), and its layout if sparse."""

    ids: np.ndarray  # int64, (len(prompt) - 1, K)
    layout: CsrLayout | None = None

    def answer(self, logprobs: np.ndarray) -> PromptTargetLogprobs:
        """The answer from the logprobs gathered at `ids` (any value where an id is NO_TARGET)."""
        values = np.where(self.ids == NO_TARGET, 0.0, logprobs).astype(np.float32)
        return PromptTargetLogprobs(values, self.layout)


@dataclass(frozen=True)
class PromptTargetLogprobs:
    """The logprobs of a request's ids, in its grid's shape and layout."""

    logprobs: np.ndarray  # float32, (len(prompt) - 1, K)
    layout: CsrLayout | None = None

    def listed(self) -> np.ndarray:
        """The listed cells' values: all of them, row-major, if dense."""
        if self.layout is None:
            return self.logprobs.reshape(-1)
        cells: np.ndarray = self.logprobs[self.layout.rows(), self.layout.col_indices]
        return cells
