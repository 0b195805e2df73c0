"""Availability probes of ``fa2`` and ``fa3``: is there a GPU the kernels run on, and does the
installed library take every argument the backend passes?

What the backend passes is declared here once (``FA2_CALLS``, ``FA3_CALLS``: per library
function, the leading positional parameters in order, then the keywords); the adapters in
``backend.py`` call nothing else, and the CPU tests bind every recorded call against these
lists and the libraries' real signatures. A library that lacks one of them is refused with the
version found, the version needed and the missing names, instead of failing in the first
forward pass with a ``TypeError``.

Versions, from Dao-AILab/flash-attention's history:

* FlashAttention-2 (``flash_attn/flash_attn_interface.py``): ``flash_attn_varlen_func`` takes
  ``block_table`` (a paged KV cache) from v2.5.7, and its log-sum-exp
  (``return_attn_probs=True``) is ``[heads, total_q]`` from v2.6.0 (``[batch, heads,
  max_seqlen_q]`` before, which target verify would misread), hence ``FA2_MIN_VERSION``.
* FlashAttention-3 (``hopper/flash_attn_interface.py``, distribution ``flash_attn_3``): its
  version string was ``3.0.0b1`` from 2024-07 to 2026-02, so it cannot date a build; the
  parameters are checked instead. ``flash_attn_with_kvcache`` takes ``page_table``,
  ``cu_seqlens_q`` and ``max_seqlen_q`` from commit 7a802796 (2025-01-07);
  ``flash_attn_varlen_func`` took ``seqused_q, seqused_k`` as its 6th and 7th positional
  parameters from then to a09abcd3 (2025-02-15), and takes ``return_attn_probs`` from commit
  203b9b3d (2025-08-29).

Nothing here imports torch or a library at import time: the probes do, and only once a CUDA
device is there (a broken build then shows as the reason).
"""

from __future__ import annotations

import importlib.metadata
import importlib.util
import inspect
import re

FA2_INSTALL = "pip install 'flash-attn>=2.6' --no-build-isolation, see the plugin's README.md"
FA3_INSTALL = ("build it from flash-attention's hopper/ directory (pip install . --no-build-isolation "
               "there), see the plugin's README.md")
FA2_MIN_VERSION = (2, 6, 0)
FA2_WHY = ("flash_attn_varlen_func reads a paged KV cache (block_table) from 2.5.7 and returns its "
           "log-sum-exp as [heads, total_q] from 2.6.0")
FA3_NEEDED = ("FlashAttention-3 from flash-attention's hopper/ of 2025-08-29 or later (commit 203b9b3d: "
              "return_attn_probs of flash_attn_varlen_func; page_table, cu_seqlens_q and max_seqlen_q of "
              "flash_attn_with_kvcache since commit 7a802796, 2025-01-07)")

VARLEN_POSITIONAL = ("q", "k", "v", "cu_seqlens_q", "cu_seqlens_k", "max_seqlen_q", "max_seqlen_k")
KVCACHE_POSITIONAL = ("q", "k_cache", "v_cache")

# function -> (leading positional parameters, in order; keyword parameters)
FA2_CALLS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "flash_attn_varlen_func": (VARLEN_POSITIONAL, (
        "softmax_scale", "causal", "window_size", "return_attn_probs", "block_table")),
    "flash_attn_with_kvcache": (KVCACHE_POSITIONAL, (
        "cache_seqlens", "block_table", "softmax_scale", "causal", "window_size")),
}
FA3_CALLS: dict[str, tuple[tuple[str, ...], tuple[str, ...]]] = {
    "flash_attn_with_kvcache": (KVCACHE_POSITIONAL, (
        "cache_seqlens", "page_table", "cu_seqlens_q", "max_seqlen_q", "softmax_scale", "causal",
        "window_size", "return_softmax_lse")),
    "flash_attn_varlen_func": (VARLEN_POSITIONAL, (
        "softmax_scale", "causal", "window_size", "return_attn_probs")),
}

_POSITIONAL = (inspect.Parameter.POSITIONAL_ONLY, inspect.Parameter.POSITIONAL_OR_KEYWORD)
_BY_NAME = (inspect.Parameter.POSITIONAL_OR_KEYWORD, inspect.Parameter.KEYWORD_ONLY)


def installed(module: str) -> bool:
    """Whether ``module`` can be found (installed), without importing it."""
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):  # a parent package that fails to import: there, but broken
        return True


def signature_gaps(module, calls: dict[str, tuple[tuple[str, ...], tuple[str, ...]]]) -> list[str]:
    """What ``module`` lacks of ``calls``, one phrase each: a missing function, leading
    positional parameters in another order, keyword parameters it does not take. Empty when
    every call the backend makes binds."""
    gaps = []
    for name, (positional, keywords) in calls.items():
        fn = getattr(module, name, None)
        if fn is None:
            gaps.append(f"no function {name}")
            continue
        try:
            params = inspect.signature(fn).parameters
        except (TypeError, ValueError):
            gaps.append(f"the signature of {name} cannot be read")
            continue
        kinds = {p.kind for p in params.values()}
        leading = [p.name for p in params.values() if p.kind in _POSITIONAL][:len(positional)]
        if inspect.Parameter.VAR_POSITIONAL not in kinds and leading != list(positional):
            gaps.append(f"{name} takes ({', '.join(leading)}) first, not ({', '.join(positional)})")
        if inspect.Parameter.VAR_KEYWORD in kinds:
            continue  # **kwargs: any keyword binds
        missing = [k for k in keywords if k not in params or params[k].kind not in _BY_NAME]
        if missing:
            gaps.append(f"{name} has no parameter {', '.join(missing)}")
    return gaps


def parse_version(text) -> tuple[int, ...] | None:
    """``"2.5.9.post1"`` -> ``(2, 5, 9)``, ``"2.8.3+cu12torch2.7"`` -> ``(2, 8, 3)``; None when
    it does not start with a number."""
    match = re.match(r"(\d+)(?:\.(\d+))?(?:\.(\d+))?", str(text or ""))
    if match is None:
        return None
    return tuple(int(p) if p else 0 for p in match.groups())


def _dotted(version: tuple[int, ...]) -> str:
    return ".".join(map(str, version))


def fa2_unavailable_reason() -> str | None:
    """``None`` when ``fa2`` can run here, else why not."""
    import torch

    if not torch.cuda.is_available():
        missing = "" if installed("flash_attn") else f"; flash-attn is not installed either ({FA2_INSTALL})"
        return f"needs a CUDA GPU of compute capability 8.0+ (Ampere or newer){missing}"
    if not torch.version.hip:
        major, minor = torch.cuda.get_device_capability()
        if major < 8:
            return f"needs compute capability 8.0+ (Ampere or newer); this GPU is {major}.{minor}"
    try:
        import flash_attn
        from flash_attn import flash_attn_varlen_func, flash_attn_with_kvcache  # noqa: F401
    except Exception as e:  # not installed, or built against another torch/CUDA
        return f"flash-attn is not importable ({type(e).__name__}: {e}); {FA2_INSTALL}"
    found = getattr(flash_attn, "__version__", None)
    version = parse_version(found)
    needed = f"fa2 needs flash-attn {_dotted(FA2_MIN_VERSION)}+ ({FA2_WHY})"
    if version is None:
        return f"flash-attn reports no version (__version__ = {found!r}); {needed}; {FA2_INSTALL}"
    if version < FA2_MIN_VERSION:
        return f"flash-attn {found} is too old: {needed}; {FA2_INSTALL}"
    gaps = signature_gaps(flash_attn, FA2_CALLS)
    if gaps:
        return f"flash-attn {found} lacks what fa2 calls: {'; '.join(gaps)}; {needed}; {FA2_INSTALL}"
    return None


def fa3_build(module) -> str:
    """The installed FlashAttention-3's version, as far as it says: the module's ``__version__``
    (none in the real one) or the ``flash_attn_3`` distribution's."""
    found = getattr(module, "__version__", None)
    if found is None:
        try:
            found = importlib.metadata.version("flash_attn_3")
        except importlib.metadata.PackageNotFoundError:
            return "FlashAttention-3 (flash_attn_interface, version unknown)"
    return f"FlashAttention-3 (flash_attn_interface, flash_attn_3 {found})"


def fa3_unavailable_reason() -> str | None:
    """``None`` when ``fa3`` can run here, else why not."""
    import torch

    missing = "" if installed("flash_attn_interface") else (
        f"; FlashAttention-3 (module flash_attn_interface) is not installed either ({FA3_INSTALL})")
    if not torch.cuda.is_available() or torch.version.hip:
        return f"needs an NVIDIA Hopper GPU (compute capability 9.x; elsewhere use fa2){missing}"
    major, minor = torch.cuda.get_device_capability()
    if major != 9:
        return (f"needs a Hopper GPU (compute capability 9.x), this GPU is {major}.{minor}; "
                "use --attention-backend fa2")
    try:
        import flash_attn_interface
    except Exception as e:
        return (f"FlashAttention-3 (module flash_attn_interface) is not importable "
                f"({type(e).__name__}: {e}); {FA3_INSTALL}")
    gaps = signature_gaps(flash_attn_interface, FA3_CALLS)
    if gaps:
        return (f"{fa3_build(flash_attn_interface)} lacks what fa3 calls: {'; '.join(gaps)}; "
                f"fa3 needs {FA3_NEEDED}; {FA3_INSTALL}")
    return None
