"""CPU tests of the runner's calls into ``deep_gemm`` and of the probe, with stand-in modules
(tests/fake_deep_gemm.py) installed as ``sys.modules["deep_gemm"]``.

The runner is built from ``DeepGemmKernels(..., arch_major=9 or 10)`` over
:class:`FakeDeepGemm`, whose functions have sgl-deep-gemm 0.2.5's signatures and apply the
library's host checks, and runs on CPU: every recorded call must bind to the real signature,
match the call table the probe checks (:mod:`radixserve_moe_deepgemm.api`), pass the dtypes,
shapes, contiguity, TMA-aligned scale layouts and M-alignment the library wants, and the
outputs must match the torch_native runner. What this does NOT test: DeepGEMM's kernels
(test_deepgemm_gpu.py does, on a GPU).
"""

from __future__ import annotations

import inspect
import sys

import pytest
import torch
from fake_deep_gemm import SIGNATURES, FakeDeepGemm, HostAssert, deep_gemm_1x, plain_signature, tma_aligned_size
from radixserve.layers.moe import ExpertWeights, MoEContext
from radixserve.testing.moe_conformance import random_experts, random_routing
from radixserve_moe_deepgemm import api, bf16_unavailable_reason, make_runner, unavailable_reason
from radixserve_moe_deepgemm.kernels import DeepGemmKernels, ReferenceGroupedGemm
from radixserve_moe_deepgemm.runner import DeepGemmMoERunner

E, K_TOP, H, INTER = 4, 2, 256, 128
FP8_TOLERANCE = (0.3, 0.1)  # as test_deepgemm_layout.py: FP8 activations, SwiGLU output and weights


@pytest.fixture
def cuda_sm(monkeypatch):
    """Make the probe see a GPU of the given major compute capability (its device checks only)."""
    def install(major: int):
        monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
        monkeypatch.setattr(torch.cuda, "get_device_capability", lambda device=None: (major, 0))
    return install


def _layer(seed=1):
    gen = torch.Generator().manual_seed(seed)
    w13, w2 = random_experts(E, H, INTER, torch.bfloat16, gen)
    return gen, w13, w2


def _ctx():
    return MoEContext(num_experts=E, top_k=K_TOP, hidden_size=H, intermediate_size=INTER, dtype=torch.bfloat16,
                      device=torch.device("cpu"))


def _run(monkeypatch, fp8: bool, arch: int, n: int, masked_max_rows: int = 64):
    """The layer through the runner over a fresh fake (arch ``arch``) and through torch_native."""
    from radixserve_moe_torch import TorchNativeMoERunner

    fake = FakeDeepGemm(arch_major=arch)
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    gen, w13, w2 = _layer()
    runner = DeepGemmMoERunner(_ctx(), DeepGemmKernels(fp8, torch.device("cpu"), arch_major=arch),
                               masked_max_rows=masked_max_rows)
    state = runner.prepare(ExpertWeights(w13, w2))
    case = type("C", (), {"num_tokens": n, "num_experts": E, "top_k": K_TOP, "routing": "softmax"})
    ids, weights = random_routing(case, gen)
    x = torch.randn(n, H, generator=gen).to(torch.bfloat16)
    out = runner.forward(x, ids, weights, state)
    native = TorchNativeMoERunner(_ctx())
    ref = native.forward(x, ids, weights, native.prepare(ExpertWeights(w13, w2))).float()
    # the same runner over the torch stand-in (the library's documented semantics, no fake)
    stand_in = DeepGemmMoERunner(_ctx(), ReferenceGroupedGemm(fp8, alignment=128, round_scale_pow2=arch >= 10),
                                 masked_max_rows=masked_max_rows)
    same = stand_in.forward(x, ids, weights, stand_in.prepare(ExpertWeights(w13, w2))).float()
    return fake, out, ref, same


def _public_name(recorded_name: str) -> str:
    return {v: k for k, v in FakeDeepGemm.ALIASES.items()}.get(recorded_name, recorded_name)


def _is_pow2(t: torch.Tensor) -> bool:
    return bool(torch.equal(torch.exp2(torch.log2(t).round()), t))


def _check_scales(sf: torch.Tensor, arch: int, mn: int, k: int, num_groups: int | None) -> None:
    """Activation scales as the runner hands them over: sm90 MN-major and TMA-aligned, sm100
    contiguous powers of two (the library packs their exponents)."""
    lead = () if num_groups is None else (num_groups,)
    assert sf.dtype == torch.float32 and sf.shape == (*lead, mn, k // 128)
    if arch == 9:
        tma_mn = tma_aligned_size(mn, 4)
        assert sf.stride()[-2:] == (1, tma_mn), sf.stride()
        if num_groups is not None:
            assert sf.stride(0) == tma_mn * (k // 128)
    else:
        assert sf.is_contiguous() and _is_pow2(sf)


def _check_call(call, fake: FakeDeepGemm, fp8: bool, arch: int) -> None:
    name = _public_name(call.name)
    fn = getattr(fake, name)
    inspect.signature(fn).bind(*call.args, **call.kwargs)  # the real signature takes the call as made
    assert plain_signature(fn) == SIGNATURES[name]
    table = {c.name: c for c in api.calls_for(fp8)}
    assert name in table, f"the runner calls {name}, which the probe does not check"
    assert (len(call.args), tuple(call.kwargs)) == (table[name].num_positional, table[name].keywords), name
    cast_kw = {"disable_ue8m0_cast": arch == 9}  # sm100: the library packs power-of-two scales to UE8M0
    if name == "transform_sf_into_required_layout":  # weight scales, once per matrix
        sf, n, k, recipe, groups, is_sfa = call.args
        assert recipe == (1, 128, 128) and groups == E and is_sfa is False and call.kwargs == cast_kw
        assert sf.dtype == torch.float32 and sf.is_contiguous() and sf.shape == (E, -(-n // 128), -(-k // 128))
    elif name == "get_mn_major_tma_aligned_tensor":
        assert arch == 9 and call.args[0].dtype == torch.float32
    elif name.startswith("m_grouped_"):
        a, b, d, counts = call.args[:4]
        contiguous = name.endswith("contiguous")
        a_data, b_data = (a[0], b[0]) if fp8 else (a, b)
        assert a_data.dtype == b_data.dtype == (torch.float8_e4m3fn if fp8 else torch.bfloat16)
        assert a_data.is_contiguous() and b_data.is_contiguous() and d.is_contiguous()
        assert d.dtype == torch.bfloat16 and counts.dtype == torch.int32 and counts.is_contiguous()
        g, n, k = b_data.shape
        assert g == E and d.shape[-1] == n and a_data.shape[-1] == k
        m = a_data.shape[-2]
        assert m % fake.alignment == 0  # contiguous: the library's M alignment; masked: fixed max_m
        if contiguous:
            assert a_data.dim() == 2 and counts.shape == (m,)
        else:
            assert a_data.shape == (E, m, k) and counts.shape == (E,) and type(call.args[4]) is int
        if fp8:
            assert call.kwargs == cast_kw
            _check_scales(a[1], arch, m, k, None if contiguous else E)
            if arch == 9:  # 128x128 block scales as they are
                assert b[1].dtype == torch.float32 and b[1].shape == (E, n // 128, k // 128) and b[1].is_contiguous()
            else:  # packed UE8M0, one row per output channel, MN-major and TMA-aligned
                kp, tma_n = -(-k // 512), tma_aligned_size(n, 4)
                assert b[1].dtype == torch.int32 and b[1].shape == (E, n, kp)
                assert b[1].stride() == (tma_n * kp, 1, tma_n)
        else:
            assert call.kwargs == {}
    else:
        assert name == "get_mk_alignment_for_contiguous_layout" and call.args == () and call.kwargs == {}


def test_fake_has_sgl_deep_gemm_signatures():
    fake = FakeDeepGemm()
    for name, text in SIGNATURES.items():
        assert plain_signature(getattr(fake, name)) == text, name
    assert {c.name for c in api.calls_for(True) + api.calls_for(False)} == set(SIGNATURES)


@pytest.mark.parametrize("arch", [9, 10])
@pytest.mark.parametrize("fp8", [True, False], ids=["fp8", "bf16"])
def test_runner_calls_bind_to_the_real_signatures(monkeypatch, fp8, arch):
    """Both layouts through the fake: every call binds, passes the library's checks and the
    call table; the output matches torch_native and the torch stand-in."""
    names = set()
    for n, layout in ((8, "masked"), (150, "contiguous")):
        fake, out, ref, same = _run(monkeypatch, fp8, arch, n)
        assert out.dtype == torch.bfloat16 and out.shape == (n, H) and torch.isfinite(out).all()
        atol, rtol = FP8_TOLERANCE if fp8 else (3e-2, 3e-2)
        torch.testing.assert_close(out.float(), ref, atol=atol, rtol=rtol)
        torch.testing.assert_close(out.float(), same, atol=2e-2, rtol=2e-2)
        gemms = [c for c in fake.calls if c.name.startswith("m_grouped_")]
        assert len(gemms) == 2 and all(c.name.endswith(layout) for c in gemms)
        for call in fake.calls:
            _check_call(call, fake, fp8, arch)
        names |= {_public_name(c.name) for c in fake.calls}
    expected = {c.name for c in api.calls_for(fp8)} - ({"get_mn_major_tma_aligned_tensor"} if arch == 10 else set())
    assert names == expected


def test_the_fake_refuses_what_the_library_refuses(monkeypatch):
    """The checks the call-site test leans on do fire."""
    fake = FakeDeepGemm(arch_major=9)
    a = torch.zeros(256, 128, dtype=torch.bfloat16)
    b = torch.zeros(2, 128, 128, dtype=torch.bfloat16)
    d = torch.empty(256, 128, dtype=torch.bfloat16)
    layout = torch.tensor([0] * 100 + [-1] * 28 + [1] * 128, dtype=torch.int32)
    fake.m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout)  # the runner's layout: accepted
    with pytest.raises(HostAssert, match="multiple of 128"):  # expert 1 starting mid-block
        fake.m_grouped_bf16_gemm_nt_contiguous(a, b, d, torch.tensor([0] * 100 + [1] * 156, dtype=torch.int32))
    with pytest.raises(HostAssert, match="int32"):
        fake.m_grouped_bf16_gemm_nt_contiguous(a, b, d, layout.long())
    with pytest.raises(HostAssert, match="K-major"):
        fake.m_grouped_bf16_gemm_nt_contiguous(a, b.transpose(1, 2), d, layout)
    with pytest.raises(TypeError):  # a keyword the library does not have
        fake.m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices=layout)
    fp8_a, fp8_b = (a.to(torch.float8_e4m3fn), torch.ones(256, 1)), (b.to(torch.float8_e4m3fn), torch.ones(2, 1, 1))
    with pytest.raises(HostAssert, match="K extent"):  # one scale per 128 channels of K
        fake.m_grouped_fp8_gemm_nt_contiguous((fp8_a[0], torch.ones(256, 2)), fp8_b, d, layout)
    with pytest.raises(HostAssert, match="sm100 kernels read torch.int32"):  # sm100 float scales must be cast
        FakeDeepGemm(arch_major=10).m_grouped_fp8_gemm_nt_contiguous(fp8_a, fp8_b, d, layout, disable_ue8m0_cast=True)
    with pytest.raises(HostAssert, match="positive int"):
        fake.m_grouped_bf16_gemm_nt_masked(a.view(2, 128, 128), b, d.view(2, 128, 128),
                                           torch.tensor([3, 4], dtype=torch.int32), torch.tensor(4))


def test_probe_accepts_the_0_2_5_api(monkeypatch, cuda_sm):
    cuda_sm(9)
    monkeypatch.setitem(sys.modules, "deep_gemm", FakeDeepGemm())
    assert unavailable_reason() is None and bf16_unavailable_reason() is None


def test_probe_refuses_deepgemm_1x(monkeypatch, cuda_sm):
    cuda_sm(9)
    old = deep_gemm_1x()
    monkeypatch.setitem(sys.modules, "deep_gemm", old)
    for fp8, reason in ((True, unavailable_reason()), (False, bf16_unavailable_reason())):
        assert reason is not None
        for call in api.calls_for(fp8):
            assert call.name in reason
        assert "no __version__" in reason and api.NEEDED in reason
        assert ("deep_gemm runner" if fp8 else "deep_gemm_bf16 runner") in reason
    ctx = MoEContext(num_experts=8, top_k=2, hidden_size=128, intermediate_size=128, dtype=torch.bfloat16,
                     device=torch.device("cuda"))
    with pytest.raises(RuntimeError, match="deep_gemm is unavailable: the installed deep_gemm .* lacks "
                                           "get_mk_alignment_for_contiguous_layout, transform_sf_into_required_layout"):
        make_runner(ctx)
    assert old.calls == []  # refused before any call


def test_probe_names_a_changed_signature_and_the_version(monkeypatch, cuda_sm):
    cuda_sm(10)
    fake = FakeDeepGemm(version="2.0.0")

    def m_grouped_fp8_gemm_nt_masked(a, b, d, masked_m, expected_m, recipe=None):  # no disable_ue8m0_cast
        raise AssertionError("never called")

    fake.m_grouped_fp8_gemm_nt_masked = m_grouped_fp8_gemm_nt_masked
    fake.m_grouped_bf16_gemm_nt_masked = None  # an early 2.0.0 had neither masked nor BF16 GEMMs
    monkeypatch.setitem(sys.modules, "deep_gemm", fake)
    reason = unavailable_reason()
    assert reason.startswith("the installed deep_gemm 2.0.0 takes other arguments: m_grouped_fp8_gemm_nt_masked(")
    assert "disable_ue8m0_cast" in reason and api.NEEDED in reason
    bf16 = bf16_unavailable_reason()
    assert "lacks m_grouped_bf16_gemm_nt_masked" in bf16 and "m_grouped_fp8" not in bf16


def test_api_mismatch_without_a_readable_signature_checks_names_only():
    module = type(sys)("deep_gemm")
    for call in api.calls_for(False):
        setattr(module, call.name, min)  # a builtin without a signature Python can read
    assert api.api_mismatch(module, fp8=False) is None
    assert "lacks transform_sf_into_required_layout" in api.api_mismatch(module, fp8=True)


def test_kernels_refuse_an_architecture_deepgemm_lacks(monkeypatch):
    monkeypatch.setitem(sys.modules, "deep_gemm", FakeDeepGemm())
    with pytest.raises(ValueError, match="sm90 or sm100, not compute capability 8.x"):
        DeepGemmKernels(True, torch.device("cpu"), arch_major=8)
