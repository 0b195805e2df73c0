"""The deep_gemm runners on a GPU with DeepGEMM's real kernels (sm90/sm100, deep_gemm
installed; skipped otherwise with the probe's reason): against the torch_native runner at
the shapes of released MoE models, both layouts (masked: batch <= 128 rows, contiguous:
larger). And, wherever ``deep_gemm`` imports on a GPU (also when the probe refuses it), the
installed library's signatures against the ones the CPU tests' stand-in copies
(tests/fake_deep_gemm.py), so a library whose API moved shows which function changed.
Timings live in benchmarks/bench_gpu.py, not here.

Bound, normwise: ``||out - ref|| / ||ref|| <= 1e-2`` for deep_gemm_bf16 (bf16 operands and
SwiGLU output, float32 accumulation) and ``<= 5e-2`` for deep_gemm (FP8 e4m3 activations,
SwiGLU output and weights with 1x128 / 128x128 scales: a relative step of 2^-4 per value,
averaged over K >= 512 terms), ``ref`` being the torch_native runner in bf16.
"""

from __future__ import annotations

import importlib.util

import pytest
import torch
from fake_deep_gemm import SIGNATURES, plain_signature
from radixserve.layers.moe import ExpertWeights, MoEContext, select_experts
from radixserve_moe_deepgemm import make_bf16_runner, make_runner, unavailable_reason

REASON = unavailable_reason()
pytestmark = pytest.mark.gpu
needs_deep_gemm = pytest.mark.skipif(REASON is not None, reason=f"deep_gemm: {REASON}")
IMPORTABLE = torch.cuda.is_available() and importlib.util.find_spec("deep_gemm") is not None

BOUND = {"deep_gemm_bf16": 1e-2, "deep_gemm": 5e-2}
#: (name, experts, top_k, hidden, intermediate): released MoE models' shapes (multiples of 128)
MODELS = [
    ("qwen2-moe-a2.7b", 60, 4, 2048, 1408),
    ("qwen3-moe-30b-a3b", 128, 8, 2048, 768),
    ("bench-0.5b", 48, 8, 1024, 512),
]
BATCHES = (1, 32, 128, 512, 2048)
FACTORIES = {"deep_gemm": make_runner, "deep_gemm_bf16": make_bf16_runner}


def _layer(e, k, h, i, n, seed=0):
    gen = torch.Generator(device="cuda").manual_seed(seed)
    w13 = (torch.randn(e, 2 * i, h, device="cuda", generator=gen) / h**0.5).to(torch.bfloat16)
    w2 = (torch.randn(e, h, i, device="cuda", generator=gen) / i**0.5).to(torch.bfloat16)
    x = torch.randn(n, h, device="cuda", generator=gen).to(torch.bfloat16)
    ids, weights = select_experts(torch.randn(n, e, device="cuda", generator=gen), k, True)
    return x, ids, weights, w13, w2


def _ctx(e, k, h, i):
    return MoEContext(num_experts=e, top_k=k, hidden_size=h, intermediate_size=i, dtype=torch.bfloat16,
                      device=torch.device("cuda"))


def _native(ctx):
    from radixserve_moe_torch import TorchNativeMoERunner

    return TorchNativeMoERunner(ctx)


@needs_deep_gemm
@pytest.mark.parametrize("runner_name", list(FACTORIES))
@pytest.mark.parametrize("model", MODELS, ids=lambda m: m[0])
def test_matches_torch_native(model, runner_name):
    _, e, k, h, i = model
    ctx = _ctx(e, k, h, i)
    runner, native = FACTORIES[runner_name](ctx), _native(ctx)
    for n in BATCHES:
        x, ids, weights, w13, w2 = _layer(e, k, h, i, n, seed=n)
        ref = native.forward(x, ids, weights, native.prepare(ExpertWeights(w13, w2))).float()
        out = runner.forward(x, ids, weights, runner.prepare(ExpertWeights(w13, w2)))
        assert out.shape == x.shape and out.dtype == x.dtype
        err = float((out.float() - ref).norm() / ref.norm())
        assert err <= BOUND[runner_name], f"{model[0]} n={n}: normwise error {err:.3g} > {BOUND[runner_name]}"


@pytest.mark.skipif(not IMPORTABLE, reason="needs CUDA and an installed deep_gemm")
def test_installed_signatures_match_the_cpu_stand_in():
    """Every function the runners call is in the installed deep_gemm; where Python can read its
    signature (sgl-deep-gemm's wrappers; DeepGEMM's pybind functions have none), it is the one
    the CPU tests bind the runner's calls to."""
    import deep_gemm

    missing = [name for name in SIGNATURES if not callable(getattr(deep_gemm, name, None))]
    assert not missing, f"deep_gemm {getattr(deep_gemm, '__version__', '?')} lacks {missing}"
    for name, expected in SIGNATURES.items():
        try:
            found = plain_signature(getattr(deep_gemm, name))
        except (TypeError, ValueError):
            continue
        assert found == expected, f"deep_gemm.{name}{found}: the CPU stand-in has {name}{expected}"
