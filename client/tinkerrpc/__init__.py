"""tinkerrpc: the Python client SDK for the tinkerrpc TrainerService."""
