"""radixserve attention backends ``fa3`` (FlashAttention-3, Hopper) and ``fa2``
(FlashAttention-2 2.6+, Ampere and newer), SGLang's names, over the paged KV pool.

Neither library is imported here: the probes (``probes.py``) import them only on a machine
with a CUDA device and check that they take every argument the backend passes (a broken,
too old or partial build then shows as the reason), and the factories import them when a
backend is built, so ``radixserve plugins`` stays fast and works without them.
"""

from __future__ import annotations

from radixserve.plugin_api import hookimpl

from radixserve_attention_flash_attn.probes import (  # noqa: F401  (the plugin's public names)
    FA2_CALLS,
    FA2_MIN_VERSION,
    FA3_CALLS,
    fa2_unavailable_reason,
    fa3_unavailable_reason,
)


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
        description="FlashAttention-2 (2.6+): paged KV at page sizes of 256*k, else gather + varlen",
    )
