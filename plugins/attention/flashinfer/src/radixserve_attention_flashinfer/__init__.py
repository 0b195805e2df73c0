"""radixserve attention backend ``flashinfer``: FlashInfer's paged-KV prefill and decode
kernels over radixserve's KV pool (extend over a cached prefix, target verify with a tree
mask, decode, sliding windows, fp8 KV storage, CUDA-graph capture of decode).

Needs an NVIDIA GPU and the ``flashinfer-python`` package, which compiles its kernels
with nvcc on first use. Nothing here imports flashinfer: the factory does, so listing
plugins stays fast and works where it is missing (the probe says why it is unavailable).
"""

from __future__ import annotations

import importlib.util

from radixserve.plugin_api import hookimpl

INSTALL_HINT = "pip install flashinfer-python"


def unavailable_reason() -> str | None:
    """``None`` when the backend can run here, else every reason it cannot."""
    reasons = []
    if importlib.util.find_spec("flashinfer") is None:
        reasons.append(f"flashinfer is not installed ({INSTALL_HINT})")
    import torch

    if torch.version.hip:
        reasons.append("needs an NVIDIA GPU (FlashInfer has no ROCm build)")
    elif not torch.cuda.is_available():
        reasons.append("needs an NVIDIA GPU with CUDA (torch sees none)")
    if reasons:
        return "; ".join(reasons)
    try:  # only on a CUDA machine with flashinfer installed: a broken install shows here
        importlib.import_module("flashinfer")
    except Exception as e:
        return f"flashinfer is installed but does not import ({type(e).__name__}: {e})"
    return None


def make_backend(ctx, **kwargs):
    """Factory: imports flashinfer and builds :class:`~.backend.FlashInferAttention`."""
    from radixserve_attention_flashinfer.backend import FlashInferAttention

    return FlashInferAttention(ctx, **kwargs)


make_backend.supports_target_verify = True  # what the backend class declares (radixserve plugins lists it)
make_backend.supports_mla = True


@hookimpl
def register_attention_backends(register):
    register(
        "flashinfer",
        make_backend,
        probe=unavailable_reason,
        description="FlashInfer paged prefill/decode wrappers, planned once per step; NVIDIA GPU",
    )
