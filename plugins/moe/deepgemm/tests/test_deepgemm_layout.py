"""CPU tests of the deep_gemm runner's own code: the token order <-> DeepGEMM layout
conversions, the FP8 block-scale formats, and the runner built from them.

These tests do NOT run DeepGEMM's kernels. Where a GEMM is needed they use
``ReferenceGroupedGemm``, a per-expert torch loop following the library's documented
semantics (rows it leaves unspecified are NaN there). The kernels themselves are tested in
test_deepgemm_gpu.py, on an sm90/sm100 GPU with deep_gemm installed; the runner's calls into
the library are checked against its signatures in test_deepgemm_calls.py.
"""

from __future__ import annotations

import pytest
import torch
from radixserve.layers.moe import ExpertWeights, MoEContext
from radixserve.testing.moe_conformance import CASES, random_experts, random_routing, run_case
from radixserve_moe_deepgemm import bf16_unavailable_reason, make_runner, register_moe_runners, unavailable_reason
from radixserve_moe_deepgemm import layout as L
from radixserve_moe_deepgemm.kernels import ReferenceGroupedGemm
from radixserve_moe_deepgemm.runner import DeepGemmMoERunner

#: the bf16 conformance cases, less the largest (the oracle is a Python loop over pairs):
#: every routing kind, batch 0, 1 and up to 256, top-k 1 to 8
BF16_CASES = [c for c in CASES
              if c.dtype == torch.bfloat16 and (c.num_tokens * c.top_k <= 300 or c.routing == "uneven")]
#: FP8 (e4m3: a relative step of 2^-4) on the activations, the SwiGLU output and the
#: weights, against the float32 oracle of the unquantised bf16 values, outputs of magnitude
#: ~1 and dot products of only 32..64 terms: max abs errors of 0.05..0.27 were measured
FP8_TOLERANCE = (0.3, 0.1)


def _routing(n, e, k, seed=0, drop=0.3):
    gen = torch.Generator().manual_seed(seed)
    ids = torch.stack([torch.randperm(e, generator=gen)[:k] for _ in range(n)]).to(torch.int32) if n else \
        torch.empty(0, k, dtype=torch.int32)
    ids = torch.where(torch.rand(n, k, generator=gen) < drop, torch.full_like(ids, -1), ids)
    return ids, torch.rand(n, k, generator=gen)


@pytest.mark.parametrize("n,e,k,align", [(37, 8, 2, 16), (1, 4, 1, 128), (200, 16, 4, 64), (0, 4, 2, 16)])
def test_contiguous_layout_round_trip(n, e, k, align):
    ids, w = _routing(n, e, k)
    x = torch.randn(n, 24)
    lay = L.to_contiguous(ids, e, align)
    counts = torch.bincount(ids[ids >= 0].long(), minlength=e)
    assert lay.num_rows == int(((counts + align - 1) // align * align).sum())
    assert lay.m_indices.dtype == torch.int32 and lay.m_indices.shape == (lay.num_rows,)
    # segments in expert order, each starting at a multiple of the alignment, -1 after its rows
    start = 0
    for ex in range(e):
        c = int(counts[ex])
        seg = lay.m_indices[start:start + c]
        assert (seg == ex).all()
        padded = -(-c // align) * align
        assert (lay.m_indices[start + c:start + padded] == -1).all()
        start += padded
    a = L.gather_contiguous(x, lay)
    assert (a[lay.m_indices < 0] == 0).all()
    assert torch.equal(a[lay.pair_row], x[lay.pair_token])
    # an identity "GEMM" brings back each row times the sum of its valid weights
    back = L.scatter_contiguous(a, lay, w, n)
    expected = x * torch.where(ids >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)
    torch.testing.assert_close(back, expected)


@pytest.mark.parametrize("n,e,k", [(37, 8, 2), (1, 4, 1), (64, 16, 8), (0, 4, 2)])
def test_masked_layout_round_trip(n, e, k):
    ids, w = _routing(n, e, k)
    x = torch.randn(n, 24)
    lay = L.to_masked(ids, e, max_m=max(n, 1))
    counts = torch.bincount(ids[ids >= 0].long(), minlength=e)
    assert lay.masked_m.dtype == torch.int32 and torch.equal(lay.masked_m.long(), counts)
    a = L.gather_masked(x, lay)  # [E, max_m, H]
    assert a.shape == (e, max(n, 1), 24)
    valid = L.masked_row_mask(lay)
    assert (a.masked_select(~valid) == 0).all()
    for ex in range(e):  # expert ex's rows are its tokens in token order
        tokens = (ids == ex).any(1).nonzero().squeeze(1)
        torch.testing.assert_close(a[ex, :len(tokens)], x[tokens])
    back = L.scatter_masked(a, lay, w, n)
    expected = x * torch.where(ids >= 0, w, torch.zeros_like(w)).sum(1, keepdim=True)
    torch.testing.assert_close(back, expected)


def test_contiguous_and_masked_address_the_same_pairs():
    ids, _ = _routing(50, 8, 4, seed=3)
    c, m = L.to_contiguous(ids, 8, 32), L.to_masked(ids, 8, 50)
    assert torch.equal(c.pair_token, m.pair_token) and torch.equal(c.pair_choice, m.pair_choice)
    assert torch.equal(c.m_indices[c.pair_row].long(), m.pair_expert)


@pytest.mark.parametrize("pow2", [False, True])
def test_fp8_formats(pow2):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(5, 3, 200, generator=gen) * 3  # K not a multiple of 128
    q, s = L.quantize_per_token_group(x, pow2)
    assert q.dtype == torch.float8_e4m3fn and q.shape == x.shape and s.shape == (5, 3, 2)
    back = L.dequantize_per_token_group(q, s)
    assert ((back - x).abs() <= x.abs() / 16 + s.repeat_interleave(128, -1)[..., :200] * 2**-9).all()
    w = torch.randn(3, 300, 136, generator=gen)
    qw, sw = L.quantize_per_block(w, pow2)
    assert qw.shape == w.shape and sw.shape == (3, 3, 2)
    torch.testing.assert_close(L.dequantize_per_block(qw, sw), w, atol=0.02, rtol=1 / 16)
    if pow2:
        for scale in (s, sw):
            assert torch.equal(torch.exp2(torch.log2(scale).round()), scale)


def _reference_runner(fp8: bool, masked_max_rows: int):
    def factory(ctx):
        return DeepGemmMoERunner(ctx, ReferenceGroupedGemm(fp8, alignment=16), masked_max_rows=masked_max_rows)
    return factory


#: each case on one of the two layouts, alternately (both layouts see every routing kind
#: but one; test_matches_torch_native_runner runs both on the same layer)
LAYOUT_CASES = [(c, ("contiguous", "masked")[i % 2]) for i, c in enumerate(BF16_CASES)]


@pytest.mark.parametrize("case,path", LAYOUT_CASES, ids=lambda v: str(v))
def test_bf16_conformance_with_reference_gemm(case, path):
    """Layouts + SwiGLU + scatter, with a torch stand-in for DeepGEMM's BF16 GEMMs, pass the
    MoE conformance suite (bf16 cases)."""
    run_case(_reference_runner(False, 0 if path == "contiguous" else 10**6), case)


@pytest.mark.parametrize("case", BF16_CASES[1::3], ids=str)
def test_fp8_conformance_with_reference_gemm(case):
    run_case(_reference_runner(True, 64), case, tolerance=FP8_TOLERANCE)


@pytest.mark.parametrize("fp8", [False, True])
def test_matches_torch_native_runner(fp8):
    """The same layer through torch_native and through the deep_gemm runner (reference GEMMs),
    both layouts: the outputs agree within the bf16 (or FP8) tolerance."""
    from radixserve_moe_torch import TorchNativeMoERunner

    e, k, h, inter = 16, 4, 256, 128
    ctx = MoEContext(num_experts=e, top_k=k, hidden_size=h, intermediate_size=inter, dtype=torch.bfloat16,
                     device=torch.device("cpu"))
    gen = torch.Generator().manual_seed(1)
    w13, w2 = random_experts(e, h, inter, torch.bfloat16, gen)
    native = TorchNativeMoERunner(ctx)
    native_state = native.prepare(ExpertWeights(w13, w2))
    for n, masked_max_rows in ((8, 64), (150, 64)):  # masked, then contiguous
        kernels = ReferenceGroupedGemm(fp8, alignment=32)
        runner = DeepGemmMoERunner(ctx, kernels, masked_max_rows=masked_max_rows)
        state = runner.prepare(ExpertWeights(w13, w2))
        case = type("C", (), {"num_tokens": n, "num_experts": e, "top_k": k, "routing": "softmax"})
        ids, weights = random_routing(case, gen)
        x = torch.randn(n, h, generator=gen).to(torch.bfloat16)
        ref = native.forward(x, ids, weights, native_state).float()
        out = runner.forward(x, ids, weights, state)
        assert out.dtype == torch.bfloat16 and out.shape == x.shape
        assert kernels.calls == ["masked", "masked"] if n <= masked_max_rows else ["contiguous", "contiguous"]
        atol, rtol = FP8_TOLERANCE if fp8 else (3e-2, 3e-2)
        torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)


def test_unavailable_on_cpu_with_reason():
    if torch.cuda.is_available():
        pytest.skip("a CUDA machine: the probe's answer depends on the GPU and deep_gemm")
    reason = unavailable_reason()
    assert reason is not None and "CUDA" in reason
    ctx = MoEContext(num_experts=8, top_k=2, hidden_size=128, intermediate_size=128, dtype=torch.bfloat16,
                     device=torch.device("cpu"))
    with pytest.raises(RuntimeError, match="deep_gemm is unavailable: needs CUDA"):
        make_runner(ctx)


def test_registers_both_names_with_the_probe():
    seen = {}
    register_moe_runners(register=lambda name, factory, probe=None, description="": seen.update({name: probe}))
    assert seen == {"deep_gemm": unavailable_reason, "deep_gemm_bf16": bf16_unavailable_reason}
