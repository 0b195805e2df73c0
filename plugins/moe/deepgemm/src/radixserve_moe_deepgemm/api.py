"""What the runners call on ``deep_gemm``, and a check of an imported ``deep_gemm`` against it.

No torch and no ``deep_gemm`` import here: the availability probe uses this on a module it
has imported, and the CPU tests use it on stand-in modules.

Each :class:`Call` is one call site in :mod:`.kernels`: the function's name, how many
positional arguments the call passes and which keywords. A module passes when it has
every function one runner calls and (where Python can read a function's signature) each
accepts its call's arguments. ``import deep_gemm`` alone proves nothing: DeepGEMM 1.0.0
(commit 04278f6) named the grouped GEMMs ``m_grouped_gemm_fp8_fp8_bf16_nt_contiguous`` /
``..._masked`` and the scale helper ``get_col_major_tma_aligned_tensor``, had no BF16
grouped GEMMs and no ``__version__``; the first 2.0.0 commits had the FP8 contiguous GEMM
but neither masked nor BF16 ones.

Verified against sgl-deep-gemm 0.2.5 (the PyPI wheel: ``deep_gemm/__init__.py``, whose
Python wrappers give the signatures, and ``deep_gemm/utils/layout.py``) and DeepGEMM 2.6.1
(github.com/deepseek-ai/DeepGEMM, commit 54e2261: ``csrc/apis/gemm.hpp``,
``csrc/apis/layout.hpp``), which have the same names and parameters for these calls.
"""

from __future__ import annotations

from typing import Any

from radixserve.plugin_api.probes import LibraryCall as Call
from radixserve.plugin_api.probes import check_calls, mismatch_reason

#: the library releases this runner was checked against, for messages
NEEDED = "sgl-deep-gemm 0.2.5 or DeepGEMM 2.6.1 (the same functions)"


#: both runners: the contiguous layout's row alignment (DeepGemmKernels.__init__)
COMMON_CALLS = (Call("get_mk_alignment_for_contiguous_layout", 0),)
#: ``deep_gemm`` (FP8): weight scales once at load, activation scales on sm90, the GEMMs
FP8_CALLS = (
    Call("transform_sf_into_required_layout", 6, ("disable_ue8m0_cast",)),
    Call("get_mn_major_tma_aligned_tensor", 1),
    Call("m_grouped_fp8_gemm_nt_contiguous", 4, ("disable_ue8m0_cast",)),
    Call("m_grouped_fp8_gemm_nt_masked", 5, ("disable_ue8m0_cast",)),
)
#: ``deep_gemm_bf16``: the GEMMs
BF16_CALLS = (
    Call("m_grouped_bf16_gemm_nt_contiguous", 4),
    Call("m_grouped_bf16_gemm_nt_masked", 5),
)


def calls_for(fp8: bool) -> tuple[Call, ...]:
    """Every call the ``deep_gemm`` (``fp8``) or ``deep_gemm_bf16`` runner makes on the library."""
    return COMMON_CALLS + (FP8_CALLS if fp8 else BF16_CALLS)


def api_mismatch(module: Any, fp8: bool) -> str | None:
    """``None`` when ``module`` (an imported ``deep_gemm``) has what the runner calls, else a
    reason naming the missing functions, the version found and the version needed."""
    missing, refused = check_calls(module, calls_for(fp8))
    version = getattr(module, "__version__", None)
    found = f"deep_gemm {version}" if version else "deep_gemm (no __version__, as in DeepGEMM 1.x)"
    runner = "deep_gemm" if fp8 else "deep_gemm_bf16"
    return mismatch_reason(found, missing, refused,
                           f"the {runner} runner needs {NEEDED} (see plugins/moe/deepgemm/README.md)")
