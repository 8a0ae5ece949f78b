"""tinkerrpc benchmarks: each figure is ours vs what a user would run instead, measured side by side in
one run on one machine. Run `python -m bench` (full) or `python -m bench --short` (harness check)."""
