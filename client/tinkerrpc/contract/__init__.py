"""The tinkerrpc contract's rules in one place (a leaf package: stdlib only)."""
