"""The torch_native MoE runner against the conformance suite, on both of its paths (the
packed CPU-kernel path and plain PyTorch), and which path a layer takes."""

from __future__ import annotations

import pytest
import torch
from radixserve.kernels import cpu as cpu_kernels
from radixserve.layers.moe import ExpertWeights, MoEContext
from radixserve.testing.moe_conformance import CASES, run_case
from radixserve_moe_torch import TorchNativeMoERunner, make_runner

needs_kernels = pytest.mark.skipif(cpu_kernels.load() is None,
                                   reason=f"radixserve CPU kernels unavailable: {cpu_kernels.status()}")


@pytest.mark.parametrize("case", CASES, ids=str)
def test_conforms(case):
    run_case(TorchNativeMoERunner, case)


@pytest.mark.parametrize("case", [c for c in CASES if c.dtype == torch.float32], ids=str)
def test_torch_path_conforms(case):
    run_case(lambda ctx: make_runner(ctx, use_kernels=False), case)


def _ctx(dtype=torch.float32):
    return MoEContext(num_experts=4, top_k=2, hidden_size=32, intermediate_size=16, dtype=dtype,
                      device=torch.device("cpu"))


def _weights(dtype=torch.float32):
    return ExpertWeights(torch.randn(4, 32, 32).to(dtype), torch.randn(4, 32, 16).to(dtype))


@needs_kernels
def test_float32_cpu_takes_the_kernel_path():
    state = TorchNativeMoERunner(_ctx()).prepare(_weights())
    assert state.path == "kernels"
    assert state.w13.shape[:2] == (4, -(-32 // cpu_kernels.load().panel_width))


def test_other_dtypes_and_disabled_kernels_take_the_torch_path(monkeypatch):
    assert TorchNativeMoERunner(_ctx(torch.bfloat16)).prepare(_weights(torch.bfloat16)).path == "torch"
    assert make_runner(_ctx(), use_kernels=False).prepare(_weights()).path == "torch"
    monkeypatch.setenv("RADIXSERVE_CPU_KERNELS", "0")
    cpu_kernels.load.cache_clear()
    try:
        assert TorchNativeMoERunner(_ctx()).prepare(_weights()).path == "torch"
    finally:
        cpu_kernels.load.cache_clear()


@needs_kernels
def test_both_paths_agree_at_decode_and_prefill_sizes():
    g = torch.Generator().manual_seed(0)
    ctx = MoEContext(num_experts=48, top_k=8, hidden_size=256, intermediate_size=96, dtype=torch.float32,
                     device=torch.device("cpu"))
    w = ExpertWeights(torch.randn(48, 192, 256, generator=g) / 16, torch.randn(48, 256, 96, generator=g) / 10)
    fast, plain = TorchNativeMoERunner(ctx), make_runner(ctx, use_kernels=False)
    sf, sp = fast.prepare(w), plain.prepare(w)
    for n in (1, 32, 300):
        x = torch.randn(n, 256, generator=g)
        ids = torch.stack([torch.randperm(48, generator=g)[:8] for _ in range(n)]).to(torch.int32)
        wts = torch.rand(n, 8, generator=g)
        torch.testing.assert_close(fast.forward(x, ids, wts, sf), plain.forward(x, ids, wts, sp),
                                   rtol=1e-4, atol=1e-4)
