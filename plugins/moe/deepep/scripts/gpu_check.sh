#!/usr/bin/env bash
# The deepep transport on a GPU machine: DeepEP's normal and low-latency dispatch/combine
# through the a2a conformance suite (one rank per GPU over NCCL) and TIMING lines against
# torch_distributed. Also runs the CPU tests (the conversions, the fake-buffer ranks).
#
#   bash plugins/moe/deepep/scripts/gpu_check.sh [OUT_DIR]
#
# deep_ep is installed here only from a wheel in gpu-wheels/ (never resolved, torch never
# touched). Without a usable deep_ep, or with fewer than 2 GPUs (DeepEP's intranode
# kernels take 2, 4 or 8 ranks), the GPU tests skip with the reason, the transport is
# reported UNAVAILABLE and the script exits 0: that is not a failure.
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

REASON=$(python -c "
import torch
from radixserve_a2a_deepep import unavailable_reason as r
reason = r()
if reason is None and torch.cuda.device_count() < 2:
    reason = f'{torch.cuda.device_count()} GPU(s); DeepEP needs 2, 4 or 8 ranks'
print(reason or '')" 2>&1 | tail -1)
status=0
python -m pytest -q -rs -s -p no:cacheprovider plugins/moe/deepep \
  --junitxml "$OUT_DIR/junit.xml" 2>&1 | tee "$OUT_DIR/pytest.log" || status=$?
grep '^TIMING' "$OUT_DIR/pytest.log" > "$OUT_DIR/timings.txt" || true
if [ -n "$REASON" ]; then
  echo "deepep transport UNAVAILABLE here: $REASON (GPU tests skipped; not a failure)" | tee "$OUT_DIR/unavailable.txt"
else
  echo "--- timings (ms per dispatch + combine; deepep vs torch_distributed) ---"
  cat "$OUT_DIR/timings.txt"
fi
exit "$status"
