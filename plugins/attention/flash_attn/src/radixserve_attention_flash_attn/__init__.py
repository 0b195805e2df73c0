"""radixserve attention backends ``fa3`` (FlashAttention-3, Hopper) and ``fa2``
(FlashAttention-2, Ampere and newer), SGLang's names, over the paged KV pool.

Neither library is imported here: the probes import them only on a machine with a CUDA
device (a broken build then shows as the reason), and the factories import them when a
backend is built, so ``radixserve plugins`` stays fast and works without them.
"""

from __future__ import annotations

import importlib.util

from radixserve.plugin_api import hookimpl

FA2_INSTALL = "pip install flash-attn --no-build-isolation, see the plugin's README.md"
FA3_INSTALL = ("build it from flash-attention's hopper/ directory "
               "(pip install . --no-build-isolation there), see the plugin's README.md")
FA2_MIN_VERSION = (2, 5)  # the paged KV cache (block_table) of flash_attn_varlen_func


def _installed(module: str) -> bool:
    try:
        return importlib.util.find_spec(module) is not None
    except (ImportError, ValueError):
        return False


def fa2_unavailable_reason() -> str | None:
    """``None`` when ``fa2`` can run here, else why not."""
    import torch

    if not torch.cuda.is_available():
        missing = "" if _installed("flash_attn") else f"; flash-attn is not installed either ({FA2_INSTALL})"
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
    version = getattr(flash_attn, "__version__", "0")
    parts = tuple(int(p) for p in version.split(".")[:2] if p.isdigit())
    if parts < FA2_MIN_VERSION:
        return (f"flash-attn {version} is too old: the paged KV cache needs "
                f"{'.'.join(map(str, FA2_MIN_VERSION))}+; {FA2_INSTALL}")
    return None


def fa3_unavailable_reason() -> str | None:
    """``None`` when ``fa3`` can run here, else why not."""
    import torch

    missing = "" if _installed("flash_attn_interface") else (
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
    if not hasattr(flash_attn_interface, "flash_attn_with_kvcache"):
        return f"flash_attn_interface has no flash_attn_with_kvcache: not FlashAttention-3; {FA3_INSTALL}"
    return None


def make_fa3(ctx, **kwargs):
    """Factory of ``fa3``: imports FlashAttention-3 and builds the backend."""
    import flash_attn_interface

    from radixserve_attention_flash_attn.backend import FlashAttention, check_context

    check_context(ctx, "fa3")
    return FlashAttention(ctx, version=3, lib=flash_attn_interface, name="fa3", **kwargs)


def make_fa2(ctx, **kwargs):
    """Factory of ``fa2``: imports flash-attn 2 and builds the backend."""
    import flash_attn

    from radixserve_attention_flash_attn.backend import FlashAttention, check_context

    check_context(ctx, "fa2")
    return FlashAttention(ctx, version=2, lib=flash_attn, name="fa2", **kwargs)


make_fa3.supports_target_verify = True  # what the backend class declares (radixserve plugins lists it)
make_fa2.supports_target_verify = True  # what the backend class declares (radixserve plugins lists it)

@hookimpl
def register_attention_backends(register):
    register(
        "fa3",
        make_fa3,
        probe=fa3_unavailable_reason,
        description="FlashAttention-3 (Hopper): paged KV of any page size, CUDA-graph decode",
    )
    register(
        "fa2",
        make_fa2,
        probe=fa2_unavailable_reason,
        description="FlashAttention-2: paged KV at page sizes of 256*k, else gather + varlen",
    )
