"""Tasks the demo's recipes train on: each generates its problems from a seed and checks answers exactly."""
