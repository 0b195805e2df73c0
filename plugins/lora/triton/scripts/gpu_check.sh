#!/usr/bin/env bash
# Runs every test of the triton LoRA backend on a GPU machine, compiled (not interpreted): the
# LoRA conformance suite on CUDA tensors (float32 and bfloat16, one to three parts, mixed ranks)
# and a tiny engine's mixed-adapter batch against PEFT's tokens.
#
#   bash plugins/lora/triton/scripts/gpu_check.sh [OUT_DIR]
#
# Expects the repository's packages installed (scripts/gpu_check.sh does it). Exits non-zero
# when a test fails, or when the backend reports itself unavailable on a machine with CUDA.
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
from radixserve_lora_triton import unavailable_reason

if unavailable_reason() is not None:
    sys.exit(f"gpu_check.sh: the triton LoRA backend is unavailable on a CUDA machine: {unavailable_reason()}")
PY
python -m pytest -q -rs -p no:cacheprovider plugins/lora/triton --junitxml "$OUT_DIR/junit.xml" 2>&1 \
  | tee "$OUT_DIR/pytest.log"
