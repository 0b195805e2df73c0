"""The grouped GEMMs the runner calls: DeepGEMM's, and a torch stand-in with the same
semantics for tests.

An operand is a ``bfloat16`` tensor, or for FP8 a pair ``(float8_e4m3fn data, float32
scales)`` in the formats of :mod:`.layout`. Every GEMM is "NT": ``D = A @ B.T`` with
``B  # [E, N, K]`` (one matrix per expert, K contiguous) and ``D`` in ``bfloat16``:

* ``contiguous(a  # [M, K], b, d  # [M, N], m_indices  # [M] int32)``:
  ``d[m] = a[m] @ b[m_indices[m]].T`` where ``m_indices[m] >= 0``;
* ``masked(a  # [E, max_m, K], b, d  # [E, max_m, N], masked_m  # [E] int32, expected_m)``:
  ``d[e, j] = a[e, j] @ b[e].T`` for ``j < masked_m[e]`` (``expected_m``: a hint, the
  typical count per expert).

Rows outside those sets are left unspecified. The calls are listed in :mod:`.api` (which the
probe checks an installed ``deep_gemm`` against) and bound to sgl-deep-gemm 0.2.5's real
signatures by the CPU tests (tests/fake_deep_gemm.py). API verified against sgl-deep-gemm
0.2.5 (the PyPI wheel's ``deep_gemm/__init__.py`` and ``deep_gemm/utils/layout.py``) and
DeepGEMM 2.6.1 (github.com/deepseek-ai/DeepGEMM, commit 54e2261, 2026-06-23): ``csrc/apis/gemm.hpp``
(``register_apis``: names and keyword arguments), ``csrc/apis/layout.hpp``
(``transform_sf_into_required_layout``), ``deep_gemm/utils/__init__.py``
(``get_mk_alignment_for_contiguous_layout``, ``get_mn_major_tma_aligned_tensor``), and
``tests/test_fp8_fp4.py`` / ``tests/test_bf16.py`` / ``tests/generators.py`` (how the
layouts are built).
"""

from __future__ import annotations

from typing import Any

import torch

from radixserve_moe_deepgemm.layout import dequantize_per_block, dequantize_per_token_group

Operand = Any  # torch.Tensor (bf16) or (fp8 data, fp32 scales)


class DeepGemmKernels:
    """DeepGEMM's grouped GEMMs (imports ``deep_gemm``: build on a CUDA sm90/sm100 device).

    ``arch_major`` is the GPU's compute capability major (9: sm90, 10: sm100), which picks
    the scale formats; ``None`` reads it from ``device``. The CPU tests pass it, with a
    stand-in ``deep_gemm`` in ``sys.modules``, to run these call sites without a GPU.
    """

    def __init__(self, fp8: bool, device: torch.device, *, arch_major: int | None = None) -> None:
        import deep_gemm

        if arch_major is None:
            arch_major = torch.cuda.get_device_capability(device)[0]
        if arch_major not in (9, 10):
            raise ValueError(f"deep_gemm runner: DeepGEMM runs on sm90 or sm100, not compute capability {arch_major}.x")
        self.dg = deep_gemm
        self.fp8 = fp8
        self.arch_major = arch_major
        # sm100 reads UE8M0 (power-of-two) scales; the library casts float scales itself
        # unless told not to, so the quantizer rounds them to powers of two already
        self.round_scale_pow2 = arch_major >= 10
        self.alignment = int(deep_gemm.get_mk_alignment_for_contiguous_layout())

    def weight_scales(self, scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
        """The 128x128 block scales ``[E, ceil(N/128), ceil(K/128)]`` in the layout the
        library wants for ``B`` (sm90: checked as they are; sm100: packed UE8M0), once at
        load so no forward transforms them again."""
        return self.dg.transform_sf_into_required_layout(
            scale, n, k, (1, 128, 128), scale.shape[0], False, disable_ue8m0_cast=not self.round_scale_pow2)

    def _lhs(self, a: Operand) -> Operand:
        if not self.fp8:
            return a
        data, scale = a
        if self.arch_major == 9:  # sm90 reads MN-major, TMA-aligned float scales
            scale = self.dg.get_mn_major_tma_aligned_tensor(scale)
        return data, scale

    def contiguous(self, a: Operand, b: Operand, d: torch.Tensor, m_indices: torch.Tensor) -> None:
        if self.fp8:
            self.dg.m_grouped_fp8_gemm_nt_contiguous(self._lhs(a), b, d, m_indices,
                                                     disable_ue8m0_cast=not self.round_scale_pow2)
        else:
            self.dg.m_grouped_bf16_gemm_nt_contiguous(a, b, d, m_indices)

    def masked(self, a: Operand, b: Operand, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int) -> None:
        if self.fp8:
            self.dg.m_grouped_fp8_gemm_nt_masked(self._lhs(a), b, d, masked_m, expected_m,
                                                 disable_ue8m0_cast=not self.round_scale_pow2)
        else:
            self.dg.m_grouped_bf16_gemm_nt_masked(a, b, d, masked_m, expected_m)


class ReferenceGroupedGemm:
    """A test double: the same calls as :class:`DeepGemmKernels`, computed by a loop over
    experts in float32 from the (dequantised) operands, the way the library's documentation
    and tests define them. Rows the library leaves unspecified are set to NaN here, so a
    caller that reads them fails. It does **not** exercise DeepGEMM's kernels."""

    def __init__(self, fp8: bool, alignment: int = 128, round_scale_pow2: bool = False) -> None:
        self.fp8 = fp8
        self.alignment = alignment
        self.round_scale_pow2 = round_scale_pow2
        self.calls: list[str] = []  # which layout each GEMM used, for tests

    def weight_scales(self, scale: torch.Tensor, n: int, k: int) -> torch.Tensor:
        return scale

    def _lhs(self, a: Operand) -> torch.Tensor:
        return dequantize_per_token_group(*a) if self.fp8 else a.float()

    def _rhs(self, b: Operand) -> torch.Tensor:
        return dequantize_per_block(*b) if self.fp8 else b.float()

    def contiguous(self, a: Operand, b: Operand, d: torch.Tensor, m_indices: torch.Tensor) -> None:
        self.calls.append("contiguous")
        x, w = self._lhs(a), self._rhs(b)
        d.fill_(float("nan"))
        for e in range(w.shape[0]):
            rows = (m_indices == e).nonzero().squeeze(1)
            if rows.numel():
                d[rows] = (x[rows] @ w[e].T).to(d.dtype)

    def masked(self, a: Operand, b: Operand, d: torch.Tensor, masked_m: torch.Tensor, expected_m: int) -> None:
        self.calls.append("masked")
        x, w = self._lhs(a), self._rhs(b)
        d.fill_(float("nan"))
        for e in range(w.shape[0]):
            m = int(masked_m[e])
            if m:
                d[e, :m] = (x[e, :m] @ w[e].T).to(d.dtype)
