"""Stand-in ``deep_gemm`` modules for the CPU tests (never shipped, never on a GPU).

:class:`FakeDeepGemm` has the functions the runner calls with **sgl-deep-gemm 0.2.5's
signatures**: names, parameter names, order and defaults as the PyPI wheel declares them
(``deep_gemm/__init__.py`` for the GEMMs and ``transform_sf_into_required_layout``,
``deep_gemm/utils/layout.py`` for ``get_mk_alignment_for_contiguous_layout`` and
``get_mn_major_tma_aligned_tensor``). Each function applies the library's host-side checks
(``DG_HOST_ASSERT`` in sgl-project/DeepGEMM ``csrc/apis/gemm.hpp``, ``csrc/apis/layout.hpp``,
``csrc/utils/layout.hpp``, branch dev at 2176dff, the newest published source of the fork;
upstream DeepGEMM 2.6.1 has the same checks) for the architecture it was built for, sm90 or
sm100, including the scale-factor formats (MN-major, TMA-aligned float scales on sm90;
packed UE8M0 ``int32`` on sm100), then computes with plain torch. Rows the library leaves
unspecified are NaN. Every call is recorded in :attr:`FakeDeepGemm.calls` as it was made
(name, positional arguments, keywords) for the tests to bind against the signatures and
inspect.

:func:`deep_gemm_1x` is DeepGEMM 1.0.0's public API (commit 04278f6, ``deep_gemm/__init__.py``):
other names, no ``__version__``. Its functions only record that they were called.
"""

from __future__ import annotations

import functools
import importlib.machinery
import inspect
import types
from dataclasses import dataclass
from typing import Any

import torch

TMA_ALIGNMENT_BYTES = 16  # kNumTMAAlignmentBytes (csrc/utils/math.hpp)


#: sgl-deep-gemm 0.2.5's signatures of the functions the runner calls, as its wheel's
#: ``deep_gemm/__init__.py`` / ``deep_gemm/utils/layout.py`` declare them (annotations left
#: out): the fake's functions must have these, and so must an installed library (GPU test)
SIGNATURES = {
    "get_mk_alignment_for_contiguous_layout": "()",
    "get_mn_major_tma_aligned_tensor": "(sf)",
    "transform_sf_into_required_layout":
        "(sf, mn, k, recipe, num_groups=None, is_sfa=None, disable_ue8m0_cast=False, psum_layout=None)",
    "m_grouped_fp8_gemm_nt_contiguous":
        "(a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None, compiled_dims='nk', "
        "disable_ue8m0_cast=False, use_psum_layout=False, ensure_zero_padding=True, expected_m_for_psum_layout=None, "
        "epilogue=None)",
    "m_grouped_fp8_gemm_nt_masked":
        "(a, b, d, masked_m, expected_m, recipe=None, recipe_a=None, recipe_b=None, compiled_dims='nk', "
        "disable_ue8m0_cast=False, epilogue=None)",
    "m_grouped_bf16_gemm_nt_contiguous":
        "(a, b, d, grouped_layout, compiled_dims='nk', use_psum_layout=False, ensure_zero_padding=True, "
        "expected_m_for_psum_layout=None, epilogue=None)",
    "m_grouped_bf16_gemm_nt_masked": "(a, b, d, masked_m, expected_m, compiled_dims='nk', epilogue=None)",
}


def plain_signature(fn) -> str:
    """``fn``'s signature as text without annotations: names, order, defaults."""
    sig = inspect.signature(fn)
    params = [p.replace(annotation=inspect.Parameter.empty) for p in sig.parameters.values()]
    return str(sig.replace(parameters=params, return_annotation=inspect.Signature.empty))


class HostAssert(RuntimeError):
    """What the library's ``DG_HOST_ASSERT`` raises."""


def _require(ok: bool, what: str) -> None:
    if not ok:
        raise HostAssert(f"deep_gemm would refuse this call: {what}")


@dataclass
class Recorded:
    name: str
    args: tuple
    kwargs: dict


def _recorded(fn):
    """Record each call to ``fn`` as made; ``functools.wraps`` keeps ``fn``'s signature visible."""

    @functools.wraps(fn)
    def wrapper(self, *args, **kwargs):
        self.calls.append(Recorded(fn.__name__, args, kwargs))
        return fn(self, *args, **kwargs)

    return wrapper


def align(x: int, y: int) -> int:
    return -(-x // y) * y


def tma_aligned_size(mn: int, element_size: int) -> int:
    return align(mn, TMA_ALIGNMENT_BYTES // element_size)


def _parse_tensor_or_tuple(x):
    if isinstance(x, (tuple, list)):
        return x[0], x[1]
    _require(isinstance(x, torch.Tensor), "an operand must be a tensor or a (data, scales) pair")
    return x, torch.ones(1, dtype=torch.float32)


def _major_check(t: torch.Tensor) -> None:
    _require(t.dim() in (2, 3), f"operands are 2-D or 3-D, got {t.dim()}-D")
    if t.dim() == 3:
        _require(t.stride(0) == t.size(-2) * t.size(-1), "a 3-D operand's groups must be packed")
    _require(t.stride(-2) == 1 or t.stride(-1) == 1, "an operand must be K-major or MN-major")


def _check_k_major(t: torch.Tensor, what: str) -> None:
    _major_check(t)
    _require(t.stride(-1) == 1, f"{what} must be K-major (stride(-1) == 1), got strides {t.stride()}")


def _check_cd(d: torch.Tensor) -> None:
    _major_check(d)
    _require(d.stride(-1) == 1, f"D must be row-major (stride(-1) == 1), got strides {d.stride()}")


def _check_sf_layout(sf, mn, k, gran_mn, gran_k, num_groups, tma_stride_check=False, sm90_sfb_check=False,
                     type_check=None) -> torch.Tensor:
    if type_check is not None:
        _require(sf.dtype == type_check, f"scales must be {type_check}, got {sf.dtype}")
    _require(sf.dtype in (torch.float32, torch.int32), f"scales are float32 or packed int32, got {sf.dtype}")
    _require(sf.dim() == (num_groups is not None) + 2, f"scales of shape {tuple(sf.shape)}: wrong rank")
    if num_groups is not None:
        _require(sf.size(-3) == num_groups, f"scales for {sf.size(-3)} groups, expected {num_groups}")
    _require(sf.size(-2) == -(-mn // gran_mn), f"scales' MN extent {sf.size(-2)} != ceil({mn} / {gran_mn})")
    per = gran_k * (1 if sf.dtype == torch.float32 else 4)
    _require(sf.size(-1) == -(-k // per), f"scales' K extent {sf.size(-1)} != ceil({k} / {per})")
    if tma_stride_check:
        if num_groups is not None:
            _require(sf.stride(-3) == sf.stride(-1) * sf.size(-1), "grouped scales must be packed per group")
        _require(sf.stride(-2) == 1 or mn == 1, f"scales must be MN-major, got strides {sf.stride()}")
        _require(sf.stride(-1) == tma_aligned_size(mn, sf.element_size()),
                 f"scales' K stride {sf.stride(-1)} != TMA-aligned MN {tma_aligned_size(mn, sf.element_size())}")
    if sm90_sfb_check:
        if num_groups is not None:
            _require(sf.stride(-3) == sf.size(-2) * sf.size(-1), "sm90 weight scales must be packed per group")
        _require((sf.stride(-1) == 1 and sf.stride(-2) == sf.size(-1)) or
                 (sf.stride(-1) == sf.size(-2) and sf.stride(-2) == 1), "sm90 weight scales must be contiguous")
    return sf


def _mn_major_tma_aligned(sf: torch.Tensor) -> torch.Tensor:
    """A copy of ``sf  # [(G,) MN, SF_K]`` with MN contiguous and the MN stride TMA-aligned."""
    batched = sf if sf.dim() == 3 else sf.unsqueeze(0)
    g, mn, sf_k = batched.shape
    tma_mn = tma_aligned_size(mn, sf.element_size())
    out = torch.empty_strided((g, mn, sf_k), (tma_mn * sf_k, 1, tma_mn), dtype=sf.dtype)
    out.copy_(batched)
    return out if sf.dim() == 3 else out.squeeze(0)


def _pack_ue8m0(sf: torch.Tensor) -> torch.Tensor:
    """float32 scales ``[(G,) MN, SF_K]`` -> their exponent bytes (UE8M0, the mantissa dropped),
    four per little-endian int32 along K, MN-major and TMA-aligned: the library's sm100 format."""
    batched = sf if sf.dim() == 3 else sf.unsqueeze(0)
    g, mn, sf_k = batched.shape
    ue8m0 = (batched.contiguous().view(torch.int32) >> 23) & 0xFF  # [G, MN, SF_K]
    ue8m0 = torch.nn.functional.pad(ue8m0, (0, align(sf_k, 4) - sf_k)).long().view(g, mn, -1, 4)
    words = sum(ue8m0[..., j] << (8 * j) for j in range(4))  # [G, MN, ceil(SF_K / 4)]
    words = torch.where(words >= 2**31, words - 2**32, words).to(torch.int32)
    return _mn_major_tma_aligned(words if sf.dim() == 3 else words.squeeze(0))


def _unpack_ue8m0(packed: torch.Tensor, sf_k: int) -> torch.Tensor:
    """The inverse of :func:`_pack_ue8m0` (powers of two): ``# [(G,) MN, SF_K] float32``."""
    words = packed.long() & 0xFFFFFFFF
    exps = torch.stack([(words >> (8 * j)) & 0xFF for j in range(4)], dim=-1).flatten(-2)[..., :sf_k]
    return torch.exp2(exps.float() - 127)


class FakeDeepGemm(types.ModuleType):
    """``deep_gemm`` as the runner sees it on an sm90 or sm100 GPU (see the module docstring)."""

    #: the library's second names for the same functions (sgl-deep-gemm 0.2.5 ``__init__.py``)
    ALIASES = {"m_grouped_fp8_gemm_nt_contiguous": "m_grouped_fp8_fp4_gemm_nt_contiguous",
               "m_grouped_fp8_gemm_nt_masked": "m_grouped_fp8_fp4_gemm_nt_masked"}

    def __init__(self, arch_major: int = 9, alignment: int = 128, version: str = "0.2.5") -> None:
        super().__init__("deep_gemm")
        self.__spec__ = importlib.machinery.ModuleSpec("deep_gemm", None)  # importlib.util.find_spec reads it
        self.arch_major = arch_major
        self.alignment = alignment  # the library's default (kLegacyMKAlignmentForContiguousLayout)
        self.__version__ = version
        self.calls: list[Recorded] = []
        for alias, name in self.ALIASES.items():
            setattr(self, alias, getattr(self, name))

    # ------------------------------------------------------------------ layout helpers
    @_recorded
    def get_mk_alignment_for_contiguous_layout(self) -> int:
        return self.alignment

    @_recorded
    def get_mn_major_tma_aligned_tensor(self, sf: torch.Tensor) -> torch.Tensor:
        _require(sf.dtype == torch.float32 and sf.dim() in (2, 3), "float32 scales of 2 or 3 dims")
        return _mn_major_tma_aligned(sf)

    @_recorded
    def transform_sf_into_required_layout(self, sf, mn, k, recipe, num_groups=None, is_sfa=None,
                                          disable_ue8m0_cast=False, psum_layout=None):
        _require(psum_layout is None, "psum layouts are not modelled by this stand-in")
        return self._transform(sf, mn, k, tuple(recipe), num_groups, is_sfa, disable_ue8m0_cast)

    def _transform(self, sf, mn, k, recipe, num_groups, is_sfa, disable_ue8m0_cast) -> torch.Tensor:
        """``layout::transform_sf_into_required_layout`` (csrc/apis/layout.hpp)."""
        if len(recipe) == 3:
            _require(is_sfa is not None, "a 3-element recipe needs is_sfa")
            gran_mn, gran_k = (recipe[0] if is_sfa else recipe[1]), recipe[2]
        else:
            _require(is_sfa is None, "a 2-element recipe takes no is_sfa")
            gran_mn, gran_k = recipe
        _check_sf_layout(sf, mn, k, gran_mn, gran_k, num_groups)
        fp32, arch = sf.dtype == torch.float32, self.arch_major
        if fp32 and gran_mn == 1 and gran_k == 128 and (arch == 9 or disable_ue8m0_cast):
            return _mn_major_tma_aligned(sf)
        if fp32 and gran_mn == 128 and gran_k == 128 and (arch == 9 or disable_ue8m0_cast):
            return _check_sf_layout(sf, mn, k, gran_mn, gran_k, num_groups, False, True, torch.float32)
        if fp32 and gran_k in (32, 128) and arch == 10:
            _require(not disable_ue8m0_cast, "sm100 float scales need the UE8M0 cast (disable_ue8m0_cast=False)")
            rows = sf if gran_mn == 1 else sf.index_select(-2, torch.arange(mn) // gran_mn)
            return _pack_ue8m0(rows)
        if sf.dtype == torch.int32 and gran_mn == 1 and gran_k in (32, 128) and arch == 10:
            return _check_sf_layout(sf, mn, k, gran_mn, gran_k, num_groups, True, False, torch.int32)
        raise HostAssert(f"deep_gemm would refuse this call: no scale transform for {sf.dtype}, "
                         f"granularity ({gran_mn}, {gran_k}) on sm{arch}0")

    def _default_recipe(self, sfa: torch.Tensor, sfb: torch.Tensor) -> tuple[int, int, int]:
        """``get_default_recipe`` (csrc/utils/layout.hpp)."""
        if self.arch_major == 9:
            _require(sfa.dtype == torch.float32 and sfb.dtype == torch.float32, "sm90 takes float32 scales")
            return 1, 128, 128
        return (1, 128, 128) if sfb.dtype == torch.float32 else (1, 1, 128)

    def _operands(self, a, b, m, n, k, recipe, recipe_a, recipe_b, num_groups_a, num_groups_b, disable_ue8m0_cast):
        """Both FP8 operands dequantised to float32 after the library's scale transforms."""
        (a_data, a_sf), (b_data, b_sf) = a, b
        _require(recipe_a is None and recipe_b is None, "recipe_a/recipe_b are not modelled by this stand-in")
        recipe = tuple(recipe) if recipe is not None else self._default_recipe(a_sf, b_sf)
        sfa = self._transform(a_sf, m, k, recipe, num_groups_a, True, disable_ue8m0_cast)
        sfb = self._transform(b_sf, n, k, recipe, num_groups_b, False, disable_ue8m0_cast)
        want = torch.float32 if self.arch_major == 9 else torch.int32
        _require(sfa.dtype == want, f"sm{self.arch_major}0 kernels read {want} activation scales, got {sfa.dtype}")
        return self._dequant(a_data, sfa, recipe[0], recipe[2]), self._dequant(b_data, sfb, recipe[1], recipe[2])

    @staticmethod
    def _dequant(data: torch.Tensor, sf: torch.Tensor, gran_mn: int, gran_k: int) -> torch.Tensor:
        mn, k = data.shape[-2:]
        if sf.dtype == torch.int32:
            sf, gran_mn = _unpack_ue8m0(sf, -(-k // gran_k)), 1
        rows = sf.repeat_interleave(gran_mn, dim=-2)[..., :mn, :]
        return data.float() * rows.repeat_interleave(gran_k, dim=-1)[..., :k]

    def _check_contiguous_layout(self, grouped_layout: torch.Tensor, num_groups: int) -> None:
        """The M-alignment the contiguous kernels rely on: each block of ``alignment`` rows
        belongs to the expert of its first row (a block whose first row is -1 is skipped)."""
        m = grouped_layout.numel()
        _require(m == 0 or int(grouped_layout.max()) < num_groups, "grouped_layout names an expert past B's")
        for start in range(0, m, self.alignment):
            block = grouped_layout[start:start + self.alignment]
            first = int(block[0])
            valid = block[block >= 0]
            _require((first >= 0 and bool((valid == first).all())) or valid.numel() == 0,
                     f"rows {start}..{start + block.numel() - 1} mix experts or start with padding "
                     f"(each expert's segment must start at a multiple of {self.alignment})")

    @staticmethod
    def _write_contiguous(d, x, w, grouped_layout) -> None:
        d.fill_(float("nan"))  # rows with -1: unspecified
        for e in range(w.shape[0]):
            rows = (grouped_layout == e).nonzero().squeeze(1)
            if rows.numel():
                d[rows] = (x[rows] @ w[e].T).to(d.dtype)

    @staticmethod
    def _write_masked(d, x, w, masked_m) -> None:
        d.fill_(float("nan"))  # rows past masked_m[e]: unspecified
        for e in range(w.shape[0]):
            count = int(masked_m[e])
            _require(0 <= count <= d.shape[1], f"masked_m[{e}] = {count} outside [0, {d.shape[1]}]")
            if count:
                d[e, :count] = (x[e, :count] @ w[e].T).to(d.dtype)

    def _check_grouped(self, a, b, d, counts, what: str, contiguous: bool, fp8: bool) -> tuple[int, int, int, int]:
        """The shape, dtype and major checks the four grouped GEMMs share; ``(G, M, N, K)``."""
        dtype = torch.float8_e4m3fn if fp8 else torch.bfloat16
        _check_k_major(a, "A")
        if not fp8 or self.arch_major == 9:
            _check_k_major(b, "B")
        _require(counts.is_contiguous(), f"{what} must be contiguous")
        _require(a.dtype == dtype and b.dtype == dtype, f"A and B must be {dtype}, got {a.dtype} and {b.dtype}")
        _require(b.dim() == 3 and d.dtype == torch.bfloat16, f"B is [G, N, K] and D bfloat16, got {d.dtype}")
        _require(counts.dtype == torch.int32, f"{what} must be int32, got {counts.dtype}")
        g, n, k = b.shape
        if contiguous:
            _require(a.dim() == 2 and d.dim() == 2, "A is [M, K] and D is [M, N] in the contiguous layout")
            m = a.shape[0]
            _require(tuple(d.shape) == (m, n) and a.shape[1] == k, f"shapes {tuple(a.shape)}, {tuple(b.shape)}, "
                     f"{tuple(d.shape)} are not [M, K], [G, N, K], [M, N]")
            _require(counts.dim() == 1 and counts.numel() == m, f"{what} must be [M] = [{m}]")
        else:
            _require(a.dim() == 3 and d.dim() == 3, "A is [G, M, K] and D is [G, M, N] in the masked layout")
            m = a.shape[1]
            _require(tuple(a.shape) == (g, m, k) and tuple(d.shape) == (g, m, n) and counts.numel() == g,
                     f"shapes {tuple(a.shape)}, {tuple(b.shape)}, {tuple(d.shape)}, {what} {tuple(counts.shape)} "
                     "are not [G, M, K], [G, N, K], [G, M, N], [G]")
            _require(m > 0, "M must be positive in the masked layout")
        _require(n > 0 and k > 0 and g > 0, "N, K and G must be positive")
        _check_cd(d)
        return g, m, n, k

    # ------------------------------------------------------------------ FP8 grouped GEMMs
    @_recorded
    def m_grouped_fp8_fp4_gemm_nt_contiguous(self, a, b, d, grouped_layout, recipe=None, recipe_a=None, recipe_b=None,
                                             compiled_dims='nk', disable_ue8m0_cast=False, use_psum_layout=False,
                                             ensure_zero_padding=True, expected_m_for_psum_layout=None, epilogue=None):
        _require(not use_psum_layout and expected_m_for_psum_layout is None and epilogue is None,
                 "psum layouts and epilogues are not modelled by this stand-in")
        a, b = _parse_tensor_or_tuple(a), _parse_tensor_or_tuple(b)
        g, m, n, k = self._check_grouped(a[0], b[0], d, grouped_layout, "grouped_layout", True, True)
        if m == 0:
            return
        x, w = self._operands(a, b, m, n, k, recipe, recipe_a, recipe_b, None, g, disable_ue8m0_cast)
        self._check_contiguous_layout(grouped_layout, g)
        self._write_contiguous(d, x, w, grouped_layout)

    @_recorded
    def m_grouped_fp8_fp4_gemm_nt_masked(self, a, b, d, masked_m, expected_m, recipe=None, recipe_a=None,
                                         recipe_b=None, compiled_dims='nk', disable_ue8m0_cast=False, epilogue=None):
        _require(epilogue is None, "epilogues are not modelled by this stand-in")
        _require(type(expected_m) is int and expected_m > 0, f"expected_m must be a positive int: {expected_m!r}")
        a, b = _parse_tensor_or_tuple(a), _parse_tensor_or_tuple(b)
        g, m, n, k = self._check_grouped(a[0], b[0], d, masked_m, "masked_m", False, True)
        x, w = self._operands(a, b, m, n, k, recipe, recipe_a, recipe_b, g, g, disable_ue8m0_cast)
        self._write_masked(d, x, w, masked_m)

    # ------------------------------------------------------------------ BF16 grouped GEMMs
    @_recorded
    def m_grouped_bf16_gemm_nt_contiguous(self, a, b, d, grouped_layout, compiled_dims='nk', use_psum_layout=False,
                                          ensure_zero_padding=True, expected_m_for_psum_layout=None, epilogue=None):
        _require(not use_psum_layout and expected_m_for_psum_layout is None and epilogue is None,
                 "psum layouts and epilogues are not modelled by this stand-in")
        g, m, _, _ = self._check_grouped(a, b, d, grouped_layout, "grouped_layout", True, False)
        if m == 0:
            return
        self._check_contiguous_layout(grouped_layout, g)
        self._write_contiguous(d, a.float(), b.float(), grouped_layout)

    @_recorded
    def m_grouped_bf16_gemm_nt_masked(self, a, b, d, masked_m, expected_m, compiled_dims='nk', epilogue=None):
        _require(epilogue is None, "epilogues are not modelled by this stand-in")
        _require(type(expected_m) is int and expected_m > 0, f"expected_m must be a positive int: {expected_m!r}")
        self._check_grouped(a, b, d, masked_m, "masked_m", False, False)
        self._write_masked(d, a.float(), b.float(), masked_m)


def deep_gemm_1x() -> Any:
    """DeepGEMM 1.0.0's public functions (commit 04278f6, ``deep_gemm/jit_kernels/*.py``),
    which record their calls in ``module.calls``; no ``__version__``, as in that release."""
    module = types.ModuleType("deep_gemm")
    module.__spec__ = importlib.machinery.ModuleSpec("deep_gemm", None)
    module.calls = []

    def gemm_fp8_fp8_bf16_nt(lhs, rhs, out):
        module.calls.append("gemm_fp8_fp8_bf16_nt")

    def m_grouped_gemm_fp8_fp8_bf16_nt_contiguous(lhs, rhs, out, m_indices):
        module.calls.append("m_grouped_gemm_fp8_fp8_bf16_nt_contiguous")

    def m_grouped_gemm_fp8_fp8_bf16_nt_masked(lhs, rhs, out, masked_m, expected_m):
        module.calls.append("m_grouped_gemm_fp8_fp8_bf16_nt_masked")

    def get_col_major_tma_aligned_tensor(x):
        module.calls.append("get_col_major_tma_aligned_tensor")
        return x

    def get_m_alignment_for_contiguous_layout():
        module.calls.append("get_m_alignment_for_contiguous_layout")
        return 128

    def ceil_div(x, y):
        return -(-x // y)

    for fn in (gemm_fp8_fp8_bf16_nt, m_grouped_gemm_fp8_fp8_bf16_nt_contiguous, m_grouped_gemm_fp8_fp8_bf16_nt_masked,
               get_col_major_tma_aligned_tensor, get_m_alignment_for_contiguous_layout, ceil_div):
        setattr(module, fn.__name__, fn)
    return module
