#!/usr/bin/env bash
# Downloads, here, the wheels scripts/gpu_check.sh installs on a GPU machine that has no
# package index: they go to gpu-wheels/ (git-ignored), which a device run carries along
# (`carry: ["gpu-wheels"]`, 64 MiB at most in all). Never torch: the GPU image has its own.
#
#   bash scripts/fetch_gpu_wheels.sh
set -euo pipefail
cd "$(dirname "$0")/.."
mkdir -p gpu-wheels
# int8/int4 weight-only quantization on CUDA (radixserve.quantization.torchao_gpu)
python -m pip download --quiet --disable-pip-version-check --no-deps --dest gpu-wheels torchao==0.18.0
du -sh gpu-wheels
