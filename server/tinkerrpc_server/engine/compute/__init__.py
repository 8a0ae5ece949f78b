"""The engine's compute core: model forward passes, sampling and training steps."""
