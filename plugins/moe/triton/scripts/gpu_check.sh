#!/usr/bin/env bash
# Runs every test of the triton MoE runner on a GPU machine: correctness at the shapes of
# released MoE models (Mixtral, Qwen2-MoE, Qwen3-MoE, the bench_moe shape) in bf16 against a
# float32 torch reference, fp32/fp16/bf16 with dropped ids and empty experts, the MoE
# conformance suite on CUDA tensors, a CUDA-graph capture of a decode-sized forward, an
# ahead-of-time compile for the machine's own arch, and a timing table against the
# torch_native runner.
#
#   bash plugins/moe/triton/scripts/gpu_check.sh [OUT_DIR]
#
# Uses the machine's torch as it is (never resolves torch from the index: a constraints
# file pins the installed version), installs triton only if it is missing, and installs
# the core and both MoE runners editable. Logs, the junit report and the TIMING lines go
# to OUT_DIR (default: $OUT when set, else ./gpu-check-out).
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
EDITABLE="-e core -e plugins/moe/torch_native -e plugins/moe/triton"
# Offline machines: fall back to no dependency resolution (they must be there already).
$PIP --no-build-isolation $EDITABLE || $PIP --no-build-isolation --no-deps $EDITABLE
python -c "import triton, torch; print('triton', triton.__version__)" | tee "$OUT_DIR/versions.txt"
(nvidia-smi || rocm-smi || true) > "$OUT_DIR/smi.txt" 2>&1

status=0
ARCH=$(python -c "import torch; p = torch.cuda.get_device_capability(); print(p[0] * 10 + p[1])")
if [ -z "$(python -c 'import torch; print(torch.version.hip or "")')" ]; then
  python -m radixserve_moe_triton.compile_check --arch "$ARCH" --dtype bf16 fp16 fp32 \
    2>&1 | tee "$OUT_DIR/compile_check.txt" || status=$?
fi
python -m pytest -q -rs -s -p no:cacheprovider plugins/moe/triton \
  --junitxml "$OUT_DIR/junit.xml" 2>&1 | tee "$OUT_DIR/pytest.log" || status=$?
grep '^TIMING' "$OUT_DIR/pytest.log" > "$OUT_DIR/timings.txt" || true
echo "--- timings (ms per layer forward, bf16, routing uniform at random; speedup = torch_native / triton) ---"
cat "$OUT_DIR/timings.txt"
exit "$status"
