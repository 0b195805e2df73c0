#!/usr/bin/env bash
# The deep_gemm MoE runners on a GPU machine: DeepGEMM's real FP8 and BF16 grouped GEMMs
# against the torch_native runner at released MoE models' shapes (both layouts), and the
# installed library's signatures against the CPU tests' stand-in. Also runs the CPU tests
# (layouts, call sites through the stand-in, the probe). Timings: benchmarks/bench_gpu.py.
#
#   bash plugins/moe/deepgemm/scripts/gpu_check.sh [OUT_DIR]
#
# deep_gemm is not on a package index in usable form: it is installed here only from a
# wheel in gpu-wheels/ (scripts/fetch_gpu_wheels.sh), never resolved, torch never touched.
#
# Exit status (after the tests; a failing test wins):
#   0  the tests passed, and deep_gemm ran here or there is no CUDA device to run it on;
#   1  a test failed, or deep_gemm imports on this CUDA machine but the runners report it
#      unavailable (wrong GPU, or an API the runners do not call: the probe's reason is printed);
#   4  deep_gemm is not installed (not importable at all): nothing of DeepGEMM was checked.
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

IMPORTABLE=1
IMPORT_ERROR=$(python -c "import deep_gemm" 2>&1 | tail -1) || IMPORTABLE=0
HAS_CUDA=$(python -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
REASON=$(python -c "from radixserve_moe_deepgemm import unavailable_reason as r, bf16_unavailable_reason as b
print('; '.join(f'{n}: {x}' for n, x in (('deep_gemm', r()), ('deep_gemm_bf16', b())) if x))" 2>&1 | tail -1)
python -c "import deep_gemm; print('deep_gemm', getattr(deep_gemm, '__version__', '?'))" \
  > "$OUT_DIR/versions.txt" 2>&1 || true
status=0
python -m pytest -q -rs -p no:cacheprovider plugins/moe/deepgemm \
  --junitxml "$OUT_DIR/junit.xml" 2>&1 | tee "$OUT_DIR/pytest.log" || status=$?
result=0
if [ "$IMPORTABLE" -eq 0 ]; then
  echo "deep_gemm not installed: import deep_gemm fails ($IMPORT_ERROR); no DeepGEMM kernel was checked" \
    | tee "$OUT_DIR/unavailable.txt"
  result=4
elif [ -n "$REASON" ]; then
  echo "deep_gemm runners UNAVAILABLE here: $REASON" | tee "$OUT_DIR/unavailable.txt"
  if [ "$HAS_CUDA" = "1" ]; then
    echo "deep_gemm imports on this CUDA machine but the runners refuse it: FAILED"
    result=1
  else
    echo "(no CUDA device here: the GPU tests were skipped; not a failure)"
  fi
fi
if [ "$status" -ne 0 ]; then
  echo "deep_gemm gpu_check: tests FAILED (pytest exit $status)"
  exit "$status"
fi
exit "$result"
