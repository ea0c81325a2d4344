#!/usr/bin/env bash
# The GPU check of the Pallas kernels (issue: kernels with pure-JAX twins), for a lent accelerator.
# Runs the checkout through PYTHONPATH on the machine's own Python (jax 0.11 + CUDA plugin), installs
# nothing, and stays well inside 15 minutes:
#   1. the kernel tests with the real GPU lowering (tests/kernel_batches.py: INTERPRET is off on a GPU);
#   2. the bundled model's greedy tokens on the GPU (kernels on, as the platform default picks) equal
#      the same run on the CPU backend of the same machine;
#   3. kernel vs reference time per op on V4-Flash-sized shapes (benchmarks/kernel_ops.py).
# Usage (from the repository root): bash scripts/gpu_check.sh [OUT_DIR]
set -uo pipefail
cd "$(dirname "$0")/.."
OUT="${1:-${OUT:-/tmp/gpu_check}}"
mkdir -p "$OUT"
export PYTHONPATH="$PWD${PYTHONPATH:+:$PYTHONPATH}"
PY="${PYTHON:-python3}"
"$PY" -c "import jax; print('jax', jax.__version__, jax.devices())" 2>&1 | tee "$OUT/devices.txt"

echo "== 1. kernel tests on the GPU lowering"
timeout 240 "$PY" -m pytest -q -p no:cacheprovider tests/test_kernel_sparse_attention.py \
    tests/test_kernel_index_select.py tests/test_kernel_grouped_matmul.py 2>&1 | tail -25 | tee "$OUT/kernel_tests.txt"

echo "== 2. greedy tokens: GPU (kernels) vs CPU (references)"
timeout 180 env JAX_PLATFORMS=cuda "$PY" -m tests.pjrt_run > "$OUT/tokens_gpu.json" 2> "$OUT/tokens_gpu.err"
timeout 180 env JAX_PLATFORMS=cpu "$PY" -m tests.pjrt_run > "$OUT/tokens_cpu.json" 2> "$OUT/tokens_cpu.err"
"$PY" - "$OUT" <<'PYEOF' | tee "$OUT/tokens_compare.txt"
import json, sys
out = sys.argv[1]
runs = {}
for name in ("gpu", "cpu"):
    try:
        runs[name] = json.loads(open(f"{out}/tokens_{name}.json").read().strip().splitlines()[-1])
    except Exception as e:
        print(f"{name}: no result ({e}); see tokens_{name}.err")
if len(runs) == 2:
    print("gpu kernels:", runs["gpu"]["kernels"])
    print("greedy tokens equal:", runs["gpu"]["tokens"] == runs["cpu"]["tokens"])
PYEOF

echo "== 3. kernel vs reference per op (V4-Flash extents)"
timeout 300 "$PY" benchmarks/kernel_ops.py --reps 10 2>&1 | tee "$OUT/kernel_ops.txt" | grep -v '^{'
