#!/usr/bin/env bash
# Check the engine's CUDA path on this machine's GPU in under 8 minutes (docs/devices.md, "Checking on a
# GPU"): the device tests with the engine on the GPU, then a short bench there. Writes bench/gpu-check.log,
# bench/results-gpu.json and bench/results-gpu-models.json (each with its .png).
#
# Exit codes: 0 every stage passed; 1 a stage failed or ran out of time (the log says which);
# 2 bad arguments; 3 refused: no CUDA device here (before anything runs or is written);
# 4 refused: the GPU is there but .venv's torch cannot use it (a CPU build: docs/devices.md says what to
# install; nothing is written under bench/).
set -uo pipefail
cd "${BASH_SOURCE[0]%/*}/.." || exit 1

USAGE="usage: scripts/gpu_check.sh [--no-setup]  (--no-setup: use .venv as it is, without scripts/setup.sh)"
run_setup=1
for arg in "$@"; do
    case $arg in
        --no-setup) run_setup=0 ;;
        -h | --help) echo "$USAGE"; exit 0 ;;
        *) echo "gpu_check: unknown argument '$arg'; $USAGE" >&2; exit 2 ;;
    esac
done

# The device first, with bash builtins and nvidia-smi alone: a machine without a GPU is refused at once.
refuse() {  # refuse CODE REASON
    echo "gpu_check: refused: $2 (exit $1; docs/devices.md, \"Checking on a GPU\")" >&2
    exit "$1"
}
if ! command -v nvidia-smi >/dev/null 2>&1; then
    refuse 3 "no CUDA device on this machine (nvidia-smi is not installed)"
fi
gpus=$(nvidia-smi -L 2>&1)
if [[ ! $gpus =~ (^|$'\n')GPU\ [0-9]+: ]]; then
    refuse 3 "no CUDA device on this machine (nvidia-smi -L: ${gpus%%$'\n'*})"
fi

# The whole check stays under 8 minutes: every stage's limit is cut to what is left of the budget.
BUDGET_S=470
MIN_STAGE_S=20
DEADLINE=$((SECONDS + BUDGET_S))
WORK=$(mktemp -d "${TMPDIR:-/tmp}/gpu-check.XXXXXX")
trap 'rm -rf "$WORK"' EXIT
LOG=/dev/null  # bench/gpu-check.log once the device is known to work
PYTHON=.venv/bin/python
summary=()
failed=0

progress() {
    printf '[gpu_check %d:%02d] %s\n' $((SECONDS / 60)) $((SECONDS % 60)) "$*" | tee -a "$LOG" >&2
}

run_stage() {  # run_stage NAME CAP_S COMMAND...: the command under timeout, its output logged
    local name=$1 cap=$2 left=$((DEADLINE - SECONDS)) limit started=$SECONDS rc=0 outcome
    shift 2
    limit=$((cap < left ? cap : left))
    if ((limit < MIN_STAGE_S)); then
        summary+=("$name: SKIPPED, ${left} s left of the ${BUDGET_S} s budget")
        failed=1
        progress "$name: skipped, ${left} s left"
        return 1
    fi
    progress "$name: start (limit ${limit} s): $*"
    timeout -k 5 "$limit" "$@" 2>&1 | tee -a "$LOG" "$WORK/$name.out" || rc=$?
    case $rc in
        0) outcome="passed" ;;
        124 | 137) outcome="TIMED OUT at ${limit} s" ;;
        *) outcome="FAILED (exit $rc)" ;;
    esac
    summary+=("$name: $outcome in $((SECONDS - started)) s: $(tail -n 1 "$WORK/$name.out")")
    progress "$name: $outcome in $((SECONDS - started)) s"
    ((rc == 0)) || failed=1
    return "$rc"
}

if ((run_setup)); then
    run_stage setup 240 ./scripts/setup.sh || { progress "setup did not finish: nothing checked"; exit 1; }
elif [[ ! -x $PYTHON ]]; then
    echo "gpu_check: --no-setup, but there is no $PYTHON: run ./scripts/setup.sh" >&2
    exit 1
fi

# is_available() can be True while no kernel runs (an architecture the build lacks): run one.
progress "torch: can it use the GPU?"
if ! "$PYTHON" - >"$WORK/torch.out" 2>&1 <<'EOF'; then
import sys

import torch

build = f"CUDA {torch.version.cuda} build" if torch.version.cuda else "CPU build"
if not torch.cuda.is_available():
    sys.exit(f"torch {torch.__version__} in .venv is a {build}: torch.cuda.is_available() is False")
try:
    product = torch.ones(64, 64, device="cuda") @ torch.ones(64, 64, device="cuda")
    assert product[0, 0].item() == 64.0, "a 64x64 matmul of ones gave a wrong sum"
except Exception as error:  # any failure of the first kernel means the same to the check
    sys.exit(f"torch {torch.__version__} ({build}) cannot run a kernel: {type(error).__name__}: {error}")
props = torch.cuda.get_device_properties(0)
print(
    f"device 0: {props.name}, compute capability {props.major}.{props.minor}, "
    f"{props.total_memory / 2**30:.1f} GiB; {torch.cuda.device_count()} visible"
)
print(f"torch {torch.__version__}, CUDA {torch.version.cuda}, cuDNN {torch.backends.cudnn.version()}")
EOF
    reason=$(tail -n 1 "$WORK/torch.out")
    refuse 4 "the GPU is here but .venv's torch cannot use it (${reason}); install a CUDA build of torch"
fi

# From here on everything goes to bench/gpu-check.log, and bench/ holds this run's results only.
rm -f bench/gpu-check.log bench/results-gpu.json bench/results-gpu.png bench/results-gpu-models.json \
    bench/results-gpu-models.png
LOG=bench/gpu-check.log
{
    echo "# scripts/gpu_check.sh, $(date -u '+%Y-%m-%d %H:%M:%S UTC') on $(hostname)"
    echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet HEAD 2>/dev/null || echo ' (with uncommitted changes)')"
    echo "$gpus"
    nvidia-smi --query-gpu=name,driver_version,memory.total --format=csv,noheader 2>&1 | sed 's/^/nvidia-smi: /'
    cat "$WORK/torch.out"
    if [[ -f $WORK/setup.out ]]; then
        echo "## setup"
        cat "$WORK/setup.out"
    fi
} >"$LOG"
progress "device works; log in $LOG"

export TINKER_TELEMETRY=0
# The engine processes the tests start run on the GPU (an engine that cannot use it stops at start).
# float32 first: these tests compare with float32 torch on the CPU at 1e-4 and less.
run_stage tests-float32 120 env TINKERRPC_ENGINE_DEVICE=cuda TINKERRPC_ENGINE_DTYPE=float32 \
    "$PYTHON" -m pytest -q tests/engine/test_engine_sdk.py tests/engine/test_engine_restart.py
# bfloat16, the CUDA default: the model learns there; the CUDA default placement is chosen.
run_stage tests-bfloat16 120 env TINKERRPC_ENGINE_DEVICE=cuda \
    "$PYTHON" -m pytest -q tests/engine/test_engine_sft.py tests/engine_core/test_mixed_precision.py
# The bench in two runs, the second the larger models, so a slow second keeps the first's figures.
run_stage bench 150 "$PYTHON" -m bench --device cuda --short --only training sampling multiturn \
    --out bench/results-gpu.json
run_stage bench-models 600 "$PYTHON" -m bench --device cuda --short --only real_model qwen3_width \
    --out bench/results-gpu-models.json

{
    echo "## summary ($SECONDS s)"
    printf '%s\n' "${summary[@]}"
} | tee -a "$LOG" >&2
exit "$failed"
