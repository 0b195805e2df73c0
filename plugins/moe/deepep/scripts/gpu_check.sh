#!/usr/bin/env bash
# The deepep transport on a GPU machine: DeepEP's normal and low-latency dispatch/combine
# through the a2a conformance suite (one rank per GPU over NCCL), and the installed
# deep_ep.Buffer's signatures against the CPU tests'. Also runs the CPU tests (the
# conversions, the fake-buffer ranks, the calls bound to DeepEP's signatures, the probe).
# Timings: benchmarks/bench_gpu.py.
#
#   bash plugins/moe/deepep/scripts/gpu_check.sh [OUT_DIR]
#
# deep_ep is installed here only from a wheel in gpu-wheels/ (never resolved, torch never
# touched).
#
# Exit status (after the tests; a failing test wins):
#   0  the tests passed, and DeepEP ran here, or there is no CUDA device, or fewer than 2 GPUs
#      (DeepEP's intranode kernels take 2, 4 or 8 ranks): reported UNAVAILABLE, not a failure;
#   1  a test failed, or deep_ep imports on this CUDA machine but the transport reports it
#      unavailable (wrong GPU, or a Buffer API the transport does not call: the probe's
#      reason is printed);
#   4  deep_ep is not installed (not importable at all): nothing of DeepEP was checked.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT_DIR="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$OUT_DIR"

PIP="python -m pip install --quiet --disable-pip-version-check --no-deps"
python -c "import pytest" 2>/dev/null || { echo "gpu_check.sh: pytest is missing"; exit 1; }
$PIP --no-build-isolation -e core -e plugins/moe/a2a_torch -e plugins/moe/deepep
if ! python -c "import deep_ep" 2>/dev/null && ls gpu-wheels/*deep_ep*.whl >/dev/null 2>&1; then
  $PIP --no-index --find-links gpu-wheels gpu-wheels/*deep_ep*.whl || true
fi
(nvidia-smi || true) > "$OUT_DIR/smi.txt" 2>&1

IMPORTABLE=1
IMPORT_ERROR=$(python -c "import deep_ep" 2>&1 | tail -1) || IMPORTABLE=0
HAS_CUDA=$(python -c "import torch; print(int(torch.cuda.is_available()))" 2>/dev/null || echo 0)
REASON=$(python -c "from radixserve_a2a_deepep import unavailable_reason as r; print(r() or '')" 2>&1 | tail -1)
NUM_GPUS=$(python -c "import torch; print(torch.cuda.device_count())" 2>/dev/null || echo 0)
python -c "import deep_ep; print('deep_ep', getattr(deep_ep, '__version__', '?'))" \
  > "$OUT_DIR/versions.txt" 2>&1 || true
status=0
python -m pytest -q -rs -p no:cacheprovider plugins/moe/deepep \
  --junitxml "$OUT_DIR/junit.xml" 2>&1 | tee "$OUT_DIR/pytest.log" || status=$?
result=0
if [ "$IMPORTABLE" -eq 0 ]; then
  echo "deep_ep not installed: import deep_ep fails ($IMPORT_ERROR); no DeepEP kernel was checked" \
    | tee "$OUT_DIR/unavailable.txt"
  result=4
elif [ -n "$REASON" ]; then
  echo "deepep transport UNAVAILABLE here: $REASON" | tee "$OUT_DIR/unavailable.txt"
  if [ "$HAS_CUDA" = "1" ]; then
    echo "deep_ep imports on this CUDA machine but the transport refuses it: FAILED"
    result=1
  else
    echo "(no CUDA device here: the GPU tests were skipped; not a failure)"
  fi
elif [ "$NUM_GPUS" -lt 2 ]; then
  echo "deepep transport UNAVAILABLE here: $NUM_GPUS GPU(s); DeepEP needs 2, 4 or 8 ranks (conformance skipped;" \
    "not a failure)" | tee "$OUT_DIR/unavailable.txt"
fi
if [ "$status" -ne 0 ]; then
  echo "deep_ep gpu_check: tests FAILED (pytest exit $status)"
  exit "$status"
fi
exit "$result"
