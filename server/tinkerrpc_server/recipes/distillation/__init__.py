"""`tinkerrpc demo --recipe distillation`: the arithmetic teacher distilled into a fresh student."""
