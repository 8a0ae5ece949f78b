"""The engine's errors that a caller can act on: bad input, and an optimizer step refused as non-finite."""

from __future__ import annotations


class EngineUserError(ValueError):
    """Bad input. The message is shown to the SDK user and no state was changed."""


# The server maps a failed optim_step whose message starts with "NON_FINITE_UPDATE:" to its ErrorReason
# of that name (errors.proto), knowing that the model's weights and optimizer state did not change.
NON_FINITE_UPDATE = "NON_FINITE_UPDATE"


class NonFiniteUpdateError(EngineUserError):
    """An optimizer step refused because the loss or gradients since the last step, or the updated
    weights or optimizer state, were not finite: the adapter is as before the step, gradients cleared."""

    def __init__(self, detail: str) -> None:
        super().__init__(f"{NON_FINITE_UPDATE}: {detail}")
