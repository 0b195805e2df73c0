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
# the flashinfer attention plugin: FlashInfer 0.7.0 (Python and kernel sources, JIT-compiled with nvcc on
# first use; 0.7.1 and later are 59-97 MB wheels, over the carry budget) and apache-tvm-ffi, the only
# dependency its attention path imports that the GPU image lacks (cutlass-dsl, cudnn-frontend, cuda-tile,
# nccl4py and nccl-extensions serve other kernels: left out). 36 MB together.
# Precompiled kernels are not carried: flashinfer-cubin is 281 MB (and PyPI has none for 0.7.x),
# flashinfer-jit-cache is not on PyPI at all; both are over the 64 MiB a device run carries. So
# scripts/gpu_check.sh compiles the kernels its steps use in one "warm" step before timing
# anything, and reports how long that took.
python -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --python-version 3.12 --implementation cp --platform manylinux_2_28_x86_64 --dest gpu-wheels flashinfer-python==0.7.0 apache-tvm-ffi==0.1.15.post2
# DeepGEMM for the deep_gemm MoE runners: SGLang's fork, same API, cu13, 5 MB; its prebuilt
# library is linked against one torch build, unverified with the image's torch 2.11 (the
# runner's probe reports the import error if it does not load)
python -m pip download --quiet --disable-pip-version-check --no-deps --only-binary=:all: --dest gpu-wheels sgl-deep-gemm==0.2.5
du -sh gpu-wheels
