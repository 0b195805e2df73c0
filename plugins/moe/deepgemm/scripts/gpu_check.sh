#!/usr/bin/env bash
# The deep_gemm MoE runners on a GPU machine: DeepGEMM's real FP8 and BF16 grouped GEMMs
# against the torch_native runner at released MoE models' shapes (both layouts), and
# TIMING lines against torch_native. Also runs the CPU tests of the layouts.
#
#   bash plugins/moe/deepgemm/scripts/gpu_check.sh [OUT_DIR]
#
# deep_gemm is not on a package index in usable form: it is installed here only from a
# wheel in gpu-wheels/ (scripts/fetch_gpu_wheels.sh), never resolved, torch never touched.
# Without a usable deep_gemm (or without an sm90/sm100 GPU) the runners are reported
# UNAVAILABLE with the probe's reason and the script exits 0: that is not a failure.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT_DIR="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$OUT_DIR"

PIP="python -m pip install --quiet --disable-pip-version-check --no-deps"
python -c "import pytest" 2>/dev/null || { echo "gpu_check.sh: pytest is missing"; exit 1; }
$PIP --no-build-isolation -e core -e plugins/moe/torch_native -e plugins/moe/deepgemm
if ! python -c "import deep_gemm" 2>/dev/null && ls gpu-wheels/*deep_gemm*.whl >/dev/null 2>&1; then
  $PIP --no-index --find-links gpu-wheels gpu-wheels/*deep_gemm*.whl || true
fi
(nvidia-smi || true) > "$OUT_DIR/smi.txt" 2>&1

REASON=$(python -c "from radixserve_moe_deepgemm import unavailable_reason as r; print(r() or '')" 2>&1 | tail -1)
python -c "import deep_gemm; print('deep_gemm', getattr(deep_gemm, '__version__', '?'))" > "$OUT_DIR/versions.txt" 2>&1 || true
status=0
python -m pytest -q -rs -s -p no:cacheprovider plugins/moe/deepgemm \
  --junitxml "$OUT_DIR/junit.xml" 2>&1 | tee "$OUT_DIR/pytest.log" || status=$?
grep '^TIMING' "$OUT_DIR/pytest.log" > "$OUT_DIR/timings.txt" || true
if [ -n "$REASON" ]; then
  echo "deep_gemm runners UNAVAILABLE here: $REASON (GPU tests skipped; not a failure)" | tee "$OUT_DIR/unavailable.txt"
else
  echo "--- timings (ms per layer forward, bf16 activations; speedup = torch_native / deep_gemm) ---"
  cat "$OUT_DIR/timings.txt"
fi
exit "$status"
