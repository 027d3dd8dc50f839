#!/usr/bin/env bash
# The CUDA path checked on one GPU machine in one run of under 8 minutes; every step's output goes
# into one markdown report whose path is printed last.
#
#   1. pytest -m gpu: the Triton kernels compiled for the device against the torch references, the
#      engine's greedy output on CUDA against transformers, the profiled KV pool;
#   2. benchmarks/kernels.py --quick: each kernel's time, GB/s and fraction of the copy bandwidth;
#   3. the engine on the Llama-3-8B shape with dummy weights in bfloat16, offline batches of 1, 16, 64
#      and 256 (prompt 512, output 128): tok/s, step time, the bandwidth floor, the KV pool against
#      `conveyor plan --gpu $GPU_CHECK_GPU`.
#
# Python: $PYTHON if set; else .venv/bin/python when it imports conveyor and torch; else a venv in
# $TMPDIR that sees the machine's torch, triton and transformers and gets the rest from the wheels
# of `make gpu-check-wheels` (.gpu-check/wheels, carried to a machine without network).
# Report: $OUT/gpu-check.md when $OUT is set, else .gpu-check/gpu-check.md.
set -uo pipefail
cd "$(dirname "$0")/../.."
export PYTHONSAFEPATH=1
root=$PWD
out_dir=${OUT:-$root/.gpu-check}
mkdir -p "$out_dir"
report=$out_dir/gpu-check.md
gpu=${GPU_CHECK_GPU:-h200-141gb}
wheels=$root/.gpu-check/wheels
scratch=$(mktemp -d)
trap 'rm -rf "$scratch"' EXIT

section() { printf '\n## %s\n\n' "$1" >> "$report"; echo "== $1" >&2; }
# fenced TITLE TIMEOUT CMD...: run CMD with a time limit, its output in a code block, its status after.
fenced() {
  local title=$1 limit=$2; shift 2
  section "$title"
  local start=$SECONDS
  { echo '```'; timeout "$limit" "$@" 2>&1 | tail -n 150; local rc=${PIPESTATUS[0]}; echo '```'
    echo; echo "exit status $rc in $((SECONDS - start)) s"; } >> "$report"
}

pick_python() {
  if [ -n "${PYTHON:-}" ]; then echo "$PYTHON"; return; fi
  if [ -x .venv/bin/python ] && .venv/bin/python -c 'import conveyor.server.config, torch' 2>/dev/null; then
    echo "$root/.venv/bin/python"; return
  fi
  local venv=${TMPDIR:-/tmp}/conveyor-gpu-check-venv
  if [ ! -x "$venv/bin/python" ]; then
    python3 -m venv --system-site-packages "$venv" >&2 || return 1
  fi
  if [ -d "$wheels" ]; then
    mapfile -t with_deps < "$wheels/with-deps.txt"
    mapfile -t no_deps < "$wheels/no-deps.txt"
    "$venv/bin/python" -m pip install -q --no-index --find-links "$wheels" "${with_deps[@]}" >&2 &&
      "$venv/bin/python" -m pip install -q --no-index --find-links "$wheels" --no-deps "${no_deps[@]}" >&2 ||
      return 1
  fi
  # The checkout itself, built from the working tree (setuptools comes from the wheels when offline).
  "$venv/bin/python" -m pip install -q --no-index --find-links "$wheels" --no-deps "$root" >&2 || return 1
  echo "$venv/bin/python"
}

{
  echo "# conveyor GPU check, $(date -u +%Y-%m-%dT%H:%MZ)"
  echo
  echo "commit $(git rev-parse --short HEAD 2>/dev/null || echo unknown)$(git diff --quiet 2>/dev/null || echo ' (with local changes)')"
} > "$report"

section "Machine"
{ echo '```'; nvidia-smi --query-gpu=name,memory.total,driver_version --format=csv 2>&1; echo '```'; } >> "$report"
PY=$(pick_python) || { echo "could not set up Python (see above)" >> "$report"; cat "$report"; echo "$report"; exit 1; }
{ echo '```'
  "$PY" - <<'PYEOF' 2>&1
import sys
import torch, triton, transformers
print(f"python {sys.version.split()[0]}, torch {torch.__version__} (CUDA {torch.version.cuda}), "
      f"triton {triton.__version__}, transformers {transformers.__version__}")
print(f"cuda available: {torch.cuda.is_available()}, devices: {torch.cuda.device_count()}")
PYEOF
  echo '```'; } >> "$report"

fenced "pytest -m gpu" 200 "$PY" -m pytest -q -m gpu -p no:cacheprovider -rs \
  tests/integration/test_kernels_backends.py tests/integration/test_engine_gpu.py

fenced "Kernel microbenchmarks (benchmarks/kernels.py --quick)" 100 "$PY" benchmarks/kernels.py --quick

"$PY" -m conveyor.operator.plan --model llama-3-8b --write-config "$scratch/llama-3-8b" > /dev/null
fenced "Engine, Llama-3-8B shape, dummy weights, bfloat16 (benchmarks/offline.py)" 150 \
  "$PY" -m conveyor.benchmarks.offline "$scratch/llama-3-8b" --load-format dummy --dtype bfloat16 \
  --device cuda --batch-sizes 1,16,64,256 --input-len 512 --output-len 128 --plan-model llama-3-8b --plan-gpu "$gpu" \
  --json "$out_dir/offline.json"

echo "$report"
